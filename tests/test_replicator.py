"""The replicator and the store over in-memory backends with injected faults.

Each test builds a :class:`~metasync.store.RemoteStore` over ``memory:`` backends,
each wrapped in a :class:`~metasync.backends.faulty.FaultyBackend` that shares one
set of fault rules, and drives the :class:`~metasync.replicator.Replicator`
directly: refusals, corrupt copies (on the backend, or in the answer), and
answers lost after the write happened. The contract under test is the module
docstring of metasync/replicator.py: nothing is copied that was not verified,
nothing is dropped while a holder's copy is unverified, and the missing-copy
rows say exactly what is still missing.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO

import pytest

from metasync.backends.faulty import ALWAYS, Faults, FaultyBackend, corrupted
from metasync.backends.memory import MemoryBackend, drop_store
from metasync.codec import Codec
from metasync.errors import BackendUnavailable, ObjectUnavailable
from metasync.keys import MasterKey
from metasync.layout import fragment_key, object_key
from metasync.localdb import LocalDB
from metasync.mapping import vnode_unit
from metasync.objects import FORMAT_VERSION, BackendSpec, Config
from metasync.progress import NullReporter
from metasync.replicator import Replicator, Uploaded, take_inventory, verify_stored
from metasync.store import SMALL_READ, RemoteStore, fragment_mapping_of

NAMESPACE = "ns"
_names = itertools.count()


@dataclass
class World:
    """In-memory backends behind shared fault rules, and a replicator over them."""

    faults: Faults
    backends: dict[str, FaultyBackend]
    store: RemoteStore
    db: LocalDB
    codec: Codec
    replicator: Replicator
    reporter: NullReporter

    def stored(self, backend_id: str, key: str) -> bytes | None:
        """What backend ``backend_id`` really holds at ``key`` (no fault applies)."""
        try:
            return self.backends[backend_id].inner.get(key)
        except Exception:
            return None

    def plant(self, backend_id: str, key: str, data: bytes) -> None:
        self.backends[backend_id].inner.put(key, data)


def _config(ids: list[str], replicas: int, erasure: tuple[int, int] | None) -> Config:
    unit = vnode_unit([Fraction(1)] * len(ids))
    return Config(
        format=FORMAT_VERSION, namespace=NAMESPACE,
        backends=tuple(BackendSpec(i, f"memory:{i}", 1.0) for i in ids),
        replicas=replicas, partitions=1024, encryption="aes-256-gcm",
        acceptors=tuple(ids), vnode_unit=(unit.numerator, unit.denominator),
        fault_model="crash", erasure=erasure,
    )


@pytest.fixture
def make_world(tmp_path: Path) -> Iterator[Callable[..., World]]:
    made: list[World] = []
    stores: list[str] = []

    def make(n: int = 3, replicas: int = 2, erasure: tuple[int, int] | None = None) -> World:
        faults = Faults()
        ids = [f"b{i}" for i in range(n)]
        backends: dict[str, FaultyBackend] = {}
        for backend_id in ids:
            name = f"replicator-{os.getpid()}-{next(_names)}"
            stores.append(name)
            inner = MemoryBackend(f"memory:{name}", NAMESPACE)
            inner.create()
            backends[backend_id] = FaultyBackend(inner, faults, label=backend_id)
        codec = Codec(MasterKey.generate())
        store = RemoteStore(_config(ids, replicas, erasure), codec, dict(backends))
        db = LocalDB(tmp_path / f"state-{len(made)}.db")
        reporter = NullReporter()
        world = World(faults, backends, store, db, codec,
                      Replicator(codec, store, db, reporter), reporter)
        made.append(world)
        return world

    yield make
    for world in made:
        world.store.close()
        world.db.close()
    for name in stores:
        drop_store(name)


def _pack(world: World, size: int = 4096) -> tuple[str, bytes]:
    """A stored object as a pack is: any bytes, named by their keyed hash."""
    data = os.urandom(size)
    return world.codec.id_of("pack", data), data


def _loader(data: bytes) -> Callable[[], BinaryIO]:
    return lambda: io.BytesIO(data)


def _upload(world: World, items: list[tuple[str, bytes]]) -> dict[str, dict[str, str]]:
    """Upload ``items``, recording refused copies as missing (as the outbox does);
    return the failures each object's upload reported."""
    reported: dict[str, dict[str, str]] = {}

    def done(placed: Uploaded) -> None:
        reported[placed.stored_id] = placed.missed
        with world.db.transaction():
            for backend_id in placed.missed:
                world.db.add_missing_copy(placed.stored_id, backend_id)

    world.replicator.upload([(sid, _loader(data)) for sid, data in items], done)
    return reported


