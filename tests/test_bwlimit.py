"""Bandwidth limits (``--bwlimit``, docs/bwlimit.md): the syntax, the timetable, the
token bucket on a simulated clock, the limiter's waits (stopped by a stop request,
released by a switch to ``off``), the one place backends charge their payloads,
and the CLI's option. Nothing here asserts on elapsed time: the bucket and the
limiter run on injected clocks; the rate actually achieved is measured by
``bin/bench bwlimit`` (docs/benchmarks.md)."""

from __future__ import annotations

import io
import os
import random
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from metasync.backends import open_backend
from metasync.backends.bwlimit import (
    DOWN,
    EXEMPT,
    LIMITER,
    PIECE,
    UP,
    Limiter,
    Rates,
    TokenBucket,
    parse_bwlimit,
    parse_rate,
)
from metasync.backends.faulty import FaultyBackend
from metasync.errors import Interrupted, UsageError
from metasync.progress import Cancellation
from tests.conftest import (
    METASYNC,
    PASSPHRASE,
    make_tree,
    one_line_error,
    run_cli,
    snapshot,
    wait_until,
)

KIB, MIB = 1024, 1024 * 1024
# 2026-11-23 is a Monday.
MONDAY = datetime(2026, 11, 23)


def at(day: int, hour: int, minute: int = 0) -> datetime:
    """Monday + ``day`` days at ``hour:minute``."""
    return MONDAY.replace(day=23 + day, hour=hour, minute=minute)


# --- syntax ----------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [
    ("10M", 10 * MIB), ("512k", 512 * KIB), ("512K", 512 * KIB), ("1.5G", 1.5 * 1024 * MIB),
    ("300B", 300), ("100", 100 * KIB), ("2MiB", 2 * MIB), ("2MB", 2 * MIB), ("off", None),
])
def test_rates_are_binary_multiples_as_in_rclone(text: str, value: float | None) -> None:
    assert parse_rate(text) == value


def test_one_rate_limits_both_directions_and_a_pair_each() -> None:
    both = parse_bwlimit("2M")
    assert both is not None and both.at(MONDAY) == Rates(2 * MIB, 2 * MIB)
    pair = parse_bwlimit("10M:2M")
    assert pair is not None and pair.at(MONDAY) == Rates(10 * MIB, 2 * MIB)
    up_only = parse_bwlimit("2M:off")
    assert up_only is not None and up_only.at(MONDAY) == Rates(2 * MIB, None)


@pytest.mark.parametrize("text", ["off", "", "  ", "off:off", "08:00,off 20:00,off"])
def test_off_is_no_limit(text: str) -> None:
    schedule = parse_bwlimit(text)
    assert schedule is None or schedule.unlimited


def test_a_daily_timetable_picks_the_entry_in_force() -> None:
    schedule = parse_bwlimit("08:00,512k 19:00,10M:2M 23:00,off")
    assert schedule is not None
    assert schedule.at(at(0, 8)) == Rates(512 * KIB, 512 * KIB)
    assert schedule.at(at(2, 18, 59)) == Rates(512 * KIB, 512 * KIB)
    assert schedule.at(at(4, 19)) == Rates(10 * MIB, 2 * MIB)
    assert schedule.at(at(6, 23, 30)) == Rates(None, None)
    # Before the day's first entry: the previous day's last one (off).
    assert schedule.at(at(0, 7, 59)) == Rates(None, None)
    assert schedule.at(at(3, 0)) == Rates(None, None)


def test_a_weekly_timetable_holds_from_its_day_until_the_next_entry() -> None:
    schedule = parse_bwlimit("Mon-08:00,512k Fri-18:00,10M Sun-20:00,off")
    assert schedule is not None
    assert schedule.at(at(0, 7)) == Rates(None, None)  # Sunday 20:00's, wrapped round
    assert schedule.at(at(0, 8)) == Rates(512 * KIB, 512 * KIB)
    assert schedule.at(at(3, 23)) == Rates(512 * KIB, 512 * KIB)  # Thursday
    assert schedule.at(at(5, 12)) == Rates(10 * MIB, 10 * MIB)  # Saturday
    assert schedule.at(at(6, 21)) == Rates(None, None)


def test_daily_entries_mix_with_weekly_ones() -> None:
    schedule = parse_bwlimit("09:00,1M sat-09:00,off")
    assert schedule is not None
    assert schedule.at(at(1, 10)) == Rates(MIB, MIB)
    assert schedule.at(at(5, 10)) == Rates(None, None)  # Saturday: the later entry wins
    assert schedule.at(at(6, 10)) == Rates(MIB, MIB)


