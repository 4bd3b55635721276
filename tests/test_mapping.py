"""Tests for the stable deterministic mapping (paper §3.4, Figures 7 and 8, Table 7)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from hashlib import blake2b

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metasync import mapping as mapping_module
from metasync.mapping import (
    DEFAULT_PARTITIONS,
    HASH_TAG,
    MAX_VNODES,
    StableMapping,
    minimum_moved_copies,
    moved_copies,
    movement,
    vnode_counts,
    vnode_digest,
)

Config = list[tuple[str, int | float]]

N_IDS = 100_000

EQUAL3: Config = [("s0", 10), ("s1", 10), ("s2", 10)]
EQUAL4: Config = [*EQUAL3, ("s3", 10)]
# Figure 8: initial S, (a) after removing B, (b) after adding E(3) to (a).
FIG8: Config = [("A", 1), ("B", 2), ("C", 2), ("D", 1)]
FIG8_A: Config = [("A", 1), ("C", 2), ("D", 1)]
FIG8_B: Config = [("A", 1), ("C", 2), ("D", 1), ("E", 3)]
# Table 7: free tiers in GB.
TABLE7: Config = [("dropbox", 2), ("google", 15), ("box", 10), ("onedrive", 7), ("baidu", 2048)]
FREE4: Config = TABLE7[:4]


def random_ids(n: int, seed: int) -> list[str]:
    """n uniformly random 64-hex-digit object ids from a seeded generator."""
    rng = random.Random(seed)
    return [f"{rng.getrandbits(256):064x}" for _ in range(n)]


@pytest.fixture(scope="module")
def ids() -> list[str]:
    return random_ids(N_IDS, 20_240_611)


def reference_partition(mapping: StableMapping, partition: int) -> tuple[str, ...]:
    """Figure 7 literally: sort every vnode by its key, take the first R distinct backends."""
    vnodes = [
        (vnode_digest(partition, b, j), b.encode("utf-8"), j, b)
        for b in mapping.backend_ids
        for j in range(mapping.vnodes(b))
    ]
    result: list[str] = []
    for *_, backend in sorted(vnodes):
        if backend not in result:
            result.append(backend)
            if len(result) == mapping.replicas:
                break
    return tuple(result)


def counts_preserved(old: StableMapping, new: StableMapping) -> bool:
    """True if every backend present in both mappings has the same vnode count in both."""
    common = set(old.backend_ids) & set(new.backend_ids)
    return all(old.vnodes(b) == new.vnodes(b) for b in common)


# -- vnode rule ------------------------------------------------------------------------


def test_vnode_rule_reproduces_figure8() -> None:
    """gcd-normalised capacities are the vnode counts: Figure 8's S gives N = A1 B2 C2 D1,
    and (b)'s S = {A(1), C(2), D(1), E(3)} gives N = A1 C2 D1 E3."""
    m = StableMapping(FIG8, 2)
    assert {b: m.vnodes(b) for b in m.backend_ids} == {"A": 1, "B": 2, "C": 2, "D": 1}
    m = StableMapping(FIG8_B, 2)
    assert {b: m.vnodes(b) for b in m.backend_ids} == {"A": 1, "C": 2, "D": 1, "E": 3}


def test_vnode_rule_unit_invariant_and_equal() -> None:
    """Only capacity ratios matter (GB vs TB, int vs float give the same counts), and equal
    capacities give equal counts."""
    gb = StableMapping([("a", 2), ("b", 15), ("c", 10)], 1)
    tb = StableMapping([("a", 0.002), ("b", 0.015), ("c", 0.01)], 1)
    assert [gb.vnodes(b) for b in "abc"] == [tb.vnodes(b) for b in "abc"] == [2, 15, 10]
    eq = StableMapping(EQUAL4, 2)
    assert {eq.vnodes(b) for b in eq.backend_ids} == {1}


