"""The service's web page in a real browser (issue 19, "Done when" 1).

Debian's headless Chromium, driven by Selenium through Debian's chromedriver
(Selenium Manager is never asked to download anything), against two real
``metasync service`` processes -- "laptop" (A) and "desktop" (B), each with its
own config folder (``XDG_CONFIG_HOME``) -- syncing two folders over ``dir:``
backends: "Notes" and "Photos". The page shown is A's; B's answers come through
its REST API with the key, as a script's would. One browser and one pair of
services serve every test of the module, in file order.

The tests save the screenshots docs/app.md shows (docs/img/app-*.png).

Nothing sleeps to synchronise: every wait is a condition with a deadline
(WebDriverWait in the browser, :func:`wait_until` outside it).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import METASYNC, snapshot
from conftest import wait_until as polled_until
from metasync import Repository
from metasync.localdb import LocalDB
from metasync.state import LocalState

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip("needs Debian's chromium and chromium-driver (bin/setup-system installs them)",
                allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "docs" / "img"
# Fast timings; a backend failing for 1 s is worth a notification.
FAST = ["--settle", "0.3", "--poll", "0.3", "--rescan", "3", "--failing-after", "1"]
WAIT = 45.0  # seconds any one condition may take on a loaded 2-core machine


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """conftest's :func:`~conftest.wait_until`, with this file's order of arguments."""
    return polled_until(condition, timeout, what)


def files(root: Path) -> dict[str, bytes]:
    """Regular files under ``root`` (``.metasync`` excluded), by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".metasync" not in p.relative_to(root).parts}