@pytest.mark.parametrize(("text", "problem"), [
    ("10Q", "'10Q' is not a rate"),
    ("fast", "'fast' is not a rate"),
    ("1:2:3", "more than one ':'"),
    ("10M:", "a rate is missing"),
    ("0", "less than one byte per second"),
    ("08:00", "has no rate"),
    ("08:00,1M 19:00", "is not TIME,RATE"),
    ("25:00,1M", "not a time of day"),
    ("8h,1M", "is not a time"),
    ("Xyz-08:00,1M", "'Xyz' is not a day"),
])
def test_bad_syntax_is_one_error_naming_the_problem_and_the_syntax(text: str, problem: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_bwlimit(text)
    message = str(caught.value)
    assert problem in message and "\n" not in message
    assert "bad --bwlimit" in message and "10M:2M" in message  # the fix: the syntax


# --- the token bucket, on a simulated clock --------------------------------------------------
def simulate(bucket: TokenBucket, rate: float, seconds: float, piece: int = PIECE,
             step: float = 0.001) -> int:
    """Bytes the bucket grants to a greedy sender asking every ``step`` seconds."""
    granted, now = 0, 0.0
    while now < seconds:
        while bucket.grant(piece, rate, now) == 0.0:
            granted += piece
        now += step
    return granted


def test_the_bucket_grants_the_rate_and_no_more() -> None:
    rate = 2 * MIB
    granted = simulate(TokenBucket(), rate, 10.0)
    # At most rate x time plus one piece of debt (it starts empty: no burst).
    assert rate * 10 - PIECE <= granted <= rate * 10 + PIECE


def test_the_bucket_follows_a_changed_rate() -> None:
    bucket = TokenBucket()
    first = simulate(bucket, 1 * MIB, 5.0)
    granted, now = 0, 5.0
    while now < 10.0:
        while bucket.grant(PIECE, 4 * MIB, now) == 0.0:
            granted += PIECE
        now += 0.001
    assert abs(first - 5 * MIB) <= 2 * PIECE
    assert abs(granted - 20 * MIB) <= 2 * PIECE + 4 * MIB * 0.5  # the saved burst at most


def test_a_bucket_in_debt_says_how_long_to_wait() -> None:
    bucket = TokenBucket()
    assert bucket.grant(PIECE, PIECE, 0.0) == 0.0  # not in debt: granted, one piece owed
    assert bucket.grant(PIECE, PIECE, 0.0) == pytest.approx(1.0)
    assert bucket.grant(PIECE, PIECE, 0.5) == pytest.approx(0.5)
    assert bucket.grant(PIECE, PIECE, 1.0) == 0.0


def test_an_idle_bucket_saves_half_a_second_at_most() -> None:
    bucket = TokenBucket()
    bucket.grant(1, 1000 * KIB, 0.0)
    bucket.grant(1, 1000 * KIB, 100.0)  # idle for 100 s
    assert bucket.tokens <= 1000 * KIB * 0.5


def test_an_unlimited_rate_grants_everything() -> None:
    bucket = TokenBucket()
    assert all(bucket.grant(PIECE, None, 0.0) == 0.0 for _ in range(1000))


# --- the limiter's waits -------------------------------------------------------------------
class FakeClock:
    """A clock that moves only when told."""

    def __init__(self, wall: datetime) -> None:
        self.mono = 0.0
        self.wall = wall

    def monotonic(self) -> float:
        return self.mono

    def now(self) -> datetime:
        return self.wall


def limiter(text: str, clock: FakeClock, cancel: Cancellation | None = None) -> Limiter:
    lim = Limiter(clock=clock.monotonic, wallclock=clock.now, cancel=cancel or Cancellation())
    lim.configure(parse_bwlimit(text))
    return lim


def blocked_charge(lim: Limiter, size: int) -> tuple[threading.Thread, list[BaseException]]:
    """A thread charging ``size`` bytes up, once it waits in the limiter."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            lim.charge(UP, size)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: lim.waiting(UP) == 1, 10, "the charge waits in the limiter")
    return thread, errors


def test_a_stop_request_interrupts_a_waiting_transfer() -> None:
    clock, cancel = FakeClock(MONDAY), Cancellation()
    lim = limiter("1k", clock, cancel)
    lim.charge(UP, PIECE)  # the bucket is in debt for 64 s of the fake clock, which stands
    thread, errors = blocked_charge(lim, PIECE)
    cancel.request()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], Interrupted)
    assert lim.waiting(UP) == 0


def test_a_timetable_switching_to_off_releases_waiters() -> None:
    clock = FakeClock(at(0, 11, 59))
    lim = limiter("00:00,1k 12:00,off", clock)
    lim.charge(UP, PIECE)
    thread, errors = blocked_charge(lim, 4 * PIECE)
    clock.wall = at(0, 12, 0)  # noon: off; the fake monotonic clock has not moved
    thread.join(10)
    assert not thread.is_alive() and not errors


def test_configuring_no_limit_releases_waiters() -> None:
    clock = FakeClock(MONDAY)
    lim = limiter("1k", clock)
    lim.charge(UP, PIECE)
    thread, errors = blocked_charge(lim, PIECE)
    lim.configure(None)
    thread.join(10)
    assert not thread.is_alive() and not errors


def test_a_waiter_goes_on_as_the_clock_pays_its_debt() -> None:
    clock = FakeClock(MONDAY)
    lim = limiter(f"{PIECE}B", clock)  # one piece per second
    lim.charge(UP, PIECE)
    thread, errors = blocked_charge(lim, PIECE)
    assert thread.is_alive()
    clock.mono = 1.0
    thread.join(10)
    assert not thread.is_alive() and not errors


def test_small_payloads_never_wait_but_count() -> None:
    clock = FakeClock(MONDAY)
    lim = limiter("1k", clock)
    lim.charge(UP, PIECE)  # in debt: a big payload would wait
    lim.charge(UP, EXEMPT)  # returns: metadata is not queued
    assert lim.charged[UP] == PIECE + EXEMPT and lim.charged[DOWN] == 0
    lim.charge(DOWN, PIECE)  # the other direction has its own bucket


def test_a_limit_for_one_direction_leaves_the_other_free() -> None:
    clock = FakeClock(MONDAY)
    lim = limiter("1k:off", clock)
    for _ in range(100):
        lim.charge(DOWN, PIECE)  # would wait 64 s each if limited
    assert lim.charged[DOWN] == 100 * PIECE


# --- where backends charge -----------------------------------------------------------------
@pytest.fixture
def fast_limit() -> Iterator[Limiter]:
    """The process's limiter set to a rate no test waits for, reset after (to what
    METASYNC_BWLIMIT says: nothing in a test run)."""
    LIMITER.configure(parse_bwlimit("64G"))
    try:
        yield LIMITER
    finally:
        LIMITER.reset()


def test_every_payload_of_a_backend_is_charged_once(tmp_path: Path, fast_limit: Limiter) -> None:
    backend = FaultyBackend(open_backend(f"dir:{tmp_path}", "ns"))
    backend.create()
    up, down = fast_limit.charged[UP], fast_limit.charged[DOWN]
    big = bytes(range(256)) * (5 * PIECE // 256)
    backend.put("a", big)
    backend.put("b", io.BytesIO(big))  # streamed
    assert backend.put_if_absent("c", b"tiny")
    assert fast_limit.charged[UP] - up == 2 * len(big) + 4
    assert backend.get("a") == big
    assert backend.get_range("b", 10, 100) == big[10:110]
    with backend.open("b") as stream:
        assert stream.read() == big
    assert fast_limit.charged[DOWN] - down == 2 * len(big) + 100
    before = dict(fast_limit.charged)
    assert sorted(backend.list()) == ["a", "b", "c"] and backend.size("a") == len(big)
    assert fast_limit.charged == before  # no payload, no charge


def test_without_a_limit_nothing_is_charged(tmp_path: Path) -> None:
    LIMITER.configure(None)
    try:
        backend = open_backend(f"dir:{tmp_path}", "ns")
        backend.create()
        charged = dict(LIMITER.charged)
        backend.put("a", b"x" * (2 * PIECE))
        assert LIMITER.charged == charged
    finally:
        LIMITER.reset()


def test_a_library_caller_gets_the_environment_s_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METASYNC_BWLIMIT", "3M:1M")
    LIMITER.reset()
    try:
        assert LIMITER.active and LIMITER.rates() == Rates(3 * MIB, MIB)
        monkeypatch.setenv("METASYNC_BWLIMIT", "3X")
        LIMITER.reset()
        with pytest.raises(UsageError, match="bad METASYNC_BWLIMIT '3X'"):
            LIMITER.charge(UP, PIECE)
    finally:
        monkeypatch.delenv("METASYNC_BWLIMIT")
        LIMITER.reset()
    assert not LIMITER.active


# --- the command line ----------------------------------------------------------------------------
def test_bad_bwlimit_is_one_line_and_fails(tmp_path: Path) -> None:
    one_line_error(run_cli("--bwlimit", "10Q", "status", cwd=tmp_path, check=False),
                   "bad --bwlimit '10Q'", "10M:2M")
    one_line_error(run_cli("status", "--bwlimit", "1:2:3", cwd=tmp_path, check=False),
                   "more than one ':'")
    one_line_error(run_cli("status", cwd=tmp_path, check=False,
                           env_extra={"METASYNC_BWLIMIT": "fast"}),
                   "bad METASYNC_BWLIMIT 'fast'")
    one_line_error(run_cli("daemon", "--bwlimit", "08:00", cwd=tmp_path, check=False),
                   "has no rate")


def test_a_throttled_push_and_clone_carry_every_byte(tmp_path: Path) -> None:
    """A push and a clone under a limit (both directions, and a timetable) give the
    same folder as without one: the limit changes when bytes move, not which."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src, small_files=20, big_mb=1)
    dirs = [tmp_path / "b1", tmp_path / "b2"]
    for d in dirs:
        d.mkdir()
    run_cli("init", str(src), *[a for d in dirs for a in ("--backend", f"dir:{d}")])
    run_cli("--bwlimit", "256M:128M", "push", cwd=src)
    run_cli("clone", f"dir:{dirs[0]}", str(dst), "--bwlimit", "00:00,256M 12:00,300M:off",
            cwd=tmp_path)
    assert snapshot(dst) == snapshot(src)


