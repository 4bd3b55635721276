"""What starts metasync at logon, in the service manager of each OS: a systemd
user unit on Linux, a launchd agent on macOS, a Task Scheduler logon task on
Windows. Two kinds: the ONE unit of the user's service (``metasync service``:
every registered folder; :class:`AppService`, :func:`install_app`; docs/app.md,
"Starting at logon"), and the older unit of one folder's daemon (``metasync
daemon`` in that folder; :class:`Service`, :func:`install`; docs/daemon.md).

Each file's content comes from one pure function of a :class:`Service` (folder,
command, name): :func:`systemd_unit`, :func:`launchd_plist`, :func:`task_xml`, so
every OS's file is tested on any OS. :func:`install` writes this OS's file and
hands it to the service manager (``systemctl``, ``launchctl``, ``schtasks``).
All three run the daemon in the folder, restart it when it fails (not when it
stopped cleanly), and let it finish a step when asked to stop. docs/daemon.md
says how each is installed and removed.
"""

from __future__ import annotations

import hashlib
import os
import plistlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath

from metasync.backends.bwlimit import ENV as BWLIMIT_ENV
from metasync.errors import UsageError

#: The daemon's log in ``.metasync`` (metasync.daemon.LOG_FILE); the service
#: managers that capture output send it there too.
LOG_FILE = "daemon.log"
#: Seconds before a failed daemon is started again (systemd RestartSec, launchd
#: ThrottleInterval; Task Scheduler's shortest is one minute).
RESTART_DELAY = 10
#: Seconds a daemon asked to stop has to finish its step before it is killed.
STOP_TIMEOUT = 90
#: The Task Scheduler XML namespace.
TASK_NS = "http://schemas.microsoft.com/windows/2004/02/mit/task"
#: The name of the user's one service: ``metasync.service`` (systemd), the task
#: ``metasync``; launchd's label is :data:`APP_LABEL`.
APP_NAME = "metasync"
APP_LABEL = "org.metasync.service"
#: Where the service's folder registry and settings are (metasync.app.registry,
#: backends.cloud): carried into the service's environment when the installing
#: command has them, so the service reads the same config folder.
CONFIG_ENV = ("METASYNC_CONFIG_DIR", "XDG_CONFIG_HOME")


@dataclass(frozen=True)
class Service:
    """One folder's daemon service. ``root``: the folder (absolute, in the form of
    the OS that runs it); ``command``: the program and its arguments that run the
    daemon there; ``name``: ``metasync-<12 hex digits of the folder's path>``, the
    same for every reinstall of this folder."""

    root: PurePath
    command: tuple[str, ...]
    name: str

    @property
    def log(self) -> str:
        """Where the daemon's output goes: ``<root>/.metasync/daemon.log``."""
        return str(self.root / ".metasync" / LOG_FILE)

    @property
    def label(self) -> str:
        """The launchd label (reverse-DNS, as launchd asks): ``org.metasync.<hex>``."""
        return "org.metasync." + self.name.removeprefix("metasync-")


def service_name(root: PurePath) -> str:
    """``metasync-<hex>``: one name per folder path, so a reinstall replaces it."""
    return f"metasync-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"


def daemon_command(executable: str, platform: str, command: str = "daemon") -> tuple[str, ...]:
    """The command line a service runs for ``metasync COMMAND`` (``daemon``, or
    ``service``), for the interpreter ``executable`` on ``platform`` (a
    ``sys.platform`` value). On Windows the windowless ``pythonw.exe`` beside it (a
    logon task would otherwise open a console window); elsewhere the ``metasync``
    script beside it (what ``pip`` and ``pipx`` install). Without those, the
    interpreter runs the module."""
    exe = Path(executable)
    if platform == "win32":
        windowless = exe.with_name("pythonw.exe")
        program = str(windowless) if windowless.exists() else executable
        return (program, "-m", "metasync.cli", command)
    script = exe.with_name("metasync")
    if script.exists():
        return (str(script), command)
    return (executable, "-m", "metasync.cli", command)


