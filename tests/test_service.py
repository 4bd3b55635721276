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

from metasync.service import (
    TASK_NS,
    Service,
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
