"""``metasync service``: one process for many folders (issue 19).

Real ``metasync service`` processes, each with its own config folder
(``XDG_CONFIG_HOME``), over real ``dir:`` backends; the CLI's ``add-folder``,
``remove-folder`` and ``folders`` as a user runs them. Repositories are set up
in-process through ``metasync.Repository`` (the same code ``init``/``clone`` run)
to keep the set-up of ten folders short.

Nothing sleeps to synchronise: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, PASSPHRASE, one_line_error, run_cli, wait_until
from metasync import Repository

FAST = ["--settle", "0.2", "--poll", "0.3", "--rescan", "3"]




def make_folder(root: Path, backends: list[Path], content: str = "hello\n") -> Path:
    """A metasync folder at ``root`` on ``backends`` (created), with one pushed file."""
    root.mkdir()
    for b in backends:
        b.mkdir()
    (root / "hello.txt").write_text(content)
    repo = Repository.init(root, [f"dir:{b}" for b in backends], replicas=1, encrypt=False)
    with repo:
        repo.push("start")
    return root


def clone_of(backend: Path, root: Path) -> Path:
    Repository.clone(f"dir:{backend}", root, allow_unencrypted=True).close()
    return root


def daemon_json(root: Path) -> dict[str, Any]:
    """The status the service's thread for ``root`` keeps (as a ``metasync daemon`` does)."""
    try:
        doc: dict[str, Any] = json.loads((root / ".metasync" / "daemon.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc


@dataclass
class Service:
    config: Path
    proc: subprocess.Popen[bytes]
    out: Path

    def output(self) -> str:
        return self.out.read_text(errors="replace")[-6000:]

    def cli(self, *args: str, check: bool = True, cwd: Path | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """A CLI command with this service's config folder."""
        return run_cli(*args, check=check, cwd=cwd,
                       env_extra={"XDG_CONFIG_HOME": str(self.config.parent)})


@dataclass
class Services:
    tmp: Path
    running: list[Service] = field(default_factory=list)

    def config(self, name: str) -> Path:
        """The config folder ``$XDG_CONFIG_HOME/metasync`` of a service called ``name``."""
        return self.tmp / f"xdg-{name}" / "metasync"

    def start(self, name: str, *args: str) -> Service:
        config = self.config(name)
        config.parent.mkdir(exist_ok=True)
        out = self.tmp / f"service-{name}-{len(self.running)}.out"
        env = dict(os.environ, METASYNC_PASSPHRASE=PASSPHRASE, XDG_CONFIG_HOME=str(config.parent))
        with open(out, "wb") as fh:
            proc = subprocess.Popen([METASYNC, "service", "--listen", "127.0.0.1:0", *FAST, *args],
                                    env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        service = Service(config, proc, out)
        self.running.append(service)

        def up() -> bool:
            assert proc.poll() is None, f"the service exited at once:\n{service.output()}"
            doc = json.loads((config / "running.json").read_text())
            return bool(doc.get("pid") == proc.pid)
        wait_until(up, 20, f"service {name} running", service.output)
        return service

    def stop(self, service: Service) -> None:
        """SIGTERM: the service stops every folder and exits 0."""
        self.running.remove(service)
        service.proc.send_signal(signal.SIGTERM)
        try:
            rc = service.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait()
            pytest.fail(f"the service did not stop within 60 s of SIGTERM:\n{service.output()}")
        assert rc == 0, f"the service exited {rc}:\n{service.output()}"
        assert not (service.config / "running.json").exists()


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    s = Services(tmp_path)
    yield s
    for service in list(s.running):
        s.stop(service)


def _cli(config: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, check=check, env_extra={"XDG_CONFIG_HOME": str(config.parent)})


# ============================================================== the registry
def test_add_remove_folders_and_a_damaged_registry(tmp_path: Path) -> None:
    """add-folder takes only a metasync folder, once; remove-folder only a registered
    one; each mistake is one line. ``folders`` lists them; the API key is kept 0600
    and stays the same; a damaged folders.json is one line naming it and the fix."""
    config = tmp_path / "xdg" / "metasync"
    a = make_folder(tmp_path / "A", [tmp_path / "bA"])
    plain = tmp_path / "plain"
    plain.mkdir()

    one_line_error(_cli(config, "add-folder", str(plain), check=False),
                   "not a metasync folder", "metasync init")
    one_line_error(_cli(config, "add-folder", str(tmp_path / "nowhere"), check=False),
                   "does not exist")
    added = _cli(config, "add-folder", str(a)).stdout
    assert "registered" in added and str(a) in added, added
    one_line_error(_cli(config, "add-folder", str(a), check=False), "registered already")

    listed = json.loads(_cli(config, "folders", "--json").stdout)
    assert [f["path"] for f in listed["folders"]] == [str(a)]
    assert listed["service"] is None and listed["folders"][0]["state"] == "stopped"
    folder_id = listed["folders"][0]["id"]
    assert len(folder_id) == 8 and int(folder_id, 16) >= 0

    key = _cli(config, "service", "api-key").stdout.strip()
    assert len(key) >= 32 and _cli(config, "service", "api-key").stdout.strip() == key
    assert stat.S_IMODE((config / "api-key").stat().st_mode) == 0o600

    one_line_error(_cli(config, "remove-folder", str(plain), check=False),
                   "not a registered folder", "metasync folders")
    assert folder_id in _cli(config, "remove-folder", folder_id).stdout
    assert json.loads(_cli(config, "folders", "--json").stdout)["folders"] == []

    (config / "folders.json").write_text('{"folders": [{"id": "zz", "path": "rel"}]')
    for args in (["folders"], ["add-folder", str(a)], ["remove-folder", str(a)]):
        one_line_error(_cli(config, *args, check=False),
                       str(config / "folders.json"), "damaged", "metasync add-folder")
    (config / "folders.json").write_text('{"folders": [{"id": "12345678", "path": "relative"}]}')
    one_line_error(_cli(config, "folders", check=False), "damaged", "a bad entry")
    (config / "service.json").write_text('{"port": "eighty"}')
    one_line_error(_cli(config, "service", check=False), str(config / "service.json"), "damaged")


# ============================================================== two services
def test_two_services_side_by_side(services: Services, tmp_path: Path) -> None:
    """Two services with two config folders run at once, each syncing its clone of
    one repository: a file written in one arrives in the other. A folder added to a
    running service starts syncing; a second runner of a folder (``metasync daemon
    start`` there, the other service, a second service on the same config folder)
    is refused with one line; a removed folder is let go."""
    backend = tmp_path / "backend"
    a = make_folder(tmp_path / "A", [backend])
    b = clone_of(backend, tmp_path / "B")
    one = services.start("one")
    two = services.start("two")
    one.cli("add-folder", str(a))
    wait_until(lambda: daemon_json(a).get("state") == "idle"
               and daemon_json(a).get("pid") == one.proc.pid, 20,
               "the running service picked up the added folder", one.output)
    two.cli("add-folder", str(b))
    wait_until(lambda: daemon_json(b).get("state") == "idle"
               and daemon_json(b).get("pid") == two.proc.pid, 20,
               "the second service picked up its folder", two.output)

    (a / "from-a.txt").write_text("written in A\n")
    wait_until(lambda: (b / "from-a.txt").read_text() == "written in A\n", 30,
               "A's new file in B", lambda: one.output() + two.output())

    # A's own push fired its feeds: it may sync once more (finding nothing) meanwhile.
    def listing() -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(one.cli("folders", "--json").stdout)
        return doc

    listed = wait_until(lambda: (doc := listing())["folders"][0]["state"] == "idle" and doc,
                        20, "A listed idle", one.output)
    assert listed["service"]["pid"] == one.proc.pid
    assert [(f["path"], f["state"]) for f in listed["folders"]] == [(str(a), "idle")]

    # Second runners of A, each refused with one line.
    one_line_error(run_cli("daemon", "start", cwd=a, check=False), "already runs",
                   "the service runs it")
    one_line_error(run_cli("daemon", "stop", cwd=a, check=False), "the metasync service runs")
    assert run_cli("daemon", "status", "--json", cwd=a).stdout.count('"idle"') == 1
    two.cli("add-folder", str(a))
    wait_until(lambda: "another metasync daemon or service runs this folder" in two.output(),
               20, "the second service refusing A", two.output)
    config = one.config
    second = subprocess.run([METASYNC, "service", "--listen", "127.0.0.1:0"], capture_output=True,
                            text=True, env=dict(os.environ, XDG_CONFIG_HOME=str(config.parent)),
                            stdin=subprocess.DEVNULL, timeout=60)
    one_line_error(second, "a metasync service already runs", str(config))
    assert daemon_json(a).get("pid") == one.proc.pid and one.proc.poll() is None

    # Removed from service one: A is let go (service two, retrying, may take it).
    two.cli("remove-folder", str(a))
    one.cli("remove-folder", str(a))
    wait_until(lambda: daemon_json(a).get("state") == "stopped", 20, "A let go", one.output)
    services.stop(one)
    services.stop(two)


# ============================================================== isolation
def test_ten_folders_one_without_backends_one_deleted_the_others_sync(
        services: Services, tmp_path: Path) -> None:
    """One service, 10 folders (each its own repository on its own ``dir:`` backend).
    One folder's backend vanishes, another folder's directory is deleted: those two
    show ``offline`` and ``paused`` with the reason, the other eight still sync a new
    file (their version advances and it reaches a clone), and the service runs on."""
    folders = [make_folder(tmp_path / f"F{i}", [tmp_path / f"b{i}"], f"folder {i}\n")
               for i in range(10)]
    config = services.config("ten")
    for f in folders:
        _cli(config, "add-folder", str(f))
    service = services.start("ten")
    wait_until(lambda: all(daemon_json(f).get("state") == "idle" for f in folders), 30,
               "all ten folders idle", service.output)
    versions = {f: daemon_json(f)["version"] for f in folders}

    no_backend, deleted, healthy = folders[0], folders[1], folders[2:]
    shutil.move(tmp_path / "b0", tmp_path / "b0-away")
    shutil.rmtree(deleted)
    for f in [no_backend, *healthy]:
        (f / "new.txt").write_text(f"new in {f.name}\n")

    def shown() -> str:
        return service.output() + "\n" + "\n".join(f"{f.name}: {daemon_json(f)}" for f in folders)

    wait_until(lambda: all(daemon_json(f).get("version", 0) > versions[f] for f in healthy), 40,
               "the eight healthy folders pushed their new file", shown)
    wait_until(lambda: daemon_json(no_backend).get("state") == "offline", 30,
               "the folder without its backend offline", shown)
    assert "unreachable" in daemon_json(no_backend)["reason"], daemon_json(no_backend)
    assert daemon_json(no_backend)["version"] == versions[no_backend]
    deleted_id = json.loads(_cli(config, "folders", "--json").stdout)["folders"][1]["id"]
    wait_until(lambda: f"event paused {deleted_id}: {deleted}" in service.output(), 20,
               "the deleted folder paused by the service", shown)
    assert "is gone" in service.output().split(f"event paused {deleted_id}: ")[1].splitlines()[0]

    # The new files are on the backends: a clone of the last folder has its file.
    clone = clone_of(tmp_path / "b9", tmp_path / "clone9")
    assert (clone / "new.txt").read_text() == "new in F9\n"
    def listing() -> dict[str, dict[str, Any]]:
        return {f["path"]: f for f in json.loads(_cli(config, "folders", "--json").stdout)["folders"]}

    # The offline folder tries again every poll ("syncing" while it does).
    listed = wait_until(lambda: (doc := listing())[str(no_backend)]["state"] == "offline" and doc,
                        20, "the folder without its backend listed offline", shown)
    assert listed[str(deleted)]["state"] == "paused" and "gone" in listed[str(deleted)]["reason"]
    # (a healthy folder may be in its periodic rescan right now)
    assert all(listed[str(f)]["state"] in ("idle", "syncing") for f in healthy), listed
    assert service.proc.poll() is None
    services.stop(service)


# ============================================================== in one process
def test_fleet_restarts_a_failed_folder_and_steers_each_alone(tmp_path: Path) -> None:
    """The Fleet in this process (real daemons in threads, real ``dir:`` backends):
    an error escaping one folder's loop (its folder held by another command when
    the daemon starts) shows ``error`` with the reason and the folder is started again
    after a backoff, the other syncing meanwhile. Pause, resume and sync now act on
    one folder; a guard-paused folder shows what it would delete and syncs on resume;
    a backend failing past the threshold is told once, and again when it is back;
    the counters and backend usage move."""
    from metasync.app.fleet import Fleet
    from metasync.app.registry import Registry
    from metasync.daemon import Settings

    busy = make_folder(tmp_path / "busy", [tmp_path / "b0"])
    main = make_folder(tmp_path / "main", [tmp_path / "b1"])
    for i in range(12):
        (main / f"f{i:02}.txt").write_text(f"file {i}\n")
    registry = Registry(tmp_path / "config")
    ids = [registry.add(busy).id, registry.add(main).id]
    settings = Settings(settle=0.2, poll=0.3, rescan=60, failing_after=0.5, usage_every=0)
    fleet = Fleet(registry, settings, restart_after=0.3)
    held = Repository.open(busy)  # a command holds the folder as the service starts
    try:
        fleet.start()
        runner, other = fleet.get(ids[0]), fleet.get(ids[1])
        wait_until(lambda: runner.snapshot()["state"] == "error", 20, "the held folder in error",
                   lambda: str(runner.snapshot()))
        assert "started again in" in runner.snapshot()["reason"], runner.snapshot()
        wait_until(lambda: other.snapshot()["state"] == "idle"
                   and other.snapshot()["version"] == 2, 20, "the other folder synced",
                   lambda: str(other.snapshot()))
    finally:
        held.close()
    try:
        wait_until(lambda: runner.snapshot()["state"] == "idle", 20, "the held folder restarted",
                   lambda: str(runner.snapshot()))
        assert any(e.kind == "error" and e.folder == ids[0] for e in fleet.events.since(0))

        # Pause and resume one folder; sync now.
        runner.pause()
        wait_until(lambda: runner.snapshot()["state"] == "paused", 10, "paused")
        assert runner.snapshot()["reason"] == "paused by the user"
        assert other.snapshot()["state"] == "idle"
        (busy / "while-paused.txt").write_text("waits\n")
        syncs = runner.stats().syncs
        runner.resume()
        wait_until(lambda: runner.snapshot()["version"] == 2, 20, "the paused change synced")
        wait_until(lambda: runner.stats().syncs > syncs, 10, "counted")
        syncs = runner.stats().syncs
        runner.sync_now()
        wait_until(lambda: runner.stats().syncs > syncs, 10, "sync now ran a sync")
        stats = runner.stats()
        assert stats.bytes_up > 0 and stats.last_success is not None and stats.sync_seconds > 0
        backends = runner.snapshot()["backends"]
        assert backends and backends[0]["health"] == "ok" and backends[0]["objects"] > 0
        assert backends[0]["latency_ms"] is not None

        # The deletion guard: what it would delete, then resume lets it through. The
        # deletions happen while the user has paused the folder: resuming that pause
        # is no consent to them (it switched the guard off, and they were pushed).
        other.pause()
        wait_until(lambda: other.snapshot()["state"] == "paused", 10, "paused by the user")
        for i in range(10):
            (main / f"f{i:02}.txt").unlink()
        other.resume()
        wait_until(lambda: other.snapshot()["would_delete"], 20, "guard-paused",
                   lambda: str(other.snapshot()))
        assert other.snapshot()["state"] == "paused"
        assert other.snapshot()["would_delete"] == [f"f{i:02}.txt" for i in range(10)]
        assert any(e.kind == "paused" and e.folder == ids[1] for e in fleet.events.since(0))
        other.resume()
        wait_until(lambda: other.snapshot()["state"] == "idle"
                   and other.snapshot()["version"] == 3, 20, "the deletion synced on resume")
        assert other.snapshot()["would_delete"] == []

        # A backend failing past the threshold is told once; its return too.
        last = fleet.events.last
        shutil.move(tmp_path / "b0", tmp_path / "b0-away")
        wait_until(lambda: [e for e in fleet.events.since(last) if e.kind == "backend-failing"],
                   20, "backend-failing told", lambda: str(runner.snapshot()))
        snap = runner.snapshot()["backends"][0]
        assert snap["failing_since"] is not None and "unreachable" in snap["last_error"]
        assert other.snapshot()["state"] == "idle"
        shutil.move(tmp_path / "b0-away", tmp_path / "b0")
        wait_until(lambda: [e for e in fleet.events.since(last) if e.kind == "backend-ok"],
                   20, "backend-ok told", lambda: str(runner.snapshot()))
        told = [e.kind for e in fleet.events.since(last) if e.folder == ids[0]]
        assert told.count("backend-failing") == 1, told
        assert runner.snapshot()["backends"][0]["failing_since"] is None
    finally:
        fleet.stop()
    assert all(not r.alive() for r in (runner, other))
    assert daemon_json(busy)["state"] == daemon_json(main)["state"] == "stopped"


def test_a_backend_never_polled_shows_the_latency_of_the_syncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``dir:`` backend's change feed may work before the daemon's first look, and
    then its hint is never polled: its latency is that of the syncs' own requests
    (the page showed "—" for it, however often it synced)."""
    from metasync.app.fleet import Fleet
    from metasync.app.registry import Registry
    from metasync.daemon import Settings
    from metasync.remote_watch import RemoteWatch

    # No hint is ever read by a poll, as where every feed works from the start.
    monkeypatch.setattr(RemoteWatch, "hints_moved", lambda self, acceptors, on_poll=None: False)
    folder = make_folder(tmp_path / "folder", [tmp_path / "b0", tmp_path / "b1"])
    (folder / "new.txt").write_text("new\n")
    registry = Registry(tmp_path / "config")
    folder_id = registry.add(folder).id
    fleet = Fleet(registry, Settings(settle=0.2, poll=3600, rescan=3600, usage_every=0))
    fleet.start()
    try:
        runner = fleet.get(folder_id)
        wait_until(lambda: runner.snapshot()["state"] == "idle" and runner.snapshot()["version"] == 2,
                   20, "the new file synced", lambda: str(runner.snapshot()))
        backends = runner.snapshot()["backends"]
        assert len(backends) == 2, backends
        assert all(b["latency_ms"] is not None and b["latency_ms"] >= 0 for b in backends), backends
        assert all(b["health"] == "ok" for b in backends), backends
    finally:
        fleet.stop()
