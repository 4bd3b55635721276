"""The service's web server and REST API (docs/api.md, docs/app.md): a real
:class:`WebServer` over a real :class:`Fleet` syncing two folders -- two clones of
one repository on ``dir:`` backends -- called over HTTP as a script or a browser
would. Nothing is mocked; every wait is on a condition with a deadline."""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metasync import Repository
from metasync.app.auth import CSRF_COOKIE, SESSION_COOKIE, cookie_name, make_token
from metasync.app.fleet import Fleet
from metasync.app.registry import Registry
from metasync.app.web import WebServer
from metasync.daemon import Settings
from tests.conftest import backend_dirs, one_line_error, run_cli

DEADLINE = 60.0


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Service:
    registry: Registry
    fleet: Fleet
    web: WebServer
    a: Path
    b: Path
    ids: dict[str, str]  # "a"/"b" -> folder id

    def call(self, method: str, path: str, *, key: bool = True, body: object = None,
             headers: dict[str, str] | None = None) -> Answer:
        sent = dict(headers or {})
        if key:
            sent.setdefault("X-API-Key", self.registry.api_key())
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection("127.0.0.1", self.web.port, timeout=DEADLINE)
        try:
            conn.request(method, path, body=data, headers=sent)
            r = conn.getresponse()
            return Answer(r.status, r.headers, r.read())
        finally:
            conn.close()

    def ok(self, method: str, path: str, body: object = None) -> Any:
        r = self.call(method, path, body=body)
        assert 200 <= r.status < 300, (method, path, r.status, r.body)
        return r.json()

    def folder(self, name: str) -> dict[str, Any]:
        return self.ok("GET", f"/rest/folders/{self.ids[name]}")


def _make_clones(tmp_path: Path) -> tuple[Path, Path]:
    dirs = backend_dirs(tmp_path, "s1", "s2")
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    (a / "hello.txt").write_text("hello\n")
    uris = [f"dir:{d}" for d in dirs.values()]
    with Repository.init(a, uris, encrypt=False) as repo:
        repo.push("start")
    Repository.clone(uris[0], b, allow_unencrypted=True).close()
    return a, b


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    a, b = _make_clones(tmp_path)
    registry = Registry(tmp_path / "config")
    ids = {"a": registry.add(a).id, "b": registry.add(b).id}
    fleet = Fleet(registry, Settings(settle=0.2, poll=0.3, rescan=5.0))
    fleet.start()
    web = WebServer(fleet, registry, "127.0.0.1", 0)
    try:
        web.start()
        yield Service(registry, fleet, web, a.resolve(), b.resolve(), ids)
    finally:
        web.stop()
        fleet.stop()


def _synced_same_version(s: Service) -> bool:
    fa, fb = s.folder("a"), s.folder("b")
    return (fa["state"] == fb["state"] == "idle" and fa["version"] == fb["version"]
            and not fa["pending_changes"] and not fb["pending_changes"]
            and not fa["unpushed"] and not fb["unpushed"])


# ============================================================== who may call
ROUTES = [("GET", "/"), ("GET", "/index.html"), ("GET", "/metrics"), ("GET", "/rest/system"),
          ("GET", "/rest/events"), ("GET", "/rest/folders"), ("POST", "/rest/folders"),
          ("GET", "/rest/folders/{a}"), ("DELETE", "/rest/folders/{a}"),
          ("POST", "/rest/folders/{a}/pause"), ("POST", "/rest/folders/{a}/resume"),
          ("POST", "/rest/folders/{a}/sync"), ("GET", "/rest/folders/{a}/status"),
          ("GET", "/rest/folders/{a}/activity"), ("GET", "/rest/folders/{a}/tree"),
          ("GET", "/rest/folders/{a}/file?path=hello.txt"),
          ("POST", "/rest/folders/{a}/restore"), ("GET", "/rest/folders/{a}/conflicts"),
          ("POST", "/rest/folders/{a}/conflicts/resolve")]