def test_vnode_rule_caps_total() -> None:
    """Above MAX_VNODES the unit becomes total/MAX_VNODES, counts are rounded to nearest
    and floored at 1: Table 7's 2, 15, 10, 7, 2048 GB become 1, 2, 1, 1, 252 vnodes."""
    m = StableMapping(TABLE7, 1)
    assert m.unit == Fraction(2082, MAX_VNODES)
    assert [m.vnodes(b) for b, _ in TABLE7] == [1, 2, 1, 1, 252]
    assert m.total_vnodes <= MAX_VNODES + len(TABLE7)


@settings(max_examples=60, deadline=None)
@given(
    caps=st.lists(st.integers(1, 10_000), min_size=1, max_size=20),
    scale=st.fractions(min_value=Fraction(1, 1000), max_value=1000),
    seed=st.integers(0, 2**32),
)
def test_vnode_counts_properties(caps: list[int], scale: Fraction, seed: int) -> None:
    """vnode_counts: every count >= 1, total <= MAX_VNODES, equal capacities get equal counts,
    counts are exactly capacity/gcd when those fit, and invariant under scaling and
    permutation."""
    exact = [Fraction(c) for c in caps]
    counts = vnode_counts(exact)
    assert len(counts) == len(caps)
    assert min(counts) >= 1
    assert sum(counts) <= MAX_VNODES + len(caps)
    for i, ci in enumerate(caps):
        for j, cj in enumerate(caps):
            if ci == cj:
                assert counts[i] == counts[j]
    g = math.gcd(*caps)
    if sum(c // g for c in caps) <= MAX_VNODES:
        assert counts == [c // g for c in caps]
    assert vnode_counts([c * scale for c in exact]) == counts
    order = list(range(len(caps)))
    random.Random(seed).shuffle(order)
    assert vnode_counts([exact[i] for i in order]) == [counts[i] for i in order]


def test_vnode_unit_is_kept_across_reconfiguration() -> None:
    """A fresh unit would renormalise survivors (10,10,10 -> +15 halves the unit), but a
    reconfigured mapping keeps the unit, so survivors keep their counts."""
    assert vnode_counts([Fraction(10)] * 3) == [1, 1, 1]
    assert vnode_counts([Fraction(10)] * 3 + [Fraction(15)]) == [2, 2, 2, 3]
    old = StableMapping(EQUAL3, 1)
    grown = old.reconfigured([*EQUAL3, ("x", 15)])
    assert [grown.vnodes(b) for b, _ in EQUAL3] == [1, 1, 1] and grown.vnodes("x") == 2
    t7 = StableMapping(TABLE7, 2)
    shrunk = t7.reconfigured(FREE4)
    assert counts_preserved(t7, shrunk) and shrunk.unit == t7.unit


# -- on-disk format ----------------------------------------------------------------------


def test_vnode_digest_encoding_is_pinned() -> None:
    """vnode_digest is blake2b-64 over tag | partition u64 BE | id length u16 BE | UTF-8 id |
    vnode u32 BE, and its value never changes (it is part of the on-disk format)."""
    msg = b"metasync/mapping/v1\x00" + (0).to_bytes(8, "big") + b"\x00\x01A" + b"\x00" * 4
    assert HASH_TAG == b"metasync/mapping/v1\x00"
    assert vnode_digest(0, "A", 0) == blake2b(msg, digest_size=8).digest()
    assert vnode_digest(0, "A", 0).hex() == "8da5db749c8978fa"
    assert vnode_digest(16383, "dropbox", 7).hex() == "1eafe9258952c5c6"


def test_placements_are_pinned() -> None:
    """Placements of fixed ids never change across versions/machines (format): Figure 8's
    configuration with R=2 and Table 7's with R=3, default H."""
    ids = [f"{k:02x}" * 32 for k in (0x00, 0x01, 0x12, 0xAB, 0xFF)]
    fig8 = StableMapping(FIG8, 2)
    assert [fig8.partition_of(o) for o in ids] == [0, 257, 4626, 11179, 16383]
    assert [fig8.locate(o) for o in ids] == [
        ("A", "B"),
        ("D", "B"),
        ("A", "B"),
        ("C", "D"),
        ("B", "C"),
    ]
    t7 = StableMapping(TABLE7, 3)
    assert [t7.locate(o) for o in ids] == [
        ("baidu", "onedrive", "box"),
        ("baidu", "google", "onedrive"),
        ("baidu", "onedrive", "google"),
        ("baidu", "google", "onedrive"),
        ("baidu", "dropbox", "google"),
    ]


def test_format_doc_test_vector() -> None:
    """The test vector of docs/FORMAT.md section 7: backends a(1), b(2), c(1), R=2,
    H=16384, an id starting dccd27bed95768cc -> partition 10444, vnode keys as listed,
    holders (b, a)."""
    m = StableMapping([("a", 1), ("b", 2), ("c", 1)], 2)
    object_id = "dccd27bed95768cc" + "0" * 46 + "c5"
    assert m.partition_of(object_id) == 10444
    keys = {
        (b, j): vnode_digest(10444, b, j).hex() for b, j in [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    }
    assert keys == {
        ("a", 0): "1cff0b9bf374a73f",
        ("b", 0): "7f1a9a9abcc13269",
        ("b", 1): "1c36e721185f732b",
        ("c", 0): "f9bcaac95c7fc748",
    }
    assert m.locate(object_id) == ("b", "a")


@pytest.mark.parametrize(
    ("config", "replicas"),
    [(FIG8, 2), (FIG8_B, 3), (FREE4, 2), (TABLE7, 1), (TABLE7, 3), (EQUAL4, 4)],
)
def test_matches_figure7_reference(config: Config, replicas: int) -> None:
    """The optimised per-partition computation returns exactly what Figure 7 (sort all
    vnodes, take the first R distinct backends) returns, on every partition of a small H
    and on a sample of partitions of the default H."""
    small = StableMapping(config, replicas, partitions=97)
    for p in range(97):
        assert small.partition_replicas(p) == reference_partition(small, p)
    big = StableMapping(config, replicas)
    for p in random.Random(5).sample(range(DEFAULT_PARTITIONS), 100):
        assert big.partition_replicas(p) == reference_partition(big, p)


# -- determinism and shape ----------------------------------------------------------------


@pytest.mark.parametrize(("config", "replicas"), [(FIG8, 2), (TABLE7, 3), (EQUAL3, 1)])
def test_deterministic_and_order_independent(config: Config, replicas: int) -> None:
    """Same configuration -> same placements, whatever the order of the backend list."""
    sample = random_ids(2_000, 1)
    reference = StableMapping(config, replicas)
    expected = [reference.locate(o) for o in sample]
    shuffled = list(config)
    random.Random(3).shuffle(shuffled)
    for other_config in (config, shuffled):
        mapping_module._orders_for.cache_clear()  # recompute from scratch
        other = StableMapping(other_config, replicas)
        assert other.backend_ids == reference.backend_ids
        assert [other.locate(o) for o in sample] == expected


@pytest.mark.parametrize(
    ("config", "replicas"), [(FIG8, 1), (FIG8, 2), (FIG8, 4), (TABLE7, 3), (EQUAL4, 3)]
)
def test_locate_returns_r_distinct_configured_backends(
    ids: list[str], config: Config, replicas: int
) -> None:
    """locate returns a tuple of exactly R distinct backend ids, all from the configuration."""
    m = StableMapping(config, replicas)
    names = {b for b, _ in config}
    for o in ids[:5_000]:
        placed = m.locate(o)
        assert isinstance(placed, tuple)
        assert len(placed) == replicas == len(set(placed))
        assert set(placed) <= names


def test_partition_depends_only_on_id_and_h() -> None:
    """partition_of(o) == int(o[:16], 16) % H for every configuration; bad ids are rejected."""
    sample = random_ids(1_000, 2)
    maps = [StableMapping(FIG8, 2), StableMapping(TABLE7, 1), StableMapping(EQUAL3, 3)]
    for o in sample:
        expected = int(o[:16], 16) % DEFAULT_PARTITIONS
        assert {m.partition_of(o) for m in maps} == {expected}
    assert StableMapping(FIG8, 1, partitions=20).partition_of("f" * 64) == (2**64 - 1) % 20
    bad = ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "", " " + "a" * 63, "0x" + "a" * 62]
    for o in bad:
        with pytest.raises(ValueError):
            maps[0].locate(o)
    with pytest.raises(ValueError):
        maps[0].partition_replicas(DEFAULT_PARTITIONS)


# -- balance --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [EQUAL3, FIG8, TABLE7], ids=["equal3", "figure8", "table7"])
def test_balance_matches_capacity_share(ids: list[str], config: Config) -> None:
    """R=1 over 100,000 random ids: each backend's share of objects is within 2 percentage
    points of its capacity share capacity/sum(capacities). For Table 7 that share is
    2/2082 = 0.10% (Dropbox), 0.72% (Google), 0.48% (Box), 0.34% (OneDrive) and
    98.37% (Baidu)."""
    m = StableMapping(config, 1)
    placed = Counter(m.locate(o)[0] for o in ids)
    total_capacity = sum(c for _, c in config)
    for backend, capacity in config:
        object_share = placed[backend] / len(ids)
        assert abs(object_share - capacity / total_capacity) <= 0.02, (backend, object_share)


# -- movement -------------------------------------------------------------------------------

# (name, old config, new config); the Table 7 cases also rescale the vnode counts.
RECONFIGURATIONS: list[tuple[str, Config, Config]] = [
    ("figure8(a)-B", FIG8, FIG8_A),
    ("figure8(b)+E", FIG8_A, FIG8_B),
    ("table7-dropbox", TABLE7, TABLE7[1:]),
    ("table7+mega", TABLE7, [*TABLE7, ("mega", 50)]),
]


@pytest.mark.parametrize(
    ("old_config", "new_config"), [pytest.param(o, n, id=name) for name, o, n in RECONFIGURATIONS]
)
def test_movement_near_minimum(ids: list[str], old_config: Config, new_config: Config) -> None:
    """Adding or removing one backend, for R = 1, 2, 3, creates at most 1.1x the theoretical
    minimum of new copies over 100,000 ids (minimum: copies the removed backend held /
    copies the new mapping places on the added backend), and never fewer."""
    for replicas in (1, 2, 3):
        old = StableMapping(old_config, replicas)
        new = old.reconfigured(new_config)
        moved, minimum = movement(old, new, ids)
        assert minimum > 0
        assert minimum <= moved <= 1.1 * minimum, (replicas, moved, minimum)


STABLE_REMOVALS = [
    pytest.param(old, new, r, id=f"{name}-R{r}")
    for name, old, new in [
        ("equal4-1", EQUAL4, EQUAL3),
        ("figure8(a)-B", FIG8, FIG8_A),
    ]
    for r in (1, 2, 3)
]


@pytest.mark.parametrize(("old_config", "new_config", "replicas"), STABLE_REMOVALS)
def test_removal_moves_only_copies_of_removed_backend(
    old_config: Config, new_config: Config, replicas: int
) -> None:
    """Removing a backend while the others keep their vnode counts never moves a copy that
    did not live on it: for every partition (so every possible object), new set ⊇ old set
    minus the removed backend, and for pure removal moved == minimum exactly."""
    old = StableMapping(old_config, replicas)
    new = old.reconfigured(new_config)
    assert counts_preserved(old, new)
    removed = set(old.backend_ids) - set(new.backend_ids)
    for p in range(DEFAULT_PARTITIONS):
        assert set(old.partition_replicas(p)) - removed <= set(new.partition_replicas(p))
    sample = random_ids(2_000, 4)
    assert moved_copies(old, new, sample) == minimum_moved_copies(old, new, sample)


def test_movement_definitions() -> None:
    """moved_copies counts copies in the new set but not the old one; minimum_moved_copies is
    max(R_new - surviving old copies, copies on added backends, 0) per object: 0 for an
    unchanged configuration, R_new - R_old per object when only R grows; movement returns
    both; a malformed id raises ValueError."""
    sample = random_ids(3_000, 6)
    r2 = StableMapping(FIG8, 2)
    assert moved_copies(r2, StableMapping(list(reversed(FIG8)), 2), sample) == 0
    assert minimum_moved_copies(r2, r2, sample) == 0
    r3 = StableMapping(FIG8, 3)
    assert moved_copies(r2, r3, sample) == minimum_moved_copies(r2, r3, sample) == len(sample)
    # Literal definitions, per object, for a removal and an addition (and a change of H,
    # which takes the per-object path).
    for old, new in [
        (r2, StableMapping(FIG8_A, 2)),
        (StableMapping(FIG8_A, 2), StableMapping(FIG8_B, 2)),
        (r2, StableMapping(FIG8, 2, partitions=7)),
    ]:
        removed = set(old.backend_ids) - set(new.backend_ids)
        added = set(new.backend_ids) - set(old.backend_ids)
        moved = sum(len(set(new.locate(o)) - set(old.locate(o))) for o in sample)
        minimum = sum(
            max(
                new.replicas - len(set(old.locate(o)) - removed),
                len(set(new.locate(o)) & added),
                0,
            )
            for o in sample
        )
        assert moved_copies(old, new, sample) == moved
        assert minimum_moved_copies(old, new, sample) == minimum
        assert movement(old, new, iter(sample)) == (moved, minimum)
    with pytest.raises(ValueError):
        moved_copies(r2, r2, [*sample[:5], "XYZ"])


KNOWN_RENORMALISATIONS = [
    pytest.param(EQUAL3, [*EQUAL3, ("x", 15)], 1, id="gcd-10x3+15-R1"),
    pytest.param(TABLE7, FREE4, 2, id="table7-baidu-R2"),
]


@pytest.mark.parametrize(("old_config", "new_config", "replicas"), KNOWN_RENORMALISATIONS)
def test_movement_when_a_fresh_unit_would_change_survivors(
    ids: list[str], old_config: Config, new_config: Config, replicas: int
) -> None:
    """Reconfigurations that would renormalise the survivors' vnodes if the unit were
    recomputed (a new gcd, the MAX_VNODES scaling stopping) still move at most 1.1x
    the minimum, because the unit is kept."""
    old = StableMapping(old_config, replicas)
    new = old.reconfigured(new_config)
    assert counts_preserved(old, new)
    moved, minimum = movement(old, new, ids[:20_000])
    assert minimum <= moved <= 1.1 * minimum


# -- hypothesis properties -------------------------------------------------------------------


HypConfig = tuple[Config, int, int]


@st.composite
def configs(draw: st.DrawFn, min_size: int = 2) -> HypConfig:
    """2-6 backends with capacities 1-100, a replica count R in 1..n, and a small H (so
    that the ids sample below covers most partitions, i.e. most possible objects)."""
    names = draw(
        st.lists(
            st.text(st.characters(codec="utf-8"), min_size=1, max_size=6),
            min_size=min_size,
            max_size=6,
            unique=True,
        )
    )
    caps = draw(st.lists(st.integers(1, 100), min_size=len(names), max_size=len(names)))
    replicas = draw(st.integers(1, len(names)))
    partitions = draw(st.integers(1, 32))
    return list(zip(names, caps, strict=True)), replicas, partitions


HYP_IDS = random_ids(80, 7)
hyp_settings = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


@hyp_settings
@given(cfg=configs())
def test_prop_locate_shape(cfg: HypConfig) -> None:
    """For any config, locate returns R distinct configured backends and agrees with the
    Figure 7 reference."""
    config, replicas, partitions = cfg
    m = StableMapping(config, replicas, partitions)
    names = {b for b, _ in config}
    for o in HYP_IDS:
        placed = m.locate(o)
        assert len(placed) == replicas == len(set(placed))
        assert set(placed) <= names
    for p in range(partitions):
        assert m.partition_replicas(p) == reference_partition(m, p)


@hyp_settings
@given(cfg=configs(), data=st.data())
def test_prop_deterministic(cfg: HypConfig, data: st.DataObject) -> None:
    """For any config, a mapping computed afresh from a permuted backend list places every
    id the same."""
    config, replicas, partitions = cfg
    permuted = data.draw(st.permutations(config))
    a = StableMapping(config, replicas, partitions)
    placed = [a.locate(o) for o in HYP_IDS]
    mapping_module._orders_for.cache_clear()  # recompute, do not share a's cached table
    b = StableMapping(permuted, replicas, partitions)
    assert [b.locate(o) for o in HYP_IDS] == placed


@hyp_settings
@given(cfg=configs(min_size=3), data=st.data())
def test_prop_removal_stability(cfg: HypConfig, data: st.DataObject) -> None:
    """For any config and removed backend (reconfigured, keeping the unit): survivors keep
    their vnode counts, new set ⊇ old set − removed for every id, and moved == minimum."""
    config, replicas, partitions = cfg
    victim = data.draw(st.sampled_from(config))
    survivors = [c for c in config if c != victim]
    replicas = min(replicas, len(survivors))
    old = StableMapping(config, replicas, partitions)
    new = old.reconfigured(survivors, replicas)
    moved, minimum = movement(old, new, HYP_IDS)
    assert moved >= minimum
    assert counts_preserved(old, new)
    for o in HYP_IDS:
        assert set(old.locate(o)) - {victim[0]} <= set(new.locate(o))
    assert moved == minimum


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "replicas", "partitions"),
    [
        pytest.param(FIG8, 0, DEFAULT_PARTITIONS, id="replicas<1"),
        pytest.param(FIG8, 5, DEFAULT_PARTITIONS, id="replicas>n"),
        pytest.param([], 1, DEFAULT_PARTITIONS, id="no-backends"),
        pytest.param([("a", 1), ("a", 2)], 1, DEFAULT_PARTITIONS, id="duplicate-id"),
        pytest.param([("a", 1), ("b", 0)], 1, DEFAULT_PARTITIONS, id="capacity-0"),
        pytest.param([("a", 1), ("b", -3.5)], 1, DEFAULT_PARTITIONS, id="capacity<0"),
        pytest.param([("a", 1), ("b", float("nan"))], 1, DEFAULT_PARTITIONS, id="capacity-nan"),
        pytest.param([("a", 1), ("b", float("inf"))], 1, DEFAULT_PARTITIONS, id="capacity-inf"),
        pytest.param([("", 1)], 1, DEFAULT_PARTITIONS, id="empty-id"),
        pytest.param([("\ud800", 1)], 1, DEFAULT_PARTITIONS, id="surrogate-id"),
        pytest.param(FIG8, 1, 0, id="partitions<1"),
        pytest.param(FIG8, 1, 2**64, id="partitions>=2**64"),
        pytest.param(
            [(f"b{i}", 1) for i in range(MAX_VNODES + 1)],
            1,
            DEFAULT_PARTITIONS,
            id="too-many-backends",
        ),
    ],
)
def test_invalid_configuration_raises_value_error(
    backends: Sequence[tuple[str, int | float]], replicas: int, partitions: int
) -> None:
    """Invalid replicas, duplicate or empty ids, non-positive or non-finite capacities,
    H < 1 and more backends than MAX_VNODES raise ValueError."""
    with pytest.raises(ValueError):
        StableMapping(backends, replicas, partitions)


@pytest.mark.parametrize(
    ("backends", "replicas"),
    [([("a", True)], 1), ([("a", "2")], 1), ([(3, 1)], 1), (FIG8, 1.0)],
)
def test_wrong_types_raise_type_error(
    backends: Sequence[tuple[object, object]], replicas: object
) -> None:
    """bool or non-numeric capacities, non-str ids and non-int replicas raise TypeError."""
    with pytest.raises(TypeError):
        StableMapping(backends, replicas)  # type: ignore[arg-type]
