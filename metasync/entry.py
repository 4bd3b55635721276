"""The ``metasync`` console script: answers ``metasync status`` from the daemon
watching the folder before loading the rest of the CLI (docs/daemon.md, "status
from the watch"), else a no-change ``status --offline`` from the index
(:mod:`metasync.quickstatus`); every other command, and ``status`` when neither
answers, goes to :func:`metasync.cli.main`.

Only ``status`` with the options below is tried here (global ones before it too);
anything else (``--timeout``, ``--scan``, ``--help``, a typo) is the CLI's to
parse. This module imports nothing heavy: that is its point.
"""

from __future__ import annotations

import os
import sys

#: The options the fast path understands, and what each sets.
_OPTIONS = {"--json": "json", "-q": "quiet", "--quiet": "quiet", "--debug": "debug"}
#: Variables the CLI checks before ``status`` runs (a bad value is an error): the
#: quick path runs only while they are not set.
CHECKED_ENV = ("METASYNC_BWLIMIT", "METASYNC_TIMEOUT")
#: Options of the ``status`` command itself (not the group's).
_STATUS_OPTIONS = {"--offline": "offline"}


def fast_status_flags(argv: list[str]) -> set[str] | None:
    """The flags of ``metasync status`` given as ``argv`` (without the program) if
    the fast path can take it, else None."""
    if "status" not in argv:
        return None
    at = argv.index("status")
    flags = set()
    for i, arg in enumerate(argv):
        if i == at:
            continue
        flag = _OPTIONS.get(arg) or (_STATUS_OPTIONS.get(arg) if i > at else None)
        if flag is None:
            return None
        flags.add(flag)
    return flags


def derive_init_key_ahead(argv: list[str]) -> None:
    """For ``metasync init`` with the passphrase in the environment (scripts, the
    bench): start deriving the new key slot's key (scrypt, ~0.35 s on a core of its
    own) before the CLI loads, ~0.2 s of imports (:func:`metasync.keys.derive_ahead`;
    used only if that is the passphrase and cost the slot is written with)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    passphrase = os.environ.get("METASYNC_PASSPHRASE")
    if command == "init" and passphrase and "--no-encrypt" not in argv:
        from metasync import keys

        keys.derive_ahead(passphrase)


#: Where a ``dir:`` backend keeps its key slot files: ``<path>/<default namespace>/keys``
#: (:class:`metasync.backends.local.LocalBackend`, :data:`metasync.layout.KEYS_PREFIX`;
#: a test keeps the three in step).
CLONE_KEYS_FOLDER = ("metasync", "keys")


def derive_clone_key_ahead(argv: list[str]) -> None:
    """For ``metasync clone dir:/path [DIR]`` with the passphrase in the environment:
    read the folder's key slot and start its scrypt (~0.4 s, on a core of its own)
    before the CLI loads (~0.2 s of imports): :func:`metasync.keyslots.derive_ahead_in`.
    Any other option (``--namespace``, ``--passphrase-file``...) leaves it to the CLI."""
    passphrase = os.environ.get("METASYNC_PASSPHRASE")
    args = [arg for arg in argv if arg not in _OPTIONS]  # output flags: no bearing here
    if (not passphrase or len(args) not in (2, 3) or args[0] != "clone"
            or any(arg.startswith("-") for arg in args)):
        return
    path = args[1].removeprefix("dir:")
    if os.path.isabs(path):
        from metasync import keyslots

        keyslots.derive_ahead_in(os.path.join(path, *CLONE_KEYS_FOLDER), passphrase)


def main() -> None:
    """Console-script entry point."""
    derive_init_key_ahead(sys.argv[1:])
    derive_clone_key_ahead(sys.argv[1:])
    flags = fast_status_flags(sys.argv[1:])
    if flags is not None and sys.stdout is not None and sys.stderr is not None:
        from metasync import watch_client

        answer = watch_client.ask(os.getcwd(), "offline" in flags)
        if answer is not None and "debug" in flags:
            sys.stderr.write(f"metasync: status answered by the daemon ({answer['how']})\n")
        if (answer is None and "offline" in flags and "debug" not in flags
                and not any(os.environ.get(name) for name in CHECKED_ENV)):
            from metasync import quickstatus

            answer = quickstatus.answer(os.getcwd())
        if answer is not None:
            try:
                watch_client.emit(answer, "json" in flags, "quiet" in flags)
                sys.stdout.flush()
                sys.stderr.flush()
            except OSError as exc:  # as the CLI says it (a closed pipe)
                sys.stderr.write(f"metasync: error: {exc.strerror or exc}; run with --debug "
                                 "for details\n")
                sys.exit(2)
            # All is said and flushed: no interpreter teardown (freeing the walk's
            # lists, every module), ~5 ms of a ~70 ms answer. Nothing registered
            # an exit handler on this path.
            os._exit(0)
    from metasync.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