def test_every_route_refuses_without_the_key_and_with_a_foreign_host(service: Service) -> None:
    """No page and no call without the key (401, a JSON one-liner for the API, a
    page naming `metasync gui` for pages); a wrong key is refused the same; a
    Host that is not a loopback name is refused even with the key (403)."""
    s = service
    port = s.web.port
    for method, route in ROUTES:
        path = route.format(a=s.ids["a"])
        body = {} if method == "POST" else None
        r = s.call(method, path, key=False, body=body)
        assert r.status == 401, (method, path, r.status)
        if path.startswith("/rest/") or path == "/metrics":
            error = r.json()["error"]
            assert "\n" not in error and "X-API-Key" in error
        else:
            assert b"metasync gui" in r.body
        r = s.call(method, path, body=body, headers={"X-API-Key": "not-the-key"})
        assert r.status == 401, (method, path, r.status)
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}",
                     f"localhost:{port + 1}"):
            r = s.call(method, path, body=body, headers={"Host": host})
            assert r.status == 403, (method, path, host, r.status)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert s.call("GET", "/rest/system", headers={"Host": host}).status == 200
    # Nothing was changed by the refused calls.
    assert len(s.ok("GET", "/rest/folders")) == 2


def test_the_page_is_served_from_its_folder_only(service: Service, tmp_path: Path) -> None:
    """index.html at /, the other files at /static/NAME, with a content security
    policy allowing nothing from elsewhere; nothing outside the folder, nothing
    hidden, however the path is spelled."""
    s = service
    page = tmp_path / "page"
    page.mkdir()
    (page / "index.html").write_text("<!doctype html><title>metasync</title>")
    (page / "app.js").write_text("console.log('hi');")
    (page / ".hidden").write_text("secret")
    (tmp_path / "outside.txt").write_text("secret")
    web = WebServer(s.fleet, s.registry, "127.0.0.1", 0, static=page)
    web.start()
    try:
        def get(path: str) -> Answer:
            conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=DEADLINE)
            try:
                conn.request("GET", path, headers={"X-API-Key": s.registry.api_key()})
                r = conn.getresponse()
                return Answer(r.status, r.headers, r.read())
            finally:
                conn.close()

        r = get("/")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Frame-Options"] == "DENY"
        r = get("/static/app.js")
        assert r.status == 200 and b"console.log" in r.body
        assert "javascript" in r.headers["Content-Type"]
        for bad in ("/static/../outside.txt", "/static/%2e%2e/outside.txt", "/..%2foutside.txt",
                    "/static/.hidden", "/.hidden", "/static/%2fetc%2fpasswd", "/nothing.js"):
            r = get(bad)
            assert r.status == 404 and b"secret" not in r.body, (bad, r.status)
    finally:
        web.stop()


def _cookies(answer: Answer) -> dict[str, str]:
    """name -> the whole Set-Cookie line."""
    return {line.split("=", 1)[0]: line for line in answer.headers.get_all("Set-Cookie") or []}


def test_login_token_works_once_and_sets_an_httponly_cookie_with_csrf(service: Service) -> None:
    s = service
    token = make_token(s.registry.api_key())
    r = s.call("GET", "/login?token=" + urllib.parse.quote(token), key=False)
    assert r.status == 303 and r.headers["Location"] == "/"
    cookies = _cookies(r)
    # Named for the port: another service on 127.0.0.1 gets cookies of its own.
    session_name, csrf_name = (cookie_name(SESSION_COOKIE, s.web.port),
                               cookie_name(CSRF_COOKIE, s.web.port))
    session_line, csrf_line = cookies[session_name], cookies[csrf_name]
    assert "HttpOnly" in session_line and "SameSite=Strict" in session_line
    assert "HttpOnly" not in csrf_line and "SameSite=Strict" in csrf_line  # the page reads it
    session = session_line.split(";")[0].split("=", 1)[1]
    csrf = csrf_line.split(";")[0].split("=", 1)[1]
    # Once only; a forged, an expired and a foreign-key token never.
    assert s.call("GET", "/login?token=" + urllib.parse.quote(token), key=False).status == 401
    nonce, expiry, mac = token.split(".")
    forged = f"{nonce}x.{expiry}.{mac}"
    for bad in (forged, make_token(s.registry.api_key(), now=time.time() - 3600),
                make_token("another-key-entirely-0123456789"), "", "a.b.c",
                # not ASCII digits, or no expiry make_token writes: 401, not a 500
                "a.\u00b2.b", "a." + "9" * 5000 + ".b"):
        assert s.call("GET", "/login?token=" + urllib.parse.quote(bad), key=False).status == 401
    # The cookie reads; changes need the CSRF header equal to the cookie.
    jar = {"Cookie": f"{session_name}={session}; {csrf_name}={csrf}"}
    r = s.call("GET", "/rest/folders", key=False, headers=jar)
    assert r.status == 200 and len(r.json()) == 2
    sync = f"/rest/folders/{s.ids['a']}/sync"
    assert s.call("POST", sync, key=False, headers=jar).status == 403
    assert s.call("POST", sync, key=False, headers={**jar, "X-CSRF-Token": "guess"}).status == 403
    r = s.call("POST", sync, key=False, headers={**jar, "X-CSRF-Token": csrf})
    assert r.status == 200 and r.json()["id"] == s.ids["a"]
    # A made-up session is no session.
    r = s.call("GET", "/rest/folders", key=False,
               headers={"Cookie": f"{session_name}=made-up; {csrf_name}={csrf}"})
    assert r.status == 401


