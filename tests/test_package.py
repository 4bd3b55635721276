"""The installable package (issue 18): ``python -m build`` makes an sdist and a wheel
that pass ``twine check``; ``pipx install`` of the wheel into a fresh virtualenv gives a
``metasync`` that works on its own (init, push, clone on ``dir:`` folders); shell
completion for bash, zsh and fish; ``--version`` names the repository format too.

Offline, as CI is once set up: every package the build and the fresh virtualenv need
comes from the wheelhouse ``bin/setup-venv`` fills (``.venv/wheelhouse``), with pip's
index and configuration turned off. So a dependency ``pyproject.toml`` forgets to
declare is missing there, and the installed command fails to import it: the fresh
virtualenv sees neither ``.venv`` nor the system's site-packages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

import metasync
from conftest import METASYNC, PASSPHRASE, backend_dirs, make_tree, run_cli, snapshot
from metasync.objects import FORMAT_VERSION

ROOT = Path(__file__).resolve().parent.parent
#: Filled by bin/setup-venv next to the interpreter running the tests.
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
#: pipx's shared libraries (its pip), kept between runs while the wheelhouse is.
PIPX_SHARED = Path(sys.prefix) / "pipx-shared"
#: What the README tells a user to run, and what this module runs.
README_PIPX_LINE = "pipx install dist/metasync-*.whl"
#: Left out of the copy the package is built from: caches, builds, virtualenvs, and
#: the benchmarks' scratch folder.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
)


def _not_source(folder: str, names: list[str]) -> set[str]:
    """What :func:`shutil.copytree` leaves out of ``folder``."""
    skip = set(_NOT_SOURCE(folder, names))
    if Path(folder) == ROOT / "bench":
        skip.add("work")
    return skip


def _offline_env(**extra: str) -> dict[str, str]:
    """This environment with pip pointed at the wheelhouse only: no index, no pip
    configuration file (whose extra indexes or find-links would hide a gap)."""
    if not any(WHEELHOUSE.glob("pip-*.whl")):
        pytest.fail(f"no offline wheelhouse at {WHEELHOUSE}: run bin/setup-venv (it fills it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PIPX_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE),
               PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _run(args: list[str], what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure, fail naming ``what`` with its output."""
    proc = subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=600, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}): {' '.join(map(str, args))}\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build`` (the sdist, then the wheel built from the sdist) of a clean
    copy of the source tree: building in the tree itself would leave build/ and
    *.egg-info there, and a stale build/lib can slip deleted modules into a wheel."""
    work = tmp_path_factory.mktemp("build")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=_not_source, symlinks=True)
    _run([sys.executable, "-m", "build", "--outdir", str(work / "dist"), str(src)],
         "python -m build", env=_offline_env())
    return work / "dist"


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}: {found}"
    return found[0]


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the ``metasync`` that ``pipx install`` of the wheel made, in
    a virtualenv of its own: the README's line, run in the folder holding dist/."""
    home = tmp_path_factory.mktemp("pipx")
    # pipx's own virtualenv holding pip, kept between runs (bin/setup-venv drops it
    # with the wheelhouse it came from): the rest is made anew each run.
    env = _offline_env(PIPX_HOME=str(home / "home"), PIPX_BIN_DIR=str(home / "bin"),
                       PIPX_MAN_DIR=str(home / "man"), PIPX_SHARED_LIBS=str(PIPX_SHARED),
                       PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    _only(dist, "metasync-*.whl")
    _run(["bash", "-c", README_PIPX_LINE], f"{README_PIPX_LINE} (offline, from {WHEELHOUSE})",
         env=env, cwd=dist.parent)
    command = home / "bin" / "metasync"
    assert command.exists(), f"pipx install made no {command}"
    return command.parent


def test_build_makes_an_sdist_and_a_wheel_that_pass_twine_check(dist: Path) -> None:
    wheel, sdist = _only(dist, "metasync-*.whl"), _only(dist, "metasync-*.tar.gz")
    proc = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
                "twine check")
    assert proc.stdout.count("PASSED") == 2, proc.stdout
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"metasync-{metasync.__version__}.dist-info/METADATA").decode()
    for field in ("Requires-Python: >=3.11", "License-Expression: MIT",
                  "Description-Content-Type: text/markdown", "Classifier: ",
                  "License-File: LICENSE"):
        assert field in metadata, f"the wheel's METADATA lacks {field!r}"


def test_the_wheel_holds_every_module_and_nothing_else(dist: Path) -> None:
    """Every module of metasync/, backends/ and translators/ (as metasync.backends and
    metasync.translators), py.typed, the web page's files and the licence; no tests,
    benchmarks or scripts."""
    with zipfile.ZipFile(_only(dist, "metasync-*.whl")) as zf:
        names = set(zf.namelist())
    # The service's web page ships as package data beside its modules.
    expected = {"metasync/py.typed"} | {
        f"metasync/app/static/{p.name}" for p in (ROOT / "metasync" / "app" / "static").iterdir()
        if p.is_file()}
    for folder, package in (("metasync", "metasync"), ("backends", "metasync/backends"),
                            ("translators", "metasync/translators")):
        expected |= {f"{package}/{p.relative_to(ROOT / folder).as_posix()}"
                     for p in (ROOT / folder).rglob("*.py")}
    code = {n for n in names if ".dist-info/" not in n}
    assert not expected - code, f"missing from the wheel: {sorted(expected - code)}"
    assert not code - expected, f"unexpected in the wheel: {sorted(code - expected)}"
    assert f"metasync-{metasync.__version__}.dist-info/licenses/LICENSE" in names
    with tarfile.open(_only(dist, "metasync-*.tar.gz")) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for needed in ("LICENSE", "README.md", "pyproject.toml", "metasync/py.typed",
                   "backends/base.py", "translators/encrypt.py"):
        assert needed in members, f"the sdist lacks {needed}"
    assert not {m for m in members if m.startswith(("bench/", "bin/", ".ci/"))}