# ---------------------------------------------------------------- the services
@dataclass
class Service:
    """One ``metasync service`` process with its own config folder."""

    name: str
    config_home: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""
    key: str = ""
    ids: dict[str, str] = field(default_factory=dict)  # folder label -> id

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "METASYNC_PASSPHRASE"}
        env["XDG_CONFIG_HOME"] = str(self.config_home)
        return env

    def cli(self, *args: str) -> str:
        proc = subprocess.run([METASYNC, *args], env=self.env(), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 0, f"metasync {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def start(self) -> None:
        log = open(self.config_home / "service.out", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([METASYNC, "service", "--listen", "127.0.0.1:0", *FAST],
                                     env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=log)
        log.close()
        running = self.config_home / "metasync" / "running.json"

        def listening() -> dict[str, Any] | None:
            assert self.proc is not None and self.proc.poll() is None, self.log()
            doc: dict[str, Any] = json.loads(running.read_text())
            return doc if doc.get("pid") == self.proc.pid and doc.get("port") else None

        doc = wait_until(listening, f"service {self.name} to listen")
        self.url = f"http://127.0.0.1:{doc['port']}"
        self.key = self.cli("service", "api-key").strip()
        self.ids = {f["label"]: f["id"] for f in self.rest("GET", "/rest/folders")}

    def log(self) -> str:
        return (self.config_home / "service.out").read_text(errors="replace")[-3000:]

    def rest(self, method: str, path: str, body: Any = None) -> Any:
        """One call of docs/api.md with the key, as a script makes it."""
        request = urllib.request.Request(
            self.url + path, method=method, headers={"X-API-Key": self.key,
                                                     "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def folder(self, label: str) -> dict[str, Any]:
        doc: dict[str, Any] = self.rest("GET", f"/rest/folders/{self.ids[label]}")
        return doc

    def settled(self, label: str) -> dict[str, Any] | None:
        """The folder object once its sync caught up (idle, nothing pending or unpushed)."""
        f = self.folder(label)
        ok = f["state"] == "idle" and not f["pending_changes"] and not f["unpushed"]
        return f if ok else None

    def stop(self) -> str:
        """SIGTERM, wait; a non-empty answer says what went wrong."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return "" if code == 0 else f"service {self.name} exited {code}:\n{self.log()}"


def set_device(root: Path, device: str) -> None:
    """Name the device a clone's commits and conflict copies carry (both services run
    on this one host, whose name both would otherwise carry)."""
    db = LocalDB(root / ".metasync" / "state.db")
    try:
        state = LocalState(db)
        with state.transaction():
            state.device = device
    finally:
        db.close()


@dataclass
class World:
    tmp: Path
    a: Service
    b: Service
    roots: dict[tuple[str, str], Path]  # (service name, folder label) -> folder
    backends: dict[str, list[Path]]     # folder label -> its dir: backends

    def root(self, side: str, label: str) -> Path:
        return self.roots[(side, label)]


GUARDED = {f"img{i:02d}.jpg": f"photo {i}\n".encode() for i in range(25)}


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    # A short folder of its own: its paths show in the screenshots.
    tmp = Path(tempfile.mkdtemp(prefix="metasync-page-"))
    roots: dict[tuple[str, str], Path] = {}
    backends: dict[str, list[Path]] = {}
    contents = {"Notes": {"notes.txt": b"shopping: milk\n", "plan.txt": b"plan: rest\n"},
                "Photos": GUARDED}
    for label, tree in contents.items():
        backends[label] = [tmp / f"{label.lower()}-store-{n}" for n in (1, 2)]
        a = tmp / "laptop" / label
        a.mkdir(parents=True)
        for name, data in tree.items():
            (a / name).write_bytes(data)
        Repository.init(a, [f"dir:{b}" for b in backends[label]], replicas=2, encrypt=False,
                        mkdir=True).close()
        set_device(a, "laptop")
        with Repository.open(a) as repo:
            repo.push("the first files")
        b = tmp / "desktop" / label
        b.parent.mkdir(exist_ok=True)
        Repository.clone(f"dir:{backends[label][0]}", b, allow_unencrypted=True).close()
        set_device(b, "desktop")
        roots[("A", label)], roots[("B", label)] = a, b
    services = {side: Service(side, tmp / f"config-{side}") for side in ("A", "B")}
    for side, svc in services.items():
        svc.config_home.mkdir()
        for label in contents:
            svc.cli("add-folder", str(roots[(side, label)]))
    problems = []
    try:
        for svc in services.values():
            svc.start()
        yield World(tmp, services["A"], services["B"], roots, backends)
    finally:
        problems = [p for p in (svc.stop() for svc in services.values()) if p]
    assert not problems, "\n".join(problems)
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a service failed, to look at


# ---------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def downloads() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="metasync-downloads-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(downloads: Path) -> Iterator[WebDriver]:
    profile = tempfile.mkdtemp(prefix="metasync-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=str(CHROMEDRIVER)))
    try:
        # The screenshots' size, whatever the window manager's chrome takes.
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False})
        driver.execute_cdp_cmd("Browser.setDownloadBehavior", {
            "behavior": "allow", "downloadPath": str(downloads)})
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def shot(driver: WebDriver, name: str) -> None:
    """Save the page as docs/img/app-NAME.png (docs/app.md shows it)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.save_screenshot(str(SHOTS / f"app-{name}.png"))


def until(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str,
          timeout: float = WAIT) -> Any:
    """WebDriverWait with a message; an element replaced by a poll's redraw is "not yet"."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, f"not within {timeout:g} s: {what}")


def css(driver: WebDriver | WebElement, selector: str) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, selector)


def attrs(driver: WebDriver, selector: str, name: str) -> list[str]:
    """Attribute ``name`` of every element ``selector`` matches, read in one step (the
    page redraws lists as it polls: elements found earlier may be gone)."""
    found: list[str] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))",
        selector, name)
    return found


def click(driver: WebDriver, selector: str, what: str) -> None:
    """Click the element ``selector`` matches, finding it again if a redraw replaced it."""
    def clicked(d: WebDriver) -> bool:
        found = css(d, selector)
        if not found:
            return False
        found[0].click()
        return True

    until(driver, clicked, what)


def open_folder(driver: WebDriver, world: World, label: str, tab: str, query: str = "") -> None:
    """Show folder ``label`` of service A on ``tab`` (the page's own links look the same)."""
    fid = world.a.ids[label]
    # Signed in by the first test, unless this test runs alone (or on another worker).
    if not any(c["name"].startswith("metasync-session") for c in driver.get_cookies()):
        sign_in(driver, world.a)
    driver.get(f"{world.a.url}/#/{fid}/{tab}{query}")
    until(driver, lambda d: css(d, f"#folder[data-folder-id='{fid}']")
          and css(d, f"#tab-{tab}[aria-selected='true']"), f"folder {label}, tab {tab}")


def sign_in(driver: WebDriver, svc: Service) -> None:
    """As a user does: `metasync gui --print` and open the URL it prints."""
    out = svc.cli("gui", "--print")
    match = re.search(r"https?://\S+", out)
    assert match, f"no URL in `metasync gui --print`: {out!r}"
    driver.get(match.group(0))
    until(driver, lambda d: css(d, "#folders li[data-folder-id]"), "the page to list folders")


# ---------------------------------------------------------------- the tests
def test_the_page_refuses_access_without_the_key(world: World, browser: WebDriver) -> None:
    """No cookie, no key: neither the page nor its API nor its script is served, and a
    made-up sign-in token is refused; `metasync gui --print`'s URL signs in."""
    browser.delete_all_cookies()
    for path in ("/", "/rest/folders", "/static/app.js", "/login?token=not-a-real-token"):
        browser.get(world.a.url + path)
        body = browser.find_element(By.TAG_NAME, "body").text
        assert str(world.root("A", "Notes")) not in body, (path, body)
        assert not css(browser, "#folders li"), path
        assert "metasync gui" in body or "error" in body, (path, body)
    browser.get(world.a.url + "/")
    assert "metasync gui" in browser.find_element(By.TAG_NAME, "body").text
    shot(browser, "signed-out")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(world.a.url + "/rest/folders", timeout=30)
    assert refused.value.code == 401

    sign_in(browser, world.a)
    assert set(attrs(browser, "#folders li", "data-folder-id")) == set(world.a.ids.values())
    # The cookie it set is HttpOnly: the page's script cannot read the session.
    assert "session" not in browser.execute_script("return document.cookie").lower()
    # A state-changing call with the cookie but without the CSRF header (what a form
    # or script of another site could make the browser send) is refused.
    fid = world.a.ids["Notes"]
    status = browser.execute_async_script(
        "fetch(arguments[0], {method: 'POST'}).then(r => arguments[1](r.status))",
        f"/rest/folders/{fid}/pause")
    assert status == 403
    assert world.a.folder("Notes")["state"] != "paused"


def test_a_new_file_shows_in_activity_then_reaches_the_other_service(
        world: World, browser: WebDriver) -> None:
    open_folder(browser, world, "Notes", "activity")
    data = random.Random(1).randbytes(3000)
    (world.root("A", "Notes") / "report.pdf").write_bytes(data)
    added = ("//ol[@id='activity']/li[@data-version]"
             "[.//li[@data-path='report.pdf' and @data-kind='added']]")
    text = until(browser, lambda d: [e.text for e in d.find_elements(By.XPATH, added)],
                 "report.pdf to appear as added in A's activity")[0]
    assert "laptop" in text
    shot(browser, "activity")
    b_file = world.root("B", "Notes") / "report.pdf"
    wait_until(lambda: b_file.read_bytes() == data, "report.pdf to reach service B's folder")


def _commit(world: World, change: Callable[[], None], what: str) -> int:
    """Make ``change`` in A's Notes and wait for the version it commits to be synced."""
    before = world.a.folder("Notes")["version"]
    change()
    doc = wait_until(lambda: (f := world.a.settled("Notes")) and f["version"] > before and f,
                     f"A to commit and push {what}")
    return int(doc["version"])


def test_a_file_deleted_three_versions_ago_is_restored_from_the_history_view(
        world: World, browser: WebDriver, downloads: Path) -> None:
    a = world.root("A", "Notes")
    data = random.Random(2).randbytes(7000) + b"\x00\xff end"
    had_it = _commit(world, lambda: (a / "budget.xlsx").write_bytes(data), "budget.xlsx")
    _commit(world, lambda: (a / "budget.xlsx").unlink(), "the deletion of budget.xlsx")
    _commit(world, lambda: (a / "todo.txt").write_text("call Bob\n"), "todo.txt")
    latest = _commit(world, lambda: (a / "todo.txt").write_text("call Bob, then Eve\n"),
                     "a change to todo.txt")
    assert latest - had_it == 3

    open_folder(browser, world, "Notes", "history")
    until(browser, lambda d: css(d, "#history-version")[0].get_attribute("value") == str(latest),
          "the history view to open at the latest version")
    assert not css(browser, "#history-tree tr[data-path='budget.xlsx']")
    for _ in range(3):  # three versions back, as a user would step
        shown = int(css(browser, "#history-version")[0].get_attribute("value"))
        css(browser, "#history-older")[0].click()
        until(browser, lambda d, v=shown - 1: css(d, "#history-version")[0]
              .get_attribute("value") == str(v), "the previous version")
    row = "#history-tree tr[data-path='budget.xlsx']"
    until(browser, lambda d: css(d, row), f"budget.xlsx in version {had_it}'s tree")
    assert attrs(browser, row + " [data-role='gone']", "data-role") == ["gone"]
    assert not css(browser, "#history-tree tr[data-path='notes.txt'] [data-role='gone']")
    shot(browser, "history")
    # Downloading that version's file gives its bytes...
    click(browser, row + " a.download", "Download")
    wait_until(lambda: any(p.read_bytes() == data for p in downloads.iterdir()
                           if not p.name.endswith(".crdownload")),
               "the downloaded budget.xlsx of that version")
    # ... and restoring it puts them back here and, synced, on service B.
    click(browser, row + " button.restore", "Restore")
    until(browser, lambda d: css(d, "#history-status:not([hidden])"), "the page to say restored")
    assert "budget.xlsx" in css(browser, "#history-status")[0].text
    wait_until(lambda: (a / "budget.xlsx").read_bytes() == data, "budget.xlsx restored on A")
    wait_until(lambda: (world.root("B", "Notes") / "budget.xlsx").read_bytes() == data,
               "the restored budget.xlsx to reach B")


def _conflict_row(driver: WebDriver, path: str) -> WebElement | None:
    rows = css(driver, f"#conflicts > li[data-path='{path}']")
    return rows[0] if rows else None


def _compared(path: str) -> Callable[[WebDriver], list[str] | None]:
    """A wait for the page's side-by-side view of conflict ``path``, asking for it
    (again, if a redraw closed it) until it shows."""
    row = f"#conflicts > li[data-path='{path}']"

    def shown(d: WebDriver) -> list[str] | None:
        texts = [e.text for e in css(d, row + " .compare pre")]
        if len(texts) == 2:
            return texts
        css(d, row + " button.compare-button")[0].click()
        return None

    return shown


def test_a_conflict_is_listed_opened_and_resolved_so_both_services_converge(
        world: World, browser: WebDriver, downloads: Path) -> None:
    """Both services paused, notes.txt and plan.txt changed on each, B resumed (its
    versions win the names), then A: two conflicts. Both versions open from the page;
    "keep both" on one and "keep mine" on the other resolve them, and A and B end with
    the same files."""
    a, b = world.root("A", "Notes"), world.root("B", "Notes")
    wait_until(lambda: snapshot(a) == snapshot(b), "A and B to agree before the conflict")
    open_folder(browser, world, "Notes", "conflicts")
    css(browser, "#action-pause")[0].click()
    until(browser, lambda d: css(d, "#folder-state[data-state='paused']"), "A paused by the page")
    world.b.rest("POST", f"/rest/folders/{world.b.ids['Notes']}/pause")
    wait_until(lambda: world.b.folder("Notes")["state"] == "paused", "B paused")
    mine = {"notes.txt": b"shopping: milk, eggs (laptop)\n", "plan.txt": b"plan: hike (laptop)\n"}
    theirs = {"notes.txt": b"shopping: milk, tea (desktop)\n", "plan.txt": b"plan: read (desktop)\n"}
    for name in mine:
        (a / name).write_bytes(mine[name])
        (b / name).write_bytes(theirs[name])
    world.b.rest("POST", f"/rest/folders/{world.b.ids['Notes']}/resume")
    wait_until(lambda: world.b.settled("Notes"), "B to push its versions")
    css(browser, "#action-resume")[0].click()
    until(browser, lambda d: _conflict_row(d, "notes.txt") and _conflict_row(d, "plan.txt"),
          "both conflicts listed on A's page")
    # Once A's sync has committed the copies, the list stays as it is.
    wait_until(lambda: world.a.settled("Notes"), "A to sync the conflict copies")
    until(browser, lambda d: css(d, "#conflict-count")[0].text == "2", "two conflicts counted")

    # Both versions open (download) from the page, with the bytes each side wrote.
    for link in ("a.open-mine", "a.open-theirs"):
        click(browser, f"#conflicts > li[data-path='notes.txt'] {link}", link)
    wait_until(lambda: {mine["notes.txt"], theirs["notes.txt"]} <= {
        p.read_bytes() for p in downloads.iterdir() if not p.name.endswith(".crdownload")},
        "both versions of notes.txt downloaded")
    texts = until(browser, _compared("notes.txt"), "the two versions side by side")
    assert texts == [mine["notes.txt"].decode().strip(), theirs["notes.txt"].decode().strip()]
    shot(browser, "conflicts")

    click(browser, "#conflicts > li[data-path='notes.txt'] button[data-keep='both']", "keep both")
    until(browser, lambda d: _conflict_row(d, "notes.txt") is None, "notes.txt resolved")
    click(browser, "#conflicts > li[data-path='plan.txt'] button[data-keep='mine']", "keep mine")
    until(browser, lambda d: css(d, "#conflicts-empty:not([hidden])"), "no conflicts left")
    until(browser, lambda d: not css(d, "#folders [data-role='conflicts']"),
          "the folder list to show no conflict")
    assert css(browser, f"#events li[data-kind='conflict'][data-folder='{world.a.ids['Notes']}']"), \
        "no conflict notification"

    wait_until(lambda: world.a.settled("Notes") and world.b.settled("Notes")
               and snapshot(a) == snapshot(b), "A and B to converge after the resolutions")
    on_a = files(a)
    assert on_a["plan.txt"] == mine["plan.txt"]
    assert theirs["plan.txt"] not in on_a.values(), "keep mine left their plan.txt"
    assert {mine["notes.txt"], theirs["notes.txt"]} <= set(on_a.values()), "keep both lost one"
    assert not world.a.rest("GET", f"/rest/folders/{world.a.ids['Notes']}/conflicts")
    assert not world.b.rest("GET", f"/rest/folders/{world.b.ids['Notes']}/conflicts")


def test_a_guard_paused_folder_shows_what_it_would_delete_and_resume_syncs_it(
        world: World, browser: WebDriver) -> None:
    a, b = world.root("A", "Photos"), world.root("B", "Photos")
    open_folder(browser, world, "Photos", "overview")
    fid_a = world.a.ids["Photos"]
    doomed = sorted(GUARDED)[:20]
    for name in doomed:
        (a / name).unlink()
    until(browser, lambda d: css(d, "#folder-state[data-state='paused']")
          and len(css(d, "#would-delete-list li[data-path]")) == 20,
          "A's Photos paused, listing what it would delete")
    assert sorted(attrs(browser, "#would-delete-list li[data-path]", "data-path")) == doomed
    assert "20" in css(browser, "#action-resume")[0].text
    until(browser, lambda d: css(d, f"#events li[data-kind='paused'][data-folder='{fid_a}']"),
          "a notification that Photos paused")
    shot(browser, "guard")
    assert set(files(b)) == set(GUARDED), "B lost files while A was paused"

    css(browser, "#action-resume")[0].click()
    until(browser, lambda d: css(d, "#folder-state[data-state='idle']")
          and not css(d, "#would-delete:not([hidden])"), "A's Photos to sync after resume")
    # B's guard holds the remote deletion in turn (it works both ways): resumed too.
    fid = world.b.ids["Photos"]
    held = wait_until(lambda: (f := world.b.folder("Photos"))["state"] == "paused" and f,
                      "B's Photos to pause on the remote deletion")
    assert sorted(held["would_delete"]) == doomed
    world.b.rest("POST", f"/rest/folders/{fid}/resume")
    wait_until(lambda: set(files(b)) == set(GUARDED) - set(doomed),
               "B to lose exactly the deleted files after resume")
    wait_until(lambda: snapshot(a) == snapshot(b), "A and B to agree")


def test_an_unreachable_backend_turns_red_and_back(world: World, browser: WebDriver) -> None:
    store = world.backends["Photos"][1]
    open_folder(browser, world, "Photos", "overview")
    row = f"#backends tr[data-backend$='{store.name}']"
    until(browser, lambda d: css(d, row + "[data-health='ok']"), "the backend green first")
    away = store.with_name(store.name + "-unplugged")
    store.rename(away)
    try:
        until(browser, lambda d: css(d, row + "[data-health='failing'] .dot.bad"),
              "the unplugged backend to turn red")
        # Its bar in the chart turns red too.
        assert css(browser, f"#backend-chart g.bad[data-backend$='{store.name}']")
        until(browser, lambda d: css(d, "#events li[data-kind='backend-failing']"),
              "a notification that the backend fails")
        shot(browser, "backend-down")
    finally:
        away.rename(store)
    until(browser, lambda d: css(d, row + "[data-health='ok']"), "the backend green again")
    assert not css(browser, "#backend-chart g.bad")
    until(browser, lambda d: css(d, "#events li[data-kind='backend-ok']"),
          "a notification that the backend is back")


def test_a_folder_added_from_the_page_starts_syncing(world: World, browser: WebDriver) -> None:
    """A path that is not a metasync folder is refused with the reason; a metasync
    folder's path registers it, and the page shows it syncing."""
    open_folder(browser, world, "Notes", "overview")
    field_, submit = css(browser, "#add-folder-path")[0], css(browser, "#add-folder-submit")[0]
    field_.send_keys(str(world.tmp))
    submit.click()
    error = until(browser, lambda d: css(d, "#add-folder-error:not([hidden])"),
                  "the page to say why the path was refused")[0]
    assert "metasync" in error.text
    assert len(css(browser, "#folders li[data-folder-id]")) == 2

    music = world.tmp / "laptop" / "Music"
    music.mkdir()
    (music / "song.txt").write_text("la la la\n")
    with Repository.init(music, [f"dir:{world.tmp / 'music-store'}"], replicas=1,
                         encrypt=False, mkdir=True) as repo:
        repo.push("start")
    field_.clear()
    field_.send_keys(str(music))
    submit.click()
    until(browser, lambda d: css(d, "#folder-label")[0].text == "Music"
          and css(d, "#folder-state[data-state='idle']") and css(d, "#add-folder-error[hidden]"),
          "the added folder shown, synced")
    assert len(css(browser, "#folders li[data-folder-id]")) == 3
    assert str(music) in world.a.cli("folders")