def test_gui_prints_a_login_address_that_signs_in(service: Service, tmp_path: Path) -> None:
    """`metasync gui --print` makes a working one-time address from the config
    folder alone; with no service running it fails in one line."""
    s = service
    xdg = tmp_path / "xdg"
    config = xdg / "metasync"
    config.mkdir(parents=True)
    env = {"XDG_CONFIG_HOME": str(xdg)}
    proc = run_cli("gui", "--print", check=False, env_extra=env)
    one_line_error(proc, "no metasync service is running", "metasync service")
    # This service, as seen from that config folder: its key and where it runs.
    shutil.copy(s.registry.config_dir / "api-key", config / "api-key")
    Registry(config).write_running("127.0.0.1", s.web.port)
    url = run_cli("gui", "--print", env_extra=env).stdout.strip()
    parsed = urllib.parse.urlsplit(url)
    assert parsed.netloc == f"127.0.0.1:{s.web.port}" and parsed.path == "/login"
    r = s.call("GET", f"{parsed.path}?{parsed.query}", key=False)
    assert r.status == 303 and cookie_name(SESSION_COOKIE, s.web.port) in _cookies(r)


# ============================================================== folders
def test_folder_list_pause_resume_sync_and_errors(service: Service) -> None:
    s = service
    folders = s.ok("GET", "/rest/folders")
    assert {f["id"] for f in folders} == set(s.ids.values())
    assert {f["path"] for f in folders} == {str(s.a), str(s.b)}
    fid = s.ids["a"]
    assert s.ok("POST", f"/rest/folders/{fid}/pause")["id"] == fid  # paused once a sync ends
    wait_for(lambda: s.folder("a")["state"] == "paused", "folder A paused")
    s.ok("POST", f"/rest/folders/{fid}/resume")
    wait_for(lambda: s.folder("a")["state"] in ("idle", "syncing"), "folder A resumed")
    assert s.ok("POST", f"/rest/folders/{fid}/sync")["id"] == fid
    st = s.ok("GET", f"/rest/folders/{fid}/status")
    assert {"version", "changes", "unpushed", "latest", "behind", "ahead"} <= set(st)
    system = s.ok("GET", "/rest/system")
    assert system["folders"] == 2 and system["config_dir"] == str(s.registry.config_dir)
    # Errors: one JSON line with the right status.
    for method, path, body, status in [
        ("GET", "/rest/folders/deadbeef", None, 404),
        ("POST", "/rest/folders", {"path": "relative/path"}, 400),
        ("POST", "/rest/folders", {"path": str(s.a.parent / "nowhere")}, 400),
        ("GET", f"/rest/folders/{fid}/activity?limit=lots", None, 400),
        ("GET", "/rest/events?since=-1", None, 400),
    ]:
        r = s.call(method, path, body=body)
        assert r.status == status, (path, r.status, r.body)
        error = r.json()["error"]
        assert error and "\n" not in error and "Traceback" not in error
    r = s.call("POST", f"/rest/folders/{fid}/restore", headers={"Content-Type": "application/json"})
    assert r.status == 400 and "JSON" in r.json()["error"]