def _holding(world: World, stored_id: str) -> list[str]:
    """The backends that really hold a whole copy of ``stored_id``."""
    return [b for b in world.backends if world.stored(b, object_key(stored_id)) is not None]


def _fresh_session(world: World) -> None:
    """What a new command starts with: no backend known to be down."""
    world.store.down.clear()


# ---------------------------------------------------------------- uploads
def test_upload_writes_every_holder(make_world: Callable[..., World]) -> None:
    world = make_world()
    items = [_pack(world) for _ in range(20)]
    assert all(not f for f in _upload(world, items).values())
    for sid, data in items:
        holders = world.store.mapping.locate(sid)
        assert len(holders) == 2
        assert all(world.stored(b, object_key(sid)) == data for b in holders)
        assert all(world.stored(b, object_key(sid)) is None for b in world.backends
                   if b not in holders)


def test_a_resumed_upload_sends_only_the_copies_a_holder_lacks_whole(
        make_world: Callable[..., World]) -> None:
    """Ids an earlier command began uploading (``resumed``): a holder with a whole
    copy (same size) is not sent it again and counts as a copy; one with a truncated
    object at the key is sent it (overwritten). Bytes written count only what was
    sent. Ids not resumed are sent as ever."""
    world = make_world()
    whole, truncated, fresh = (_pack(world) for _ in range(3))
    for (sid, _), planted in ((whole, whole[1]), (truncated, truncated[1][:-1])):
        first = world.store.mapping.locate(sid)[0]
        world.backends[first].inner.put(object_key(sid), planted)
    puts: list[tuple[str, str]] = []
    for backend_id, backend in world.backends.items():
        real = backend.put

        def put(key: str, data: object, real: Callable[..., None] = real,
                backend_id: str = backend_id) -> None:
            puts.append((backend_id, key))
            real(key, data)

        backend.put = put  # type: ignore[method-assign]
    placed: dict[str, Uploaded] = {}
    world.replicator.upload([(sid, _loader(data)) for sid, data in (whole, truncated, fresh)],
                            lambda up: placed.__setitem__(up.stored_id, up),
                            {whole[0], truncated[0]})
    for sid, data in (whole, truncated, fresh):
        holders = world.store.mapping.locate(sid)
        assert all(world.stored(b, object_key(sid)) == data for b in holders)
        assert sorted(placed[sid].copies) == sorted(holders) and not placed[sid].missed
    whole_first = world.store.mapping.locate(whole[0])[0]
    assert (whole_first, object_key(whole[0])) not in puts  # not sent again
    assert placed[whole[0]].written == len(whole[1])  # the other holder's copy only
    assert placed[truncated[0]].written == 2 * len(truncated[1])
    assert placed[fresh[0]].written == 2 * len(fresh[1])


def test_upload_records_a_refused_copy_and_fails_only_when_no_holder_took_it(
        make_world: Callable[..., World]) -> None:
    world = make_world()
    sid, data = _pack(world)
    first, second = world.store.mapping.locate(sid)
    world.faults.refuse("put", object_key(sid), backend=first, times=ALWAYS,
                        error=BackendUnavailable)
    assert set(_upload(world, [(sid, data)])[sid]) == {first}
    assert world.stored(second, object_key(sid)) == data
    assert world.db.missing_copies() == [(sid, first)]

    other, other_data = _pack(world)
    world.faults.refuse("put", object_key(other), times=ALWAYS)
    with pytest.raises(ObjectUnavailable, match="could not store 1 object"):
        _upload(world, [(other, other_data)])
    assert not any(sid == other for sid, _ in world.db.missing_copies()), (
        "an object no holder took is not reported done (it stays queued)")


def test_a_lost_answer_counts_as_missing_and_the_repair_settles_it(
        make_world: Callable[..., World]) -> None:
    """The write happened but its answer was lost: the copy is recorded missing,
    and the next repair writes it again (the same verified bytes) and forgets it."""
    world = make_world()
    sid, data = _pack(world)
    holder = world.store.mapping.locate(sid)[0]
    world.faults.lose_answer("put", object_key(sid), backend=holder)
    assert set(_upload(world, [(sid, data)])[sid]) == {holder}
    assert world.stored(holder, object_key(sid)) == data  # it was written after all
    _fresh_session(world)
    assert world.replicator.repair_missing() == 0
    assert world.db.missing_copies() == []
    assert world.stored(holder, object_key(sid)) == data