#: The backend conformance suite ships in the package for backend authors, and is run
#: with pytest (the ``test`` extra): the one module a plain install cannot import.
_NEEDS_PYTEST = "metasync.backends.conformance"


def test_pipx_install_of_the_wheel_gives_a_working_metasync(installed: Path,
                                                            tmp_path: Path) -> None:
    """The installed command on its own: --version, every module importable (a
    backend's undeclared dependency shows here), and a repository over two ``dir:``
    folders made, pushed and cloned back identical."""
    command = str(installed / "metasync")
    # Nothing of the source tree or .venv on the path: -I (no cwd, no PYTHONPATH) below.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["METASYNC_PASSPHRASE"] = PASSPHRASE
    version = _run([command, "--version"], "metasync --version", env=env, cwd=tmp_path).stdout
    assert f"metasync {metasync.__version__}" in version and \
        f"format {FORMAT_VERSION}" in version, version
    python = Path(os.path.realpath(installed / "metasync")).parent / "python"
    _run([str(python), "-I", "-c", "import importlib, pkgutil, sys, metasync\n"
          "for m in pkgutil.walk_packages(metasync.__path__, 'metasync.'):\n"
          f"    if m.name != {_NEEDS_PYTEST!r} and not m.name.endswith('.__main__'):\n"
          "        importlib.import_module(m.name)\n"
          "assert metasync.__file__.startswith(sys.prefix), metasync.__file__"],
         "importing every module of the installed package", env=env, cwd=tmp_path)
    dirs = backend_dirs(tmp_path, "usb", "nas")
    make_tree(tmp_path / "laptop", small_files=20)
    _run([command, "init", str(tmp_path / "laptop"), "--backend", f"dir:{dirs['usb']}",
          "--backend", f"dir:{dirs['nas']}"], "installed metasync init", env=env)
    _run([command, "push", "-m", "first"], "installed metasync push", env=env,
         cwd=tmp_path / "laptop")
    _run([command, "clone", f"dir:{dirs['nas']}", str(tmp_path / "desktop")],
         "installed metasync clone", env=env)
    assert snapshot(tmp_path / "desktop") == snapshot(tmp_path / "laptop")
    script = _run([command, "completion", "bash"], "installed metasync completion",
                  env=env).stdout
    assert "_metasync_completion" in script


def test_version_names_the_package_and_the_format_version() -> None:
    out = run_cli("--version", passphrase=None).stdout
    assert re.fullmatch(
        rf"metasync {re.escape(metasync.__version__)} \(repository format "
        rf"{FORMAT_VERSION}; reads formats [0-9, ]+\)\n", out), out


#: A line each shell's script must hold: where it hooks the function into the shell.
_HOOK = {"bash": "complete -o nosort -F _metasync_completion metasync",
         "zsh": "compdef _metasync_completion metasync",
         "fish": "complete --no-files --command metasync"}


@pytest.mark.parametrize("shell", sorted(_HOOK))
def test_completion_prints_each_shells_script(shell: str) -> None:
    """``metasync completion SHELL`` prints what click's own variable does."""
    script = run_cli("completion", shell, passphrase=None).stdout
    assert _HOOK[shell] in script, script
    by_variable = run_cli(passphrase=None, env_extra={
        "_METASYNC_COMPLETE": f"{shell}_source"}).stdout
    assert script == by_variable


def test_completion_of_an_unknown_shell_is_one_line() -> None:
    proc = run_cli("completion", "tcsh", passphrase=None, check=False)
    assert proc.returncode == 2 and "bash" in proc.stderr and "Traceback" not in proc.stderr


def test_bash_completes_a_subcommand_prefix(tmp_path: Path) -> None:
    """The script, sourced in a real bash, completes ``metasync pu`` to pull and push and
    ``metasync backend a`` to add, through click's protocol (COMP_WORDS, COMP_CWORD)."""
    script = tmp_path / "metasync.bash"
    script.write_text(run_cli("completion", "bash", passphrase=None).stdout)
    probe = (f"source {script}\n"
             "complete_words() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1));"
             " COMPREPLY=(); _metasync_completion metasync; echo \"${COMPREPLY[*]}\"; }\n"
             "complete_words metasync pu\ncomplete_words metasync backend a\n"
             "complete_words metasync completion ''\n")
    env = {**os.environ, "PATH": f"{Path(METASYNC).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 0, proc.stderr
    words = [sorted(line.split()) for line in proc.stdout.splitlines()]
    assert words == [["pull", "push"], ["add"], ["bash", "fish", "zsh"]], proc.stdout
    raw = run_cli(passphrase=None, env_extra={"_METASYNC_COMPLETE": "bash_complete",
                                              "COMP_WORDS": "metasync pu", "COMP_CWORD": "1"})
    assert raw.stdout.split() == ["plain,pull", "plain,push"]


def test_readme_gives_the_install_and_completion_lines() -> None:
    readme = (ROOT / "README.md").read_text()
    for line in (README_PIPX_LINE, "python -m build", "pip install ",
                 "metasync completion bash", "metasync completion zsh",
                 "metasync completion fish"):
        assert line in readme, f"README.md lacks {line!r}"