def test_a_folder_removed_and_added_again(service: Service) -> None:
    """DELETE forgets a folder (its files stay); POST registers it again and it syncs."""
    s = service
    gone = s.ok("DELETE", f"/rest/folders/{s.ids['b']}")
    assert gone["removed"] == s.ids["b"]
    assert [f["id"] for f in s.ok("GET", "/rest/folders")] == [s.ids["a"]]
    assert s.call("GET", f"/rest/folders/{s.ids['b']}").status == 404
    assert (s.b / "hello.txt").read_text() == "hello\n"
    r = s.call("POST", "/rest/folders", body={"path": str(s.b)})
    assert r.status == 201, r.body
    again = r.json()
    assert again["path"] == str(s.b) and again["id"] != s.ids["b"]
    assert s.call("POST", "/rest/folders", body={"path": str(s.b)}).status == 400  # twice
    s.ids["b"] = again["id"]
    (s.a / "after.txt").write_text("after\n")
    wait_for(lambda: (s.b / "after.txt").is_file(), "the re-added folder syncing")


def test_untrusted_paths_are_refused(service: Service) -> None:
    s = service
    fid = s.ids["a"]
    for bad in ["../A/hello.txt", "/etc/passwd", "a/../../x", "hello.txt\x00x", ".metasync/state.db",
                ".METASYNC/config", "..", '"unterminated']:
        q = urllib.parse.quote(bad)
        for method, path, body in [
            ("GET", f"/rest/folders/{fid}/file?path={q}", None),
            ("GET", f"/rest/folders/{fid}/file?path={q}&version=1", None),
            ("GET", f"/rest/folders/{fid}/tree?path={q}", None),
            ("POST", f"/rest/folders/{fid}/restore", {"path": bad}),
            ("POST", f"/rest/folders/{fid}/conflicts/resolve", {"copy": bad, "keep": "both"}),
        ]:
            r = s.call(method, path, body=body)
            assert r.status == 400, (bad, path, r.status, r.body)
            assert "\n" not in r.json()["error"]
    # A link in the folder is not followed for a download of the file on disk.
    (s.a / "outside.txt").symlink_to("/etc/hostname")
    r = s.call("GET", f"/rest/folders/{fid}/file?path=outside.txt")
    assert r.status == 404
    # Nor is a FIFO opened (an open for reading would wait for a writer forever).
    os.mkfifo(s.a / "pipe")
    r = s.call("GET", f"/rest/folders/{fid}/file?path=pipe")
    assert r.status == 404 and "not a file" in r.json()["error"]