# ---------------------------------------------------------------- repairs
def test_repair_copies_from_a_verified_copy(make_world: Callable[..., World]) -> None:
    world = make_world()
    sid, data = _pack(world)
    refused, _ = world.store.mapping.locate(sid)
    world.faults.refuse("put", "objects/", backend=refused, times=ALWAYS)
    _upload(world, [(sid, data)])
    world.faults.clear()
    _fresh_session(world)
    assert world.replicator.repair_missing() == 0
    assert world.stored(refused, object_key(sid)) == data


def test_repair_in_the_same_session_skips_a_backend_that_is_down(
        make_world: Callable[..., World]) -> None:
    world = make_world()
    sid, data = _pack(world)
    refused, _ = world.store.mapping.locate(sid)
    world.faults.refuse("put", "objects/", backend=refused, error=BackendUnavailable)
    _upload(world, [(sid, data)])
    assert refused in world.store.down
    assert world.replicator.repair_missing() == 1
    assert world.stored(refused, object_key(sid)) is None


@pytest.mark.parametrize("how", ["zero", "flip", "truncate"])
def test_repair_never_copies_a_rotten_source(make_world: Callable[..., World], how: str) -> None:
    """The only other copy is rotten on the backend: nothing is written, the row
    stays, and the user is told."""
    world = make_world()
    sid, data = _pack(world)
    refused, _ = world.store.mapping.locate(sid)
    world.faults.refuse("put", "objects/", backend=refused)
    _upload(world, [(sid, data)])
    for source in _holding(world, sid):  # the other holder, and where the copy spilled
        world.plant(source, object_key(sid), corrupted(data, how))  # type: ignore[arg-type]
    _fresh_session(world)
    assert world.replicator.repair_missing() == 1
    assert world.stored(refused, object_key(sid)) is None
    assert world.db.missing_copies() == [(sid, refused)]
    assert any("no good copy" in n for n in world.reporter.notes)


def test_repair_skips_a_source_whose_answer_is_corrupt(make_world: Callable[..., World]) -> None:
    """R=3: the first source answers with altered bytes (a lying backend or a bad
    link); the repair takes the next verified copy instead."""
    world = make_world(n=4, replicas=3)
    sid, data = _pack(world)
    holders = world.store.mapping.locate(sid)
    refused = holders[0]
    world.faults.refuse("put", "objects/", backend=refused)
    _upload(world, [(sid, data)])
    _fresh_session(world)
    first_source = next(b for b in world.store.read_order(sid, SMALL_READ) if b != refused)
    lie = world.faults.corrupt("get", object_key(sid), backend=first_source, how="flip")
    assert world.replicator.repair_missing() == 0
    assert lie.fired == 1
    assert world.stored(refused, object_key(sid)) == data


def test_standalone_objects_verify_by_decoding(make_world: Callable[..., World]) -> None:
    world = make_world()
    plaintext = b'{"a commit": true}'
    commit_id = world.codec.id_of("commit", plaintext)
    stored = world.codec.encode("commit", commit_id, plaintext)
    verify_stored(world.codec, commit_id, stored)
    refused, _ = world.store.mapping.locate(commit_id)
    world.faults.refuse("put", "objects/", backend=refused)
    _upload(world, [(commit_id, stored)])
    for source in _holding(world, commit_id):
        world.plant(source, object_key(commit_id), stored[:-1] + bytes([stored[-1] ^ 1]))
    _fresh_session(world)
    assert world.replicator.repair_missing() == 1
    assert world.stored(refused, object_key(commit_id)) is None


# ---------------------------------------------------------------- fragments
def _coded_object(world: World) -> tuple[str, bytes]:
    assert world.store.scheme is not None
    return _pack(world, size=world.store.config.erasure_threshold + 12345)


