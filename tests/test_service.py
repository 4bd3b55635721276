"""The daemon's service files for each OS (metasync.service), tested here on any OS:
the systemd unit parses and runs the daemon in the folder; the launchd plist
parses with plistlib and has the program, restart-on-failure, run-at-load and log
paths; the Task Scheduler XML parses and has a logon trigger and the command.
(Installing for real is exercised for systemd only: tests/test_daemon_safety.py.)"""

from __future__ import annotations

import configparser
import plistlib
import shlex
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath, PureWindowsPath

from click.testing import CliRunner

from metasync.cli_daemon import service_install
from metasync.service import (
    APP_LABEL,
    TASK_NS,
    AppService,
    Service,
    app_launchd_plist,
    app_service_for,
    app_systemd_unit,
    app_task_xml,
    daemon_command,
    launchd_plist,
    service_name,
    systemd_unit,
    task_xml,
)

MAC_ROOT = PurePosixPath("/Users/ana/My Sync 100%")
MAC_COMMAND = ("/Users/ana/.local/pipx/venvs/metasync/bin/metasync", "daemon")
WIN_ROOT = PureWindowsPath(r"C:\Users\ana\My Sync")
WIN_COMMAND = (r"C:\Users\ana\pipx\venvs\metasync\Scripts\pythonw.exe", "-m", "metasync.cli",
               "daemon")


def _svc(root: PurePosixPath | PureWindowsPath, command: tuple[str, ...]) -> Service:
    return Service(root, command, service_name(root))


def test_service_name_is_one_per_folder() -> None:
    assert service_name(MAC_ROOT) == service_name(PurePosixPath(str(MAC_ROOT)))
    assert service_name(MAC_ROOT) != service_name(MAC_ROOT / "other")
    assert service_name(MAC_ROOT).startswith("metasync-")