def test_a_name_that_is_not_utf8_round_trips_in_its_display_form(service: Service) -> None:
    """Paths go out and come back in the display form of docs/cli.md: a name whose
    bytes are not UTF-8 is listed quoted, and that text downloads it (on disk and
    at a version), its bytes intact."""
    s = service
    fid = s.ids["a"]
    name = os.fsdecode(b"caf\xe9.txt")
    (s.a / name).write_bytes(b"latin-1 name\n")
    wait_for(lambda: (s.b / name).is_file(), "the file in B")
    wait_for(lambda: _synced_same_version(s), "both idle")
    version = s.folder("a")["version"]
    shown = next(e["path"] for e in s.ok("GET", f"/rest/folders/{fid}/tree?version={version}")
                 if e["path"].startswith('"caf'))
    assert shown == '"caf\\351.txt"'
    for query in (f"path={urllib.parse.quote(shown)}",
                  f"path={urllib.parse.quote(shown)}&version={version}"):
        r = s.call("GET", f"/rest/folders/{fid}/file?{query}")
        assert r.status == 200 and r.body == b"latin-1 name\n", (query, r.status, r.body)
        assert "caf%E9.txt" in r.headers["Content-Disposition"]


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` with these labels."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_activity_shows_a_pushed_file_and_metrics_counters_move(service: Service) -> None:
    """A file written in folder A: the activity lists it (device, message, added),
    it reaches folder B, and /metrics -- parsed by Prometheus's own parser -- shows
    A's syncs and uploaded bytes and B's downloaded bytes going up."""
    s = service
    wait_for(lambda: _synced_same_version(s), "both folders idle at one version")
    before = s.call("GET", "/metrics").body.decode()
    families = {f.name for f in text_string_to_metric_families(before)}
    assert {"metasync_folder_syncs", "metasync_folder_uploaded_bytes",
            "metasync_backend_requests", "metasync_folder_pending_changes"} <= families
    a_id, b_id = s.ids["a"], s.ids["b"]
    content = random.Random(5).randbytes(300_000)
    (s.a / "report.bin").write_bytes(content)

    def listed() -> dict[str, Any] | None:
        for v in s.ok("GET", f"/rest/folders/{a_id}/activity?limit=5"):
            if {"path": "report.bin", "kind": "added"} in v["changes"]:
                return v
        return None

    entry = wait_for(listed, "report.bin in A's activity")
    assert entry["device"] and "report.bin" in entry["message"] and entry["time"] > 0
    wait_for(lambda: (s.b / "report.bin").is_file()
             and (s.b / "report.bin").read_bytes() == content, "report.bin in folder B")

    def moved() -> bool:
        after = s.call("GET", "/metrics").body.decode()
        return (_metric(after, "metasync_folder_syncs_total", folder=a_id)
                > _metric(before, "metasync_folder_syncs_total", folder=a_id)
                and _metric(after, "metasync_folder_uploaded_bytes_total", folder=a_id)
                >= _metric(before, "metasync_folder_uploaded_bytes_total", folder=a_id) + 300_000
                and _metric(after, "metasync_folder_downloaded_bytes_total", folder=b_id)
                > _metric(before, "metasync_folder_downloaded_bytes_total", folder=b_id))

    wait_for(moved, "A's syncs and uploaded bytes and B's downloaded bytes to go up")
    text = s.call("GET", "/metrics").body.decode()
    assert _metric(text, "metasync_folder_state", folder=a_id) == 1.0  # one state at a time
    assert _metric(text, "metasync_backend_requests_total", folder=a_id) > 0


def test_a_backend_gone_shows_down_in_metrics_and_back_up(service: Service, tmp_path: Path) -> None:
    """metasync_backend_up of a backend whose folder disappears goes to 0 (and the
    folder object says why), and back to 1 when it returns."""
    s = service
    a_id = s.ids["a"]
    wait_for(lambda: _synced_same_version(s), "both idle")
    store = tmp_path / "s2"

    def up() -> float | None:
        text = s.call("GET", "/metrics").body.decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (sample.name == "metasync_backend_up" and sample.labels["folder"] == a_id
                        and sample.labels["backend"].endswith("s2")):
                    return sample.value
        return None

    wait_for(lambda: up() == 1.0, "s2 up")
    store.rename(tmp_path / "s2-away")
    try:
        (s.a / "while-away.txt").write_text("x\n")
        wait_for(lambda: up() == 0.0, "s2 down in /metrics")

        def said() -> bool:
            b = next(b for b in s.folder("a")["backends"] if b["name"].endswith("s2"))
            return b["health"] != "ok" or b["failing_since"] is not None

        wait_for(said, "the folder object saying s2 fails")
    finally:
        (tmp_path / "s2-away").rename(store)
    s.ok("POST", f"/rest/folders/{a_id}/sync")
    wait_for(lambda: up() == 1.0, "s2 back up in /metrics")


def test_tree_file_and_restore_round_trip_byte_for_byte(service: Service) -> None:
    """A file (several MB: read in pieces) deleted later is found in an older
    version's tree, downloaded from it exactly, and restored from it exactly --
    in A, and then in B by the sync the restore starts."""
    s = service
    fid = s.ids["a"]
    content = random.Random(7).randbytes(9 * 1024 * 1024 + 123)
    (s.a / "docs").mkdir()
    (s.a / "docs" / "big.bin").write_bytes(content)
    wait_for(lambda: (s.b / "docs" / "big.bin").is_file()
             and (s.b / "docs" / "big.bin").stat().st_size == len(content), "big.bin in B")
    wait_for(lambda: _synced_same_version(s), "both idle")
    version = s.folder("a")["version"]
    (s.a / "docs" / "big.bin").unlink()
    wait_for(lambda: not (s.b / "docs" / "big.bin").exists(), "the deletion in B")
    wait_for(lambda: s.folder("a")["version"] > version and s.folder("a")["state"] == "idle",
             "the deletion synced")
    root = s.ok("GET", f"/rest/folders/{fid}/tree?version={version}")
    assert {"name": "docs", "path": "docs", "type": "dir", "size": 0} in root
    listing = s.ok("GET", f"/rest/folders/{fid}/tree?version={version}&path=docs")
    assert listing == [{"name": "big.bin", "path": "docs/big.bin", "type": "file",
                        "size": len(content)}]
    assert s.ok("GET", f"/rest/folders/{fid}/tree?path=docs") == []  # the latest version
    r = s.call("GET", f"/rest/folders/{fid}/file?path=docs/big.bin&version={version}")
    assert r.status == 200 and r.body == content
    assert "attachment" in r.headers["Content-Disposition"]
    assert s.call("GET", f"/rest/folders/{fid}/file?path=docs/big.bin").status == 404  # gone
    assert s.call("GET", f"/rest/folders/{fid}/file?path=docs/big.bin&version=999").status == 404
    restored = s.ok("POST", f"/rest/folders/{fid}/restore",
                    {"path": "docs/big.bin", "version": version})
    assert restored == {"restored": ["docs/big.bin"]}
    assert (s.a / "docs" / "big.bin").read_bytes() == content
    r = s.call("GET", f"/rest/folders/{fid}/file?path=docs/big.bin")  # on disk now
    assert r.status == 200 and r.body == content
    wait_for(lambda: (s.b / "docs" / "big.bin").is_file()
             and (s.b / "docs" / "big.bin").read_bytes() == content, "the restore reaching B")


# ============================================================== conflicts
def _make_conflict(s: Service, name: str, texts: dict[str, str]) -> None:
    """Both folders edit ``name`` while paused; A syncs first, then B: B's push
    merges, keeping B's version as a conflict copy. Starts from both folders idle
    at one version, so A's next version is its edit and not a pull of something an
    earlier test left in flight."""
    wait_for(lambda: _synced_same_version(s), "both idle before the conflict")
    for k in ("a", "b"):
        s.ok("POST", f"/rest/folders/{s.ids[k]}/pause")
        wait_for(lambda k=k: s.folder(k)["state"] == "paused", f"{k} paused")
    (s.a / name).write_text(texts["a"])
    (s.b / name).write_text(texts["b"])
    version = s.folder("a")["version"]
    s.ok("POST", f"/rest/folders/{s.ids['a']}/resume")
    wait_for(lambda: s.folder("a")["version"] > version and s.folder("a")["state"] == "idle",
             "A's edit pushed")
    s.ok("POST", f"/rest/folders/{s.ids['b']}/resume")


def _conflicts(s: Service, k: str) -> list[dict[str, Any]]:
    return s.ok("GET", f"/rest/folders/{s.ids[k]}/conflicts")


def _texts(root: Path, stem: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in root.iterdir() if p.name.startswith(stem)}


def test_conflict_listed_on_both_devices_and_keep_mine_converges(service: Service) -> None:
    """A conflict is listed on both devices, each saying which file is its own
    (the two devices share a name here: the history tells them apart); "keep
    mine" on B leaves B's text under the name on both devices."""
    s = service
    _make_conflict(s, "notes.txt", {"a": "A's notes\n", "b": "B's notes\n"})
    wait_for(lambda: _conflicts(s, "a") and _conflicts(s, "b"), "the conflict on both sides")
    wait_for(lambda: _synced_same_version(s), "both idle")
    [ca], [cb] = _conflicts(s, "a"), _conflicts(s, "b")
    assert ca["path"] == cb["path"] == "notes.txt" and ca["copy"] == cb["copy"]
    assert ca["copy"].startswith("notes (conflict ") and ca["copy"].endswith(").txt")
    assert (ca["mine"], cb["mine"]) == ("path", "copy")  # A pushed first: A kept the name
    assert (s.b / cb["copy"]).read_text() == "B's notes\n"
    left = s.ok("POST", f"/rest/folders/{s.ids['b']}/conflicts/resolve",
                {"copy": cb["copy"], "keep": "mine"})
    assert left == []
    assert _texts(s.b, "notes") == {"notes.txt": "B's notes\n"}
    wait_for(lambda: _texts(s.a, "notes") == {"notes.txt": "B's notes\n"}, "A taking B's choice")
    # A's dropped version stays in history.
    entries = s.ok("GET", f"/rest/folders/{s.ids['a']}/activity?limit=20")
    assert any({"path": "notes.txt", "kind": "modified"} in e["changes"] for e in entries)


def test_conflict_keep_both_and_keep_theirs(service: Service) -> None:
    s = service
    _make_conflict(s, "plan.md", {"a": "plan A\n", "b": "plan B\n"})
    wait_for(lambda: _conflicts(s, "a") and _conflicts(s, "b"), "the conflict on both sides")
    wait_for(lambda: _synced_same_version(s), "both idle")
    [c] = _conflicts(s, "a")
    device = c["device"]
    left = s.ok("POST", f"/rest/folders/{s.ids['a']}/conflicts/resolve",
                {"copy": c["copy"], "keep": "both"})
    assert left == []
    kept = {"plan.md": "plan A\n", f"plan ({device}).md": "plan B\n"}
    assert _texts(s.a, "plan") == kept
    wait_for(lambda: _texts(s.b, "plan") == kept, "B taking the kept copy")
    # A second conflict, resolved "keep theirs" on A: B's version wins on both.
    wait_for(lambda: _synced_same_version(s), "both idle")
    _make_conflict(s, "plan.md", {"a": "plan A2\n", "b": "plan B2\n"})
    wait_for(lambda: _conflicts(s, "a"), "the second conflict on A")
    wait_for(lambda: _synced_same_version(s), "both idle")
    [c] = _conflicts(s, "a")
    assert c["mine"] == "path"
    assert s.call("POST", f"/rest/folders/{s.ids['a']}/conflicts/resolve",
                  body={"copy": c["copy"], "keep": "nobody"}).status == 400
    assert s.call("POST", f"/rest/folders/{s.ids['a']}/conflicts/resolve",
                  body={"copy": "plan.md", "keep": "mine"}).status == 404
    assert s.ok("POST", f"/rest/folders/{s.ids['a']}/conflicts/resolve",
                {"copy": c["copy"], "keep": "theirs"}) == []
    want = {"plan.md": "plan B2\n", f"plan ({device}).md": "plan B\n"}
    assert _texts(s.a, "plan") == want
    wait_for(lambda: _texts(s.b, "plan") == want, "B taking A's choice")


# ============================================================== events and notifications
def test_events_are_served_since_an_id(service: Service) -> None:
    s = service
    s.fleet.events.emit("conflict", s.ids["a"], "notes.txt conflicts")
    first = s.ok("GET", "/rest/events?since=0")
    assert any(e["kind"] == "conflict" and e["message"] == "notes.txt conflicts"
               for e in first["events"])
    last = first["last"]
    assert s.ok("GET", f"/rest/events?since={last}") == {"last": last, "events": []}
    s.fleet.events.emit("paused", s.ids["b"], "B paused")
    later = s.ok("GET", f"/rest/events?since={last}")
    assert [e["message"] for e in later["events"] if e["kind"] == "paused"] == ["B paused"]
    assert all(e["id"] > last for e in later["events"])
    # An id from an earlier run of the service (ids start again): every event is new.
    again = s.ok("GET", f"/rest/events?since={later['last'] + 1000}")
    assert again["events"] == s.ok("GET", "/rest/events?since=0")["events"]


class _NotificationServer:
    """A small real notification server on a private session bus: owns
    org.freedesktop.Notifications and records every Notify call."""

    def __init__(self) -> None:
        from jeepney import message_bus
        from jeepney.io.blocking import open_dbus_connection

        self.proc = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        self.conn = open_dbus_connection(bus=self.address)
        reply = self.conn.send_and_get_reply(message_bus.RequestName("org.freedesktop.Notifications"))
        assert reply.body == (1,)  # primary owner
        self.calls: list[tuple[Any, ...]] = []
        self.got = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        from jeepney import HeaderFields, MessageType, new_method_return

        while True:
            try:
                msg = self.conn.receive()
            except (OSError, ValueError):
                return
            if (msg.header.message_type == MessageType.method_call
                    and msg.header.fields.get(HeaderFields.member) == "Notify"):
                self.calls.append(msg.body)
                self.conn.send(new_method_return(msg, "u", (len(self.calls),)))
                self.got.set()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.conn.close()


@pytest.mark.skipif(shutil.which("dbus-daemon") is None, reason="needs dbus-daemon (Debian dbus)")
def test_desktop_notification_reaches_the_session_bus(tmp_path: Path) -> None:
    """A conflict event becomes one org.freedesktop.Notifications.Notify call on the
    session bus; events of other kinds do not."""
    from metasync.app.fleet import EventLog
    from metasync.app.notify import Notifier

    server = _NotificationServer()
    events = EventLog()
    notifier = Notifier(events, address=server.address)
    try:
        notifier.start()
        events.emit("synced", "f0000001", "synced version 3")
        # A name from another device is text, never markup the server renders.
        events.emit("conflict", "f0000001", "<img src=x>notes.txt: both changed it")
        assert server.got.wait(DEADLINE), "no Notify call reached the bus"
        [call] = server.calls  # (app, replaces, icon, summary, body, actions, hints, timeout)
        assert call[0] == "metasync" and call[3] == "metasync: conflict"
        assert call[4] == "&lt;img src=x&gt;notes.txt: both changed it"
    finally:
        notifier.stop()
        server.close()


def test_no_session_bus_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without DBUS_SESSION_BUS_ADDRESS nothing is sent and nothing fails; with an
    address where no bus answers, the event is dropped and the notifier goes on."""
    from metasync.app.fleet import EventLog
    from metasync.app.notify import Notifier

    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    events = EventLog()
    quiet = Notifier(events)
    quiet.start()
    events.emit("conflict", "f0000001", "x")
    quiet.stop()
    assert quiet.address is None and quiet.sent == 0
    dead = Notifier(events, address=f"unix:path={tmp_path / 'no-bus'}")
    dead.start()
    events.emit("paused", "f0000001", "y")
    dead.stop()  # returns: the failed send was logged, not raised
    assert dead.sent == 0


def test_two_first_calls_for_the_api_key_agree(tmp_path: Path) -> None:
    """The service starting while `metasync gui` runs: both make a key at once, and
    both must end up with the one the file holds (each kept its own before)."""
    registries = [Registry(tmp_path / "config") for _ in range(8)]
    barrier = threading.Barrier(len(registries))

    def first_call(registry: Registry) -> str:
        barrier.wait(timeout=30)
        return registry.api_key()

    with ThreadPoolExecutor(len(registries)) as pool:
        keys = set(pool.map(first_call, registries))
    assert keys == {(tmp_path / "config" / "api-key").read_text().strip()}
    assert (tmp_path / "config" / "api-key").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / "config").iterdir()] == ["api-key"]


def test_the_service_refuses_to_listen_beyond_this_machine(tmp_path: Path) -> None:
    """Plain HTTP with the key in every request: an address other than loopback is
    refused in one line (it served the whole API to the network)."""
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for listen in ("0.0.0.0:0", "[::]:0", "192.168.1.10:8384"):
        proc = run_cli("service", "--listen", listen, check=False, env_extra=env)
        one_line_error(proc, "the service listens only on this machine", "--listen 127.0.0.1")


def test_a_folder_held_up_stalls_only_its_own_calls(service: Service) -> None:
    """Folder B's lock held by another command (or its backend hanging): calls that
    open B's repository wait for it, and the list of folders, A's calls and
    /metrics answer meanwhile (they queued behind B's in one shared pool before)."""
    s = service
    copy = "gone (conflict elsewhere 2026-01-01 000000).txt"
    with ThreadPoolExecutor(6) as pool:
        with Repository.open(s.b, wait=60):
            stuck = [pool.submit(s.call, "POST", f"/rest/folders/{s.ids['b']}/conflicts/resolve",
                                 body={"copy": copy, "keep": "both"}) for _ in range(6)]
            assert s.call("GET", "/rest/folders").status == 200
            assert s.call("GET", f"/rest/folders/{s.ids['a']}/activity").status == 200
            assert s.call("GET", "/metrics").status == 200
            # B's calls are all still waiting for its lock, which this test holds.
            assert not any(f.done() for f in stuck)
        # Let go: each of B's calls runs, and answers that no such conflict exists.
        assert {f.result().status for f in stuck} == {404}