def test_a_refused_fragment_is_rebuilt_from_the_others(make_world: Callable[..., World]) -> None:
    world = make_world(n=3, replicas=2, erasure=(2, 3))
    sid, data = _coded_object(world)
    holders = fragment_mapping_of(world.store.config).locate(sid)
    refused = holders[2]
    world.faults.refuse("put", object_key(sid), backend=refused)
    _upload(world, [(sid, data)])
    assert world.db.missing_copies() == [(sid, refused)]
    _fresh_session(world)
    assert world.replicator.repair_missing() == 0
    rebuilt = world.stored(refused, fragment_key(sid, 2))
    assert rebuilt is not None
    from metasync.erasure import decode_fragments

    fragments = {i: world.stored(b, fragment_key(sid, i)) for i, b in enumerate(holders)}
    assert decode_fragments(world.codec.hasher, sid, {2: rebuilt, 0: fragments[0]}) == data


def test_a_fragment_is_never_rebuilt_from_rotten_fragments(
        make_world: Callable[..., World]) -> None:
    """2 of 3: one fragment refused, one of the two others rotten: there are not k
    good fragments left, so nothing is written and the row stays."""
    world = make_world(n=3, replicas=2, erasure=(2, 3))
    sid, data = _coded_object(world)
    holders = fragment_mapping_of(world.store.config).locate(sid)
    world.faults.refuse("put", object_key(sid), backend=holders[2])
    _upload(world, [(sid, data)])
    rotten = world.stored(holders[1], fragment_key(sid, 1))
    assert rotten is not None
    world.plant(holders[1], fragment_key(sid, 1), bytes(len(rotten)))
    _fresh_session(world)
    assert world.replicator.repair_missing() == 1
    assert world.stored(holders[2], fragment_key(sid, 2)) is None


# ---------------------------------------------------------------- placement and drops
def test_an_extra_copy_goes_only_once_every_holder_is_verified(
        make_world: Callable[..., World]) -> None:
    world = make_world(n=3, replicas=2)
    sid, data = _pack(world)
    holders = world.store.mapping.locate(sid)
    (extra,) = [b for b in world.backends if b not in holders]
    for b in world.backends:
        world.plant(b, object_key(sid), data)
    world.faults.corrupt("get", object_key(sid), backend=holders[1], how="zero")
    have = dict.fromkeys(world.backends, len(data))
    kept = world.replicator.place(dict(world.backends), holders, sid, have, drop=True)
    assert kept.dropped == 0 and kept.kept == 1
    assert world.stored(extra, object_key(sid)) == data, "an unverified holder keeps the extra copy"
    dropped = world.replicator.place(dict(world.backends), holders, sid, have, drop=True)
    assert dropped.dropped == 1
    assert world.stored(extra, object_key(sid)) is None
    assert all(world.stored(b, object_key(sid)) == data for b in holders)


def test_inventory_ignores_names_it_did_not_write(make_world: Callable[..., World]) -> None:
    """A backend's listing is untrusted: only well-formed object and fragment keys count."""
    world = make_world()
    sid, data = _pack(world)
    world.plant("b0", object_key(sid), data)
    world.plant("b0", "objects/zz/not-an-id", b"x")
    wrong = "ff" if sid[:2] != "ff" else "00"
    world.plant("b0", f"objects/{wrong}/{sid}", data)  # the wrong fan-out folder
    world.plant("b1", fragment_key(sid, 1), b"fragment")
    world.faults.refuse("list_sizes", backend="b2", error=BackendUnavailable)
    inventory = take_inventory(dict(world.backends), world.store.executor)
    assert inventory.copies == {sid: {"b0": len(data)}}
    assert inventory.fragments == {sid: {1: {"b1": len(b"fragment")}}}
    assert set(inventory.unreachable) == {"b2"}


def test_delete_counts_what_it_could_not_delete(make_world: Callable[..., World]) -> None:
    world = make_world()
    a, data_a = _pack(world)
    b, data_b = _pack(world)
    world.plant("b0", object_key(a), data_a)
    world.plant("b0", object_key(b), data_b)
    world.faults.refuse("delete", object_key(b), backend="b0")
    keys = {object_key(a): len(data_a), object_key(b): len(data_b), object_key("0" * 64): 1}
    assert world.replicator.delete(world.backends["b0"], keys) == (1, len(data_a), 1)
    assert world.stored("b0", object_key(b)) == data_b