def limit_args(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``--bwlimit RATE`` for a service's command line if the installing command had
    a limit (``--bwlimit`` or :data:`~metasync.backends.bwlimit.ENV`), else nothing:
    on its command line, the limit holds on every OS (a Windows task has no
    environment of its own)."""
    value = (os.environ if environ is None else environ).get(BWLIMIT_ENV, "").strip()
    return ("--bwlimit", value) if value else ()


def service_for(root: Path) -> Service:
    """The service of ``root`` on this computer."""
    root = root.absolute()
    return Service(root, (*daemon_command(sys.executable, sys.platform), *limit_args()),
                   service_name(root))


@dataclass(frozen=True)
class AppService:
    """The user's one service: ``command`` runs ``metasync service`` (no folder: it
    syncs every registered one); ``env``: the variables naming the config folder
    (:data:`CONFIG_ENV`) that the installing command had, for the service to read
    the same registry; ``log``: where launchd sends its output."""

    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    log: str = ""


def app_service_for(environ: dict[str, str] | None = None) -> AppService:
    """The service on this computer, for the environment ``environ`` (default:
    this process's)."""
    environ = dict(os.environ if environ is None else environ)
    env = tuple((name, environ[name]) for name in CONFIG_ENV if environ.get(name))
    for name, value in env:
        if not os.path.isabs(value):
            raise UsageError(f"{name}={value} is not an absolute path; the service would not "
                             "find it from its own folder: set it to an absolute path")
    import platformdirs

    log = platformdirs.user_log_path("metasync", appauthor=False) / "service.log"
    return AppService((*daemon_command(sys.executable, sys.platform, "service"),
                       *limit_args(environ)), env, str(log))


# --- content -------------------------------------------------------------------------


def _systemd_arg(arg: str) -> str:
    """``arg`` as one word of a systemd command line: ``%`` and ``$`` doubled (they
    start specifiers and variables), quoted with C escapes when it has a blank."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_env(assignment: str) -> str:
    """``NAME=value`` as one ``Environment=`` word: ``%`` doubled (a specifier;
    ``$`` is not expanded there), quoted with C escapes when it has a blank."""
    assignment = assignment.replace("%", "%%")
    if not any(c in assignment for c in " \t\"'\\"):
        return assignment
    return '"' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _one_line(what: str, text: str) -> str:
    if "\n" in text or "\r" in text:
        raise UsageError(f"{what} {text!r} has a line break, which a service file cannot "
                         "hold; move the folder to a path without one")
    return text


def systemd_unit(svc: Service) -> str:
    """The systemd user unit (``~/.config/systemd/user/<name>.service``)."""
    root = _one_line("the folder", str(svc.root))
    command = " ".join(_systemd_arg(_one_line("the command", a)) for a in svc.command)
    return (
        "[Unit]\n"
        f"Description=metasync: keep {root.replace('%', '%%')} in sync\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        # WorkingDirectory takes no quotes; specifiers still apply.
        f"WorkingDirectory={root.replace('%', '%%')}\n"
        f"ExecStart={command}\n"
        "Restart=on-failure\n"
        f"RestartSec={RESTART_DELAY}\n"
        "KillSignal=SIGTERM\n"
        f"TimeoutStopSec={STOP_TIMEOUT}\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def app_systemd_unit(app: AppService) -> str:
    """The systemd user unit of the service (``~/.config/systemd/user/metasync.service``):
    no folder in it; it runs in the home folder."""
    command = " ".join(_systemd_arg(_one_line("the command", a)) for a in app.command)
    env = "".join(f"Environment={_systemd_env(_one_line(name, f'{name}={value}'))}\n"
                  for name, value in app.env)
    return (
        "[Unit]\n"
        "Description=metasync: every registered folder in sync (metasync service)\n"
        "After=network-online.target\n\n"
        "[Service]\n"
        "WorkingDirectory=~\n"
        f"{env}"
        f"ExecStart={command}\n"
        "Restart=on-failure\n"
        f"RestartSec={RESTART_DELAY}\n"
        "KillSignal=SIGTERM\n"
        f"TimeoutStopSec={STOP_TIMEOUT}\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def app_launchd_plist(app: AppService) -> bytes:
    """The launchd agent of the service (``~/Library/LaunchAgents/org.metasync.service.plist``):
    started at login, again when it exits with a failure; output to ``app.log``."""
    doc: dict[str, object] = {
        "Label": APP_LABEL,
        "ProgramArguments": list(app.command),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY,
        "ExitTimeOut": STOP_TIMEOUT,
        "ProcessType": "Background",
        "StandardOutPath": app.log,
        "StandardErrorPath": app.log,
    }
    if app.env:
        doc["EnvironmentVariables"] = dict(app.env)
    return plistlib.dumps(doc)


def app_task_xml(app: AppService, user: str) -> bytes:
    """The Task Scheduler task of the service (as :func:`task_xml`, without a
    folder). A task has no environment of its own: the service reads the config
    folder the user's environment names."""
    return _task("metasync: every registered folder in sync (metasync service)",
                 APP_NAME, app.command, None, user)


def launchd_plist(svc: Service) -> bytes:
    """The launchd agent (``~/Library/LaunchAgents/<label>.plist``): started at
    load (login), started again when it exits with a failure, output to the
    daemon's log."""
    return plistlib.dumps({
        "Label": svc.label,
        "ProgramArguments": list(svc.command),
        "WorkingDirectory": str(svc.root),
        "RunAtLoad": True,
        # Like systemd's Restart=on-failure: `daemon stop` (exit 0) stays stopped.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY,
        "ExitTimeOut": STOP_TIMEOUT,
        "ProcessType": "Background",
        "StandardOutPath": svc.log,
        "StandardErrorPath": svc.log,
    })


def task_xml(svc: Service, user: str) -> bytes:
    """The Task Scheduler task (for ``schtasks /Create /XML``), UTF-16 as
    ``schtasks`` reads it: at ``user``'s logon, as that user without elevation, run
    the daemon in the folder; restart it when it fails; no time limit; one
    instance."""
    return _task(f"metasync: keep {svc.root} in sync", svc.name, svc.command, str(svc.root),
                 user)


def _task(description: str, name: str, command: tuple[str, ...], workdir: str | None,
          user: str) -> bytes:
    ET.register_namespace("", TASK_NS)

    def el(parent: ET.Element, tag: str, text: str | None = None) -> ET.Element:
        child = ET.SubElement(parent, f"{{{TASK_NS}}}{tag}")
        if text is not None:
            child.text = text
        return child

    task = ET.Element(f"{{{TASK_NS}}}Task", {"version": "1.2"})
    info = el(task, "RegistrationInfo")
    el(info, "Description", description)
    el(info, "URI", "\\" + name)
    trigger = el(el(task, "Triggers"), "LogonTrigger")
    el(trigger, "Enabled", "true")
    el(trigger, "UserId", user)
    principal = el(el(task, "Principals"), "Principal")
    principal.set("id", "Author")
    el(principal, "UserId", user)
    el(principal, "LogonType", "InteractiveToken")
    el(principal, "RunLevel", "LeastPrivilege")
    settings = el(task, "Settings")
    el(settings, "MultipleInstancesPolicy", "IgnoreNew")
    el(settings, "DisallowStartIfOnBatteries", "false")
    el(settings, "StopIfGoingOnBatteries", "false")
    el(settings, "StartWhenAvailable", "true")
    el(settings, "ExecutionTimeLimit", "PT0S")  # none: the daemon runs until logoff
    restart = el(settings, "RestartOnFailure")
    el(restart, "Interval", "PT1M")
    el(restart, "Count", "999")
    el(settings, "Enabled", "true")
    actions = el(task, "Actions")
    actions.set("Context", "Author")
    run = el(actions, "Exec")
    el(run, "Command", command[0])
    el(run, "Arguments", subprocess.list2cmdline(command[1:]))
    if workdir is not None:
        el(run, "WorkingDirectory", workdir)
    ET.indent(task)
    text = '<?xml version="1.0" encoding="UTF-16"?>\n' + ET.tostring(task, encoding="unicode")
    return text.encode("utf-16")  # with the byte-order mark


# --- install ------------------------------------------------------------------------


def _write(path: Path, content: bytes) -> None:
    """Write ``path`` atomically (a reinstall never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def _run(path: Path, tool: str, args: list[str], hint: str) -> None:
    """Run ``tool args``; a failure is one line naming the file written and ``hint``."""
    found = shutil.which(tool)
    if found is None:
        raise UsageError(f"wrote {path}, but {tool} is not available to load it; run `{hint}` "
                         "where it is")
    proc = subprocess.run([found, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
        raise UsageError(f"wrote {path}, but `{tool} {' '.join(args)}` failed: {why}")


def _install_systemd(svc: Service) -> str:
    return _enable_systemd_unit(_systemd_dir() / f"{svc.name}.service", systemd_unit(svc))


def _enable_systemd_unit(path: Path, unit: str) -> str:
    """Write the user unit ``path`` and enable and start it with systemctl; one line
    saying so (UsageError naming the command to run where that fails)."""
    name = path.name
    _write(path, unit.encode())
    hint = f"systemctl --user enable --now {name}"
    if shutil.which("systemctl") is None:
        raise UsageError(f"wrote {path}, but systemctl is not available to enable it; "
                         f"run `{hint}` where it is")
    _run(path, "systemctl", ["--user", "daemon-reload"], hint)
    _run(path, "systemctl", ["--user", "enable", "--now", name], hint)
    return f"installed and started {name} ({path})"


def _install_launchd(svc: Service, uid: int) -> str:
    path = Path.home() / "Library" / "LaunchAgents" / f"{svc.label}.plist"
    _write(path, launchd_plist(svc))
    domain = f"gui/{uid}"
    launchctl = shutil.which("launchctl")
    if launchctl is not None:
        # A reinstall: unload the old agent first (it is fine if there was none).
        subprocess.run([launchctl, "bootout", f"{domain}/{svc.label}"], capture_output=True)
    _run(path, "launchctl", ["bootstrap", domain, str(path)],
         f"launchctl bootstrap {domain} {path}")
    return f"installed and started {svc.label} ({path})"


def _install_task(svc: Service, user: str) -> str:
    base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    path = base / "metasync" / "tasks" / f"{svc.name}.xml"
    _write(path, task_xml(svc, user))
    _run(path, "schtasks", ["/Create", "/XML", str(path), "/TN", svc.name, "/F"],
         f'schtasks /Create /XML "{path}" /TN {svc.name}')
    _run(path, "schtasks", ["/Run", "/TN", svc.name], f"schtasks /Run /TN {svc.name}")
    return f"installed and started the logon task {svc.name} ({path})"


def install(root: Path) -> str:
    """Install and start the daemon's service for ``root`` in this OS's service
    manager; returns what was done. Raises UsageError (naming the file written and
    the command to finish by hand) when the manager is missing or refuses."""
    svc = service_for(root)
    if sys.platform == "win32":
        user = os.environ.get("USERNAME") or ""
        domain = os.environ.get("USERDOMAIN")
        if not user:
            raise UsageError("USERNAME is not set, so the logon task has no user; set it and retry")
        return _install_task(svc, f"{domain}\\{user}" if domain else user)
    if sys.platform == "darwin":
        return _install_launchd(svc, os.getuid())
    if sys.platform.startswith("linux"):
        return _install_systemd(svc)
    raise UsageError(f"no service manager is known for {sys.platform}; start `metasync daemon` "
                     "in this folder from your system's startup instead")


# --- install: the user's one service ---------------------------------------------------


def _systemd_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"


def _folder_units(unit_dir: Path) -> list[str]:
    """The per-folder daemon units (``metasync-<id>.service``) installed in ``unit_dir``."""
    try:
        return sorted(p.name for p in unit_dir.glob("metasync-*.service"))
    except OSError:
        return []


def install_app(app: AppService | None = None) -> str:
    """Install and start the user's one service (``metasync service``) in this OS's
    service manager; returns what was done, with a note naming per-folder daemon
    units still installed (a folder's daemon and the service cannot both sync it:
    the one that starts second leaves that folder to the first). Raises UsageError
    (naming the file written and the command to finish by hand) when the manager is
    missing or refuses."""
    app = app or app_service_for()
    if sys.platform == "win32":
        user = os.environ.get("USERNAME") or ""
        domain = os.environ.get("USERDOMAIN")
        if not user:
            raise UsageError("USERNAME is not set, so the logon task has no user; set it and retry")
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
        path = base / "metasync" / "tasks" / f"{APP_NAME}.xml"
        _write(path, app_task_xml(app, f"{domain}\\{user}" if domain else user))
        _run(path, "schtasks", ["/Create", "/XML", str(path), "/TN", APP_NAME, "/F"],
             f'schtasks /Create /XML "{path}" /TN {APP_NAME}')
        _run(path, "schtasks", ["/Run", "/TN", APP_NAME], f"schtasks /Run /TN {APP_NAME}")
        return f"installed and started the logon task {APP_NAME} ({path})"
    if sys.platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{APP_LABEL}.plist"
        _write(path, app_launchd_plist(app))
        Path(app.log).parent.mkdir(parents=True, exist_ok=True)
        domain = f"gui/{os.getuid()}"
        launchctl = shutil.which("launchctl")
        if launchctl is not None:  # a reinstall: unload the old agent first
            subprocess.run([launchctl, "bootout", f"{domain}/{APP_LABEL}"], capture_output=True)
        _run(path, "launchctl", ["bootstrap", domain, str(path)],
             f"launchctl bootstrap {domain} {path}")
        return f"installed and started {APP_LABEL} ({path})"
    if not sys.platform.startswith("linux"):
        raise UsageError(f"no service manager is known for {sys.platform}; start `metasync "
                         "service` from your system's startup instead")
    unit_dir = _systemd_dir()
    done = _enable_systemd_unit(unit_dir / f"{APP_NAME}.service", app_systemd_unit(app))
    folders = _folder_units(unit_dir)
    if folders:
        done += (f"\nnote: {len(folders)} folder daemon unit(s) are installed too "
                 f"({', '.join(folders)}); the service runs every folder added with "
                 "`metasync add-folder`: remove each with `systemctl --user disable --now UNIT`")
    return done
