"""Retention policies: ``metasync forget --keep-*`` with restic's keep rules.

The rule logic (:func:`metasync.retention.choose`) is checked against a
reference written here in restic's own style (``internal/data/snapshot_policy.go``,
``ApplyPolicy``) on random timelines; gc after ``forget`` is checked against the
set of backend keys each push wrote; the command itself through the real CLI.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PASSPHRASE, one_line_error, run_cli
from metasync import Repository
from metasync.cli_forget import _print_plan
from metasync.errors import UsageError
from metasync.retention import Policy, choose, decide

NAMESPACE = "metasync"

# ----------------------------------------------------------------- the reference


def _ymdh(d: datetime, _: int) -> int:
    return d.year * 1000000 + d.month * 10000 + d.day * 100 + d.hour


def _ymd(d: datetime, _: int) -> int:
    return d.year * 10000 + d.month * 100 + d.day


def _yw(d: datetime, _: int) -> int:
    year, week, _day = d.isocalendar()
    return year * 100 + week


def _ym(d: datetime, _: int) -> int:
    return d.year * 100 + d.month


def _y(d: datetime, _: int) -> int:
    return d.year


def _always(_: datetime, nr: int) -> int:
    return nr


def restic_apply(versions: list[tuple[str, int]], p: Policy,
                 tz: tzinfo) -> tuple[dict[str, list[str]], list[str]]:
    """restic's ApplyPolicy, line for line (without tags and --keep-within)."""
    lst = sorted(versions, key=lambda v: -v[1])  # sort.Stable, newest first
    keep: dict[str, list[str]] = {}
    remove: list[str] = []
    buckets = [
        [p.last, _always, -1, "last"], [p.hourly, _ymdh, -1, "hourly"],
        [p.daily, _ymd, -1, "daily"], [p.weekly, _yw, -1, "weekly"],
        [p.monthly, _ym, -1, "monthly"], [p.yearly, _y, -1, "yearly"],
    ]
    for nr, (vid, t) in enumerate(lst):
        d = datetime.fromtimestamp(t // 10**9, tz)
        reasons = []
        for b in buckets:
            count, bucker, last, reason = b
            if count > 0 or count == -1:
                val = bucker(d, nr)
                if val != last or nr == len(lst) - 1:
                    if val == last and nr == len(lst) - 1:
                        reason = f"oldest {reason}"
                    b[2] = val
                    if count > 0:
                        b[0] = count - 1
                    reasons.append(reason)
        if reasons:
            keep[vid] = reasons
        else:
            remove.append(vid)
    return keep, remove


_count = st.one_of(st.integers(0, 6), st.just(-1))
_policies = st.builds(Policy, last=_count, hourly=_count, daily=_count, weekly=_count,
                      monthly=_count, yearly=_count).filter(lambda p: not p.empty())
_START = int(datetime(2019, 12, 20, tzinfo=UTC).timestamp())
# Times over six years, bunched so that several fall into one hour, day or week,
# and around new year (where ISO weeks belong to the other year).
_times = st.lists(
    st.one_of(
        st.one_of(st.integers(0, 6 * 366 * 86400), st.integers(0, 3 * 86400),
                  st.integers(0, 40 * 86400)).map(lambda s: _START + s),
        st.tuples(st.integers(2020, 2026), st.integers(-8 * 86400, 8 * 86400)).map(
            lambda y: int(datetime(y[0], 1, 1, tzinfo=UTC).timestamp()) + y[1]),
    ).map(lambda s: s * 10**9),
    max_size=40)
_zones = st.sampled_from([UTC, timezone(timedelta(hours=-5)),
                          timezone(timedelta(hours=5, minutes=30))])


@settings(max_examples=300, deadline=None)
@given(times=_times, policy=_policies, tz=_zones, extra_ns=st.integers(0, 10**9 - 1))
def test_choose_matches_restic(times: list[int], policy: Policy, tz: tzinfo,
                               extra_ns: int) -> None:
    """On random timelines (equal times included: they keep their given order, as
    restic's stable sort does), :func:`choose` keeps and forgets exactly what
    restic's ApplyPolicy would, with the same reasons."""
    versions = [(f"v{i}", t + extra_ns) for i, t in enumerate(times)]
    want_keep, want_forget = restic_apply(versions, policy, tz)
    got = choose(versions, policy, tz)
    assert {v: list(r) for v, r in got.keep.items()} == want_keep
    assert got.forget == want_forget


def test_policy_from_untrusted_config_is_validated() -> None:
    """A policy read from the shared configuration is refused unless every field is a
    known rule with an integer count in range."""
    assert Policy.from_json({"last": 3, "daily": -1}) == Policy(last=3, daily=-1)
    for bad in ({"last": "3"}, {"last": -2}, {"last": 10**12}, {"sometimes": 1},
                {"last": True}, [], {"last": 1.5}):
        try:
            Policy.from_json(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


@dataclass(frozen=True)
class _C:
    tree: str
    parents: tuple[str, ...]
    time_ns: int


def test_decide_ranks_the_first_parent_line_and_always_keeps_latest_snapshots_window() -> None:
    """gc's commit (master's tree again) takes no --keep-last place; the other side
    of a merge is not ranked; the latest version, snapshots and the window stay."""
    h = 3600 * 10**9
    history = {
        "c1": _C("t1", (), 1 * h), "c2": _C("t2", ("c1",), 2 * h),
        "side": _C("ts", ("c1",), 3 * h), "c3": _C("t3", ("c2", "side"), 4 * h),
        "c4": _C("t4", ("c3",), 5 * h), "gc": _C("t4", ("c4",), 6 * h),
    }
    d = decide("gc", history, Policy(last=2), [("s", "c1")], cutoff_ns=10 * h)
    assert d.ranked == ["c4", "c3", "c2", "c1"]
    assert d.keep == {"c4": ("last", "latest"), "c3": ("last",), "gc": ("master",),
                      "c1": ("snapshot s",)}
    assert d.forget == ["c2"]
    window = decide("gc", history, Policy(last=1), [], cutoff_ns=3 * h)
    assert window.forget == ["c2", "c1"] and "side" in window.keep and "c3" in window.keep


def test_decide_buckets_in_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client's gc keeps the same versions: a version every 12 hours (11:00 and
    23:00 UTC), ``--keep-daily 5``, decided under TZ=UTC and TZ=Asia/Kolkata (UTC+5:30,
    which moves 23:00 UTC into the next day), keeps the same set -- the 23:00 ones, as
    UTC days have it. (With local buckets the two zones kept disjoint sets but the
    newest: two gcs left one version of the five days.)"""
    start = int(datetime(2026, 11, 1, 11, tzinfo=UTC).timestamp()) * 10**9
    history: dict[str, _C] = {}
    for i in range(20):
        history[f"c{i:02d}"] = _C(f"t{i}", (f"c{i - 1:02d}",) if i else (),
                                  start + i * 12 * 3600 * 10**9)
    master = "c19"
    cutoff = history[master].time_ns + 1
    kept = []
    try:
        for zone in ("UTC", "Asia/Kolkata"):
            monkeypatch.setenv("TZ", zone)
            time.tzset()
            kept.append(set(decide(master, history, Policy(daily=5), [], cutoff).keep))
    finally:
        monkeypatch.undo()
        time.tzset()
    assert kept[0] == kept[1] == {"c11", "c13", "c15", "c17", "c19"}


# ------------------------------------------------------------------ through gc


def _keys(backends: list[Path]) -> set[Path]:
    """Every stored object copy, as its file on a dir: backend."""
    return {p for b in backends for p in (b / NAMESPACE / "objects").glob("*/*")}


def _is_pack(path: Path) -> bool:
    """A pack ends in its trailer's magic (docs/FORMAT.md §6)."""
    return path.read_bytes()[-4:] == b"MSP1"


def _repo(tmp_path: Path) -> tuple[Path, list[Path]]:
    backends = [tmp_path / f"b{i}" for i in range(3)]
    for b in backends:
        b.mkdir()
    a = tmp_path / "A"
    a.mkdir()
    run_cli("init", str(a), *(f"--backend=dir:{b}" for b in backends))
    run_cli("config", "retention", "0", cwd=a)
    return a, backends


def _push(a: Path, backends: list[Path], message: str) -> set[Path]:
    """Push and return the (backend, key) pairs the push wrote."""
    before = _keys(backends)
    run_cli("push", "-m", message, cwd=a)
    return _keys(backends) - before


def test_gc_after_forget_frees_exactly_what_only_forgotten_versions_used(tmp_path: Path) -> None:
    """Five versions, ``forget --keep-last 2``: gc deletes exactly the packs written
    by the forgotten pushes whose content no kept version has; the first push's
    pack, whose file the kept versions still have, stays; nothing a kept version
    wrote goes; fsck passes and the kept versions restore byte for byte."""
    a, backends = _repo(tmp_path)
    rng = random.Random(20)
    shared = rng.randbytes(200_000)
    (a / "shared.bin").write_bytes(shared)
    wrote = [_push(a, backends, "shared")]
    (a / "a.bin").write_bytes(rng.randbytes(200_000))
    wrote.append(_push(a, backends, "a"))
    (a / "a.bin").unlink()
    (a / "b.bin").write_bytes(rng.randbytes(200_000))
    wrote.append(_push(a, backends, "b instead of a"))
    (a / "b.bin").unlink()
    k = rng.randbytes(200_000)
    (a / "k.bin").write_bytes(k)
    wrote.append(_push(a, backends, "k instead of b"))
    (a / "m.bin").write_bytes(rng.randbytes(200_000))
    wrote.append(_push(a, backends, "m"))
    assert all(any(_is_pack(key) for key in w) for w in wrote)
    commits = {e["message"]: e["commit"] for e in json.loads(run_cli("log", "--json", cwd=a).stdout)}

    run_cli("forget", "--keep-last", "2", cwd=a)
    before = _keys(backends)
    expected = {key for w in wrote[1:3] for key in w if _is_pack(key)}
    run_cli("gc", cwd=a)
    after = _keys(backends)
    assert before - after == expected
    assert {key for key in wrote[0] if _is_pack(key)} <= after
    assert run_cli("fsck", cwd=a).returncode == 0
    (a / "k.bin").unlink()
    (a / "shared.bin").unlink()
    run_cli("restore", "k.bin", cwd=a)
    run_cli("restore", "shared.bin", "--version", commits["k instead of b"][:12], cwd=a)
    assert (a / "k.bin").read_bytes() == k and (a / "shared.bin").read_bytes() == shared
    bad = run_cli("restore", "a.bin", "--version", commits["a"][:12], cwd=a, check=False)
    one_line_error(bad, "forgotten")


def _gc_kept_last_two(tmp_path: Path, backends: list[Path]) -> tuple[Repository, list[str]]:
    """Five versions (each only its own ``f<i>.bin``), ``--keep-last 2``, gc at
    retention 0, then two more pushes: v0..v2 are collected, v3 and v4 were kept by
    that gc (and are still stored), though today's policy forgets them."""
    a = tmp_path / "A"
    a.mkdir()
    repo = Repository.init(a, [f"dir:{b}" for b in backends[:2]], passphrase=lambda: PASSPHRASE)
    repo.set_retention(0)
    rng = random.Random(20)
    commits = []
    for i in range(7):
        for old in a.glob("f*.bin"):
            old.unlink()
        (a / f"f{i}.bin").write_bytes(rng.randbytes(100_000))
        pushed = repo.push(f"v{i}")
        assert pushed.version is not None and pushed.version.master is not None
        commits.append(pushed.version.master)
        if i == 4:
            repo.retention.store(Policy(last=2))
            assert repo.gc().deleted > 0
    return repo, commits


def test_restore_follows_what_gc_collected_not_todays_policy(
        tmp_path: Path, backends: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Restore reads a version whose content the last gc kept, though two pushes since
    make today's policy forget it; after the policy is raised, a version an earlier gc
    collected is "forgotten" (one line, nothing written), not a damaged pack, and
    ``forget --dry-run``'s plan says it is gone."""
    repo, commits = _gc_kept_last_two(tmp_path, backends)
    with repo:
        (repo.root / "f3.bin").unlink(missing_ok=True)
        repo.restore("f3.bin", commits[3][:12])
        assert (repo.root / "f3.bin").stat().st_size == 100_000

        repo.retention.store(Policy(last=50))
        whole = repo.retention.plan(Policy(last=50))
        plan = {row.commit_id: row for row in whole.rows}
        assert [c for c in commits if plan[c].collected] == commits[:3]
        assert all(plan[c].reasons for c in commits)  # kept by the policy, yet gone
        _print_plan(whole, dry_run=True)
        printed = capsys.readouterr()
        rows = {c: next(line for line in printed.out.splitlines() if c[:12] in line)
                for c in commits}
        assert all(rows[c].startswith("gone") and "earlier gc" in rows[c] for c in commits[:3])
        assert all(rows[c].startswith("keep") for c in commits[3:])
        assert "3 versions are gone already" in printed.out + printed.err
        with pytest.raises(UsageError, match="forgotten: gc collected its files"):
            repo.restore("f1.bin", commits[1][:12])
        assert not (repo.root / "f1.bin").exists()


def test_mount_shows_what_restore_reads(tmp_path: Path, backends: list[Path]) -> None:
    """The mount's versions/ and by-date/ list a version the last gc kept (restore
    reads it) and not one it collected: one test for both (graph.collected_test)."""
    repo, commits = _gc_kept_last_two(tmp_path, backends)
    with repo:
        reader = repo.version_reader(cache_size=0, poll=0)
        shown = set(reader.numbered().values()) | set(reader.by_date().values())
        assert set(commits[3:]) <= shown
        assert not set(commits[:3]) & shown


# ------------------------------------------------------------------ the command


def _tree_bytes(backends: list[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for b in backends for p in b.rglob("*") if p.is_file()}


def test_forget_cli_dry_run_no_rule_and_policy_persists(tmp_path: Path) -> None:
    """``--dry-run`` names every version that would go and the rule keeping each
    other one, and writes nothing; no rule is a one-line error; a stored policy is
    applied by a later gc to versions pushed after it was set."""
    a, backends = _repo(tmp_path)
    for i in range(4):
        (a / f"f{i}.txt").write_text(f"only in version {i}\n" * 5000)
        if i:
            (a / f"f{i - 1}.txt").unlink()
        run_cli("push", "-m", f"v{i}", cwd=a)
    commits = [e["commit"] for e in json.loads(run_cli("log", "--json", cwd=a).stdout)]
    assert len(commits) == 4  # newest first

    one_line_error(run_cli("forget", cwd=a, check=False), "--keep-last")
    one_line_error(run_cli("forget", "--keep-daily", "x", cwd=a, check=False), "--keep-daily")

    stored = _tree_bytes(backends)
    out = run_cli("forget", "--keep-last", "2", "--dry-run", cwd=a).stdout
    assert _tree_bytes(backends) == stored
    lines = {c: next(line for line in out.splitlines() if c[:12] in line) for c in commits}
    assert all(lines[c].startswith("keep") and "last" in lines[c] for c in commits[:2])
    assert all(lines[c].startswith("forget") for c in commits[2:])
    assert "would forget 2 of 4 versions" in out

    run_cli("forget", "--keep-last", "3", cwd=a)
    assert "keep-last 3" in run_cli("forget", "--show", cwd=a).stdout
    (a / "f3.txt").unlink()
    (a / "g.txt").write_text("newer\n")
    run_cli("push", "-m", "v4", cwd=a)
    # v1 was kept by --keep-last 3 when it was set; v4 pushes it out, and gc applies it.
    run_cli("gc", cwd=a)
    ok = run_cli("restore", "f2.txt", "--version", commits[1][:12], cwd=a)
    assert ok.returncode == 0
    gone = run_cli("restore", "f1.txt", "--version", commits[2][:12], cwd=a, check=False)
    one_line_error(gone, "forgotten")


def test_a_policy_raises_the_format_so_an_older_reader_says_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A format 5 repository stays 5 until a configuration gains ``keep``, which
    says format 6 (docs/FORMAT.md): a format 5 reader, which rejects unknown
    configuration fields, then refuses it with "upgrade" rather than "malformed"."""
    from metasync import Repository, context, layout, lifecycle, objects
    from metasync.errors import MetasyncError

    backends = [tmp_path / f"b{i}" for i in range(2)]
    a = tmp_path / "A"
    for d in (*backends, a):
        d.mkdir()
    with monkeypatch.context() as older:  # made by a format 5 writer
        older.setattr(lifecycle, "FORMAT_VERSION", 5)
        older.setattr(context, "FORMAT_VERSION", 5)
        repo = Repository.init(a, [f"dir:{b}" for b in backends], encrypt=False)
    with repo:
        (a / "f.txt").write_text("one\n")
        repo.push("one")
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 5
        repo.retention.store(Policy(last=3))
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 6
    for module in (objects, layout, context):  # a format 5 reader
        monkeypatch.setattr(module, "READABLE_FORMATS", (3, 4, 5))
    with pytest.raises(MetasyncError, match="upgrade metasync"):
        Repository.clone(f"dir:{backends[0]}", tmp_path / "old-reader", allow_unencrypted=True)