# ---------------------------------------------------------------- the store's reads
def test_store_reads_fall_back_from_a_corrupt_answer(make_world: Callable[..., World]) -> None:
    world = make_world()
    plaintext = b"an index, say"
    index_id = world.codec.id_of("index", plaintext)
    stored = world.codec.encode("index", index_id, plaintext)
    _upload(world, [(index_id, stored)])
    first = world.store.read_order(index_id, 64)[0]
    world.faults.corrupt("get", object_key(index_id), backend=first, how="flip")
    assert world.store.get_standalone("index", index_id) == plaintext
    assert world.store.stats.corrupt_copies == 1


def test_store_reads_fall_back_from_a_refusal_and_fail_cleanly_without_any(
        make_world: Callable[..., World]) -> None:
    world = make_world()
    plaintext = b"a commit, say"
    commit_id = world.codec.id_of("commit", plaintext)
    _upload(world, [(commit_id, world.codec.encode("commit", commit_id, plaintext))])
    holders = world.store.mapping.locate(commit_id)
    world.faults.refuse("get", object_key(commit_id), backend=holders[0], error=BackendUnavailable)
    assert world.store.get_standalone("commit", commit_id) == plaintext
    world.faults.refuse("get", object_key(commit_id), times=ALWAYS)
    with pytest.raises(ObjectUnavailable, match="no good copy of commit"):
        world.store.get_standalone("commit", commit_id)


def test_store_put_copy_reports_a_lost_answer_and_marks_the_backend(
        make_world: Callable[..., World]) -> None:
    world = make_world()
    sid, data = _pack(world)
    world.faults.lose_answer("put", object_key(sid), backend="b1")
    reason = world.store.put_copy("b1", sid, data)
    assert reason is not None and "b1" in world.store.down
    assert world.stored("b1", object_key(sid)) == data


# ---------------------------------------------------------------- short objects
def _upload_recording_short(world: World, sid: str, data: bytes) -> Uploaded:
    """Upload one object and record what it missed as the outbox does: the
    missing-copy rows, and a short-object row if it got fewer than R copies."""
    got: list[Uploaded] = []

    def done(placed: Uploaded) -> None:
        got.append(placed)
        with world.db.transaction():
            for backend_id in placed.missed:
                world.db.add_missing_copy(placed.stored_id, backend_id)
            if placed.short:
                world.db.set_short(placed.stored_id, placed.copies)

    world.replicator.upload([(sid, _loader(data))], done)
    return got[0]


def test_a_short_object_stays_recorded_until_r_copies_exist(
        make_world: Callable[..., World]) -> None:
    """R=3 over 3 with one holder away: the object is short, and stays reported
    by every repair while the holder stays away; once it is back, the repair
    writes the copy and the object is no longer short."""
    world = make_world(n=3, replicas=3)
    sid, data = _pack(world)
    away = world.store.mapping.locate(sid)[1]
    world.faults.refuse("put", "objects/", backend=away, times=ALWAYS, error=BackendUnavailable)
    assert _upload_recording_short(world, sid, data).short
    assert world.replicator.short_objects() == [sid]
    _fresh_session(world)
    world.replicator.repair_missing()
    assert world.replicator.short_objects() == [sid], "still two copies"
    world.faults.clear()
    _fresh_session(world)
    assert world.replicator.repair_missing() == 0
    assert world.replicator.short_objects() == []
    assert world.stored(away, object_key(sid)) == data


def test_a_missed_holder_whose_copy_spilled_does_not_keep_an_object_short(
        make_world: Callable[..., World]) -> None:
    """R=3 over 4, two holders away: one copy spills to the fourth backend, the
    other goes nowhere -- two copies, short. When one holder is back, the
    repair writes its copy: with the spilled one that makes R copies, so the
    object is no longer short, although the other holder still misses its copy."""
    world = make_world(n=4, replicas=3)
    sid, data = _pack(world)
    first, second, third, spare = world.store.mapping.preference(sid)
    for holder in (second, third):
        world.faults.refuse("put", "objects/", backend=holder, times=ALWAYS,
                            error=BackendUnavailable)
    placed = _upload_recording_short(world, sid, data)
    assert placed.short and set(placed.copies) == {first, spare}
    world.faults.clear()
    world.faults.refuse("put", "objects/", backend=third, times=ALWAYS, error=BackendUnavailable)
    _fresh_session(world)
    world.replicator.repair_missing()
    assert world.stored(second, object_key(sid)) == data
    assert world.replicator.short_objects() == [], "first, second and the spilled copy: R"
    assert (sid, third) in world.db.missing_copies()
