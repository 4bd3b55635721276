"""What a backend can do: the :class:`Capabilities` each backend class declares once.

A module of its own so that both the backend interface (:mod:`.base`) and the log
constructions it chooses between (:mod:`.logs`) can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once per backend class.

    The conformance suite skips tests whose capability is missing and records why.
    """

    #: ``put_if_absent`` is atomic (exclusive create) on the service itself.
    conditional_create: bool = False
    #: ``replace_if``: compare-and-swap on an object's poll token (If-Match / revision).
    compare_and_swap: bool = False
    #: ``logs.append_at`` is implemented: an atomic append at an exact log position, so
    #: pPaxos learns the outcome of a write without reading the log back.
    conditional_append: bool = False
    #: ``get_range`` reads part of an object without transferring the rest.
    range_reads: bool = True
    #: Largest object the service accepts, in bytes (``None``: no practical limit).
    max_object_size: int | None = None
    #: Keys differing only in case are distinct objects.
    case_sensitive: bool = True
    #: ``poll`` can block until a change (long-poll) rather than only compare tokens.
    long_poll: bool = False
    #: How :meth:`Backend.change_feed` learns of changes: ``notify``, ``longpoll``,
    #: ``cursor`` or ``poll`` (see :mod:`metasync.backends.feeds`).
    change_feed: str = "poll"
    #: ``share`` gives another user of the service access to the namespace folder.
    sharing: bool = False
    #: ``logs.delete_log`` removes a whole log, so pPaxos log compaction frees its
    #: space (a backend without it keeps its logs; compaction still records the floor).
    log_deletion: bool = True
    #: A writer killed mid-upload leaves a partial upload behind -- a temporary
    #: ``.tmp-*`` file in the namespace, or (``s3:``) an unfinished multipart upload --
    #: and ``sweep_temp_files`` finds and removes them (a backend without it keeps no
    #: partial upload that costs space).
    temp_files: bool = False
    #: ``put`` over an existing key is atomic for readers: they see the old object or
    #: the new one, never none. Some FUSE filesystems (exfat-fuse, fusefat) replace by
    #: removing the old file first, so a read in that moment finds no object; every
    #: reader still sees complete objects only.
    atomic_replace: bool = True
    #: Objects are files on this machine (``dir:``, memory): a read waits on a disk,
    #: not a network, so reading more at once than there are cores only makes the
    #: threads contend (for the interpreter lock); see ``RemoteStore.parallel_reads``.
    local: bool = False


#: The values of the ``logs=`` option of a backend whose logs are exclusive creates
#: (``s3:``, ``sftp:``): ``creates``, the default, or ``registers``.
LOGS_MODES = ("creates", "registers")


def logs_mode_capabilities(capabilities: Capabilities, mode: str) -> Capabilities:
    """What a backend instance declares under its URI's ``logs=`` option: ``creates``
    keeps ``capabilities``; ``registers`` -- for a service that accepts conditional
    writes without enforcing them -- drops the exclusive create and the
    compare-and-swap, so nothing relies on them and its logs are Disk Paxos registers
    over whole-object writes (:class:`~metasync.backends.logs.RegisterLogs`)."""
    if mode == "registers":
        return replace(capabilities, conditional_create=False, compare_and_swap=False)
    return capabilities