def test_systemd_unit_runs_the_daemon_in_the_folder() -> None:
    """Quoting survives a blank and a ``%`` (a systemd specifier) in the path."""
    svc = _svc(MAC_ROOT, ("/opt/my tools/bin/metasync", "daemon"))
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(systemd_unit(svc))
    service = parser["Service"]
    assert service["WorkingDirectory"] == "/Users/ana/My Sync 100%%"
    assert shlex.split(service["ExecStart"]) == ["/opt/my tools/bin/metasync", "daemon"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert parser["Install"]["WantedBy"] == "default.target"


def test_launchd_plist() -> None:
    svc = _svc(MAC_ROOT, MAC_COMMAND)
    doc = plistlib.loads(launchd_plist(svc))
    assert doc["Label"] == svc.label and svc.label.startswith("org.metasync.")
    assert doc["ProgramArguments"] == list(MAC_COMMAND)
    assert doc["WorkingDirectory"] == str(MAC_ROOT)
    assert doc["RunAtLoad"] is True
    # Restarted when it fails, not after `daemon stop` (exit 0).
    assert doc["KeepAlive"] == {"SuccessfulExit": False}
    log = "/Users/ana/My Sync 100%/.metasync/daemon.log"
    assert doc["StandardOutPath"] == log
    assert doc["StandardErrorPath"] == log


def _find(node: ET.Element, path: str) -> ET.Element:
    found = node.find(path, {"t": TASK_NS})
    assert found is not None, path
    return found


def test_task_xml_has_a_logon_trigger_and_the_command() -> None:
    svc = _svc(WIN_ROOT, WIN_COMMAND)
    data = task_xml(svc, r"LAPTOP\ana")
    assert data.startswith(b"\xff\xfe"), "schtasks reads UTF-16 with a byte-order mark"
    task = ET.fromstring(data)
    assert task.tag == f"{{{TASK_NS}}}Task"
    trigger = _find(task, "t:Triggers/t:LogonTrigger")
    assert _find(trigger, "t:UserId").text == r"LAPTOP\ana"
    assert _find(task, "t:Principals/t:Principal/t:UserId").text == r"LAPTOP\ana"
    assert _find(task, "t:Principals/t:Principal/t:RunLevel").text == "LeastPrivilege"
    run = _find(task, "t:Actions/t:Exec")
    assert _find(run, "t:Command").text == WIN_COMMAND[0]
    assert _find(run, "t:Arguments").text == "-m metasync.cli daemon"
    assert _find(run, "t:WorkingDirectory").text == str(WIN_ROOT)
    assert _find(task, "t:Settings/t:ExecutionTimeLimit").text == "PT0S"
    assert _find(task, "t:Settings/t:MultipleInstancesPolicy").text == "IgnoreNew"
    assert _find(task, "t:Settings/t:RestartOnFailure/t:Count").text == "999"
    assert _find(task, "t:RegistrationInfo/t:URI").text == "\\" + svc.name


def test_task_xml_quotes_arguments_with_blanks() -> None:
    command = (r"C:\Program Files\Python\pythonw.exe", "-m", "metasync.cli", "daemon", "a b")
    task = ET.fromstring(task_xml(_svc(WIN_ROOT, command), "ana"))
    arguments = _find(task, "t:Actions/t:Exec/t:Arguments").text
    assert arguments == '-m metasync.cli daemon "a b"'
    assert arguments == subprocess.list2cmdline(command[1:])


def test_daemon_command_per_platform(tmp_path: Path) -> None:
    """Windows: the windowless pythonw.exe beside the interpreter; elsewhere the
    ``metasync`` script beside it; without either, the interpreter runs the module."""
    python = tmp_path / "python"
    python.touch()
    assert daemon_command(str(python), "darwin") == (str(python), "-m", "metasync.cli", "daemon")
    (tmp_path / "metasync").touch()
    assert daemon_command(str(python), "linux") == (str(tmp_path / "metasync"), "daemon")
    python_exe = tmp_path / "python.exe"
    assert daemon_command(str(python_exe), "win32") == (str(python_exe), "-m", "metasync.cli",
                                                        "daemon")
    (tmp_path / "pythonw.exe").touch()
    assert daemon_command(str(python_exe), "win32") == (str(tmp_path / "pythonw.exe"), "-m",
                                                        "metasync.cli", "daemon")


# ============================================ the user's one service (metasync service)
APP_COMMAND = ("/opt/my tools/bin/metasync", "service")


def _unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def test_app_systemd_unit_runs_the_service_for_every_folder() -> None:
    """ExecStart runs `metasync service` and nothing else (no folder), restarted when
    it fails, in the home folder; no Environment line without a custom config folder."""
    text = app_systemd_unit(AppService(APP_COMMAND))
    service = _unit(text)["Service"]
    assert shlex.split(service["ExecStart"]) == list(APP_COMMAND)
    assert service["Restart"] == "on-failure" and service["RestartSec"] == "10"
    assert service["KillSignal"] == "SIGTERM"
    assert service["WorkingDirectory"] == "~"
    assert "Environment" not in text and "/Users/" not in text and "Sync" not in text
    assert _unit(text)["Install"]["WantedBy"] == "default.target"


def test_app_units_carry_the_config_folder() -> None:
    """A config folder the installing command has (METASYNC_CONFIG_DIR,
    XDG_CONFIG_HOME) is the service's too: in the unit's Environment (quoted, `%`
    doubled) and the plist's EnvironmentVariables; a relative one is refused."""
    env = {"XDG_CONFIG_HOME": "/home/ana/my conf%", "METASYNC_CONFIG_DIR": "/srv/ms",
           "HOME": "/home/ana"}
    app = app_service_for(env)
    assert app.env == (("METASYNC_CONFIG_DIR", "/srv/ms"), ("XDG_CONFIG_HOME", "/home/ana/my conf%"))
    lines = [line for line in app_systemd_unit(app).splitlines() if line.startswith("Environment=")]
    assert [shlex.split(line.split("=", 1)[1]) for line in lines] == [
        ["METASYNC_CONFIG_DIR=/srv/ms"], ["XDG_CONFIG_HOME=/home/ana/my conf%%"]]
    plist = plistlib.loads(app_launchd_plist(app))
    assert plist["EnvironmentVariables"] == {"METASYNC_CONFIG_DIR": "/srv/ms",
                                             "XDG_CONFIG_HOME": "/home/ana/my conf%"}
    assert app_service_for({"HOME": "/home/ana"}).env == ()
    try:
        app_service_for({"XDG_CONFIG_HOME": "conf"})
    except Exception as exc:  # UsageError: one line naming the variable and the fix
        assert "XDG_CONFIG_HOME=conf is not an absolute path" in str(exc)
    else:
        raise AssertionError("a relative config folder was accepted")


def test_app_launchd_plist() -> None:
    app = AppService(APP_COMMAND, (), "/Users/ana/Library/Logs/metasync/service.log")
    doc = plistlib.loads(app_launchd_plist(app))
    assert doc["Label"] == APP_LABEL
    assert doc["ProgramArguments"] == list(APP_COMMAND)
    assert doc["RunAtLoad"] is True and doc["KeepAlive"] == {"SuccessfulExit": False}
    assert "WorkingDirectory" not in doc and "EnvironmentVariables" not in doc
    assert doc["StandardOutPath"] == doc["StandardErrorPath"] == app.log


def test_app_task_xml() -> None:
    app = AppService((WIN_COMMAND[0], "-m", "metasync.cli", "service"))
    task = ET.fromstring(app_task_xml(app, r"LAPTOP\ana"))
    run = _find(task, "t:Actions/t:Exec")
    assert _find(run, "t:Command").text == WIN_COMMAND[0]
    assert _find(run, "t:Arguments").text == "-m metasync.cli service"
    assert run.find("t:WorkingDirectory", {"t": TASK_NS}) is None  # no folder
    assert _find(task, "t:Triggers/t:LogonTrigger/t:UserId").text == r"LAPTOP\ana"
    assert _find(task, "t:Settings/t:RestartOnFailure/t:Count").text == "999"
    assert _find(task, "t:RegistrationInfo/t:URI").text == "\\metasync"


def test_daemon_command_for_the_service(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.touch()
    assert daemon_command(str(python), "linux", "service") == (str(python), "-m", "metasync.cli",
                                                                 "service")
    (tmp_path / "metasync").touch()
    assert daemon_command(str(python), "linux", "service") == (str(tmp_path / "metasync"),
                                                                 "service")


def test_service_install_writes_the_one_unit(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`metasync service install` where systemctl is missing: the unit is written
    (metasync.service, running `metasync service` with this config folder), and one
    line says what to run; a folder daemon's unit beside it is named in a note only
    when systemctl runs (not here)."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    result = CliRunner().invoke(service_install, [])
    assert result.exit_code != 0
    unit = tmp_path / "conf" / "systemd" / "user" / "metasync.service"
    assert "systemctl is not available" in str(result.exception) and str(unit) in str(result.exception)
    service = _unit(unit.read_text())["Service"]
    assert shlex.split(service["ExecStart"])[-1] == "service"
    assert service["Environment"] == f"XDG_CONFIG_HOME={tmp_path / 'conf'}"


def test_service_install_enables_the_unit(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With systemctl (a stand-in script recording its arguments): the unit is
    reloaded and enabled and started (`enable --now metasync.service`), and a folder
    daemon's unit found beside it is named with how to remove it."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    systemctl.chmod(0o755)
    units = tmp_path / "conf" / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "metasync-0123456789ab.service").write_text("[Unit]\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "conf"))
    monkeypatch.setenv("PATH", str(bin_dir))
    result = CliRunner().invoke(service_install, [])
    assert result.exit_code == 0, result.output
    assert calls.read_text().splitlines() == ["--user daemon-reload",
                                              "--user enable --now metasync.service"]
    assert f"installed and started metasync.service ({units / 'metasync.service'})" in result.output
    assert "metasync-0123456789ab.service" in result.output
    assert "systemctl --user disable --now" in result.output