def test_an_installed_service_keeps_the_limit_it_was_installed_with(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`metasync service install --bwlimit ...` (or with METASYNC_BWLIMIT set) puts the
    limit on the service's command line, where it holds on every OS."""
    from metasync.service import app_service_for, app_systemd_unit, service_for

    timetable = "08:00,512k 23:00,off"
    app = app_service_for({"HOME": "/home/ana", "METASYNC_BWLIMIT": timetable})
    assert app.command[-3:] == ("service", "--bwlimit", timetable)
    exec_start = next(line for line in app_systemd_unit(app).splitlines()
                      if line.startswith("ExecStart="))
    assert shlex.split(exec_start.split("=", 1)[1])[-2:] == ["--bwlimit", timetable]
    assert "--bwlimit" not in app_service_for({"HOME": "/home/ana"}).command
    monkeypatch.setenv("METASYNC_BWLIMIT", "2M:off")
    assert service_for(tmp_path).command[-2:] == ("--bwlimit", "2M:off")


def test_ctrl_c_stops_a_throttled_push_waiting_for_its_turn(tmp_path: Path) -> None:
    """A push throttled to 16 KiB/s (a 1 MiB piece of a dir: upload waits 64 s for its
    turn) stops at Ctrl-C well before that: the wait re-checks the stop request; no
    temporary file is left and the next push (no limit) finishes."""
    src, store = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    store.mkdir()
    (src / "big.bin").write_bytes(random.Random(3).randbytes(4 * MIB))
    run_cli("init", str(src), "--backend", f"dir:{store}")
    env = {**os.environ, "METASYNC_PASSPHRASE": PASSPHRASE}
    proc = subprocess.Popen([METASYNC, "push", "--bwlimit", "16k"], cwd=src, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(p.name.startswith(".tmp-") for p in store.rglob("*")), 60,
                   "the push to start uploading")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # a bound, far under the 64 s wait
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert not [p for p in store.rglob("*") if p.name.startswith(".tmp-")]
    assert "Pushed version 1" in run_cli("push", cwd=src).stdout


def test_a_stream_read_in_small_pieces_is_limited_too() -> None:
    """Only a whole small payload is exempt: reads of a few KiB from a metered
    stream wait their turn like big ones."""
    clock = FakeClock(MONDAY)
    lim = limiter("1k", clock)
    stream = lim.reader(io.BytesIO(bytes(PIECE)), UP)
    assert len(stream.read(4 * KIB)) == 4 * KIB  # granted: the bucket goes into debt
    done = threading.Event()

    def more() -> None:
        stream.read(4 * KIB)
        done.set()

    threading.Thread(target=more, daemon=True).start()
    wait_until(lambda: lim.waiting(UP) == 1, 10, "the second small read waits")
    assert not done.is_set()
    clock.mono = 10.0  # the debt (4 KiB at 1 KiB/s) is paid
    wait_until(done.is_set, 10, "the second small read goes on")
