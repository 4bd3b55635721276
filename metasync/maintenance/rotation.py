"""``metasync key rotate``: a new data key for everything, and the old ones retired.

Three steps, each safe to interrupt and each completed by running the command
again (docs/design.md, "Key rotation"; docs/FORMAT.md §16):

1. **start**: add a random data key (epoch E) to the keyring, give the ring to
   every key slot, and decide a configuration whose ``key_epoch`` is E. From the
   decision on, every writer encrypts under E; clients that lack E fetch it from
   their key slot when they learn the configuration.
2. **re-encrypt**: :class:`~metasync.maintenance.rekey.Rekeyer` rewrites everything
   still under an older key, until a pass finds nothing left (or says what it
   could not reach).
3. **retire**: give every slot the ring without the older keys, then decide a
   configuration whose ``key_oldest`` is E, after which no reader accepts them
   for anything but the pPaxos log entries of instances before the rotation
   (which are never rewritten; clients that held the older keys keep them for those).

A rotation is under way while the configuration's ``key_oldest`` is below its
``key_epoch``; ``run`` then resumes at step 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from metasync import faults
from metasync.context import RepoContext
from metasync.errors import BackendError, UsageError
from metasync.keys import Keyring
from metasync.maintenance.reconfig import Reconfiguration
from metasync.maintenance.rekey import Rekeyer
from metasync.objects import FORMAT_VERSION
from metasync.versions import Versions

#: Passes of re-encryption before giving up (each pass only rewrites what a writer
#: still under the old epoch added meanwhile).
MAX_PASSES = 3


class KeySlots(Protocol):
    """Where the keyring lives: every key slot on the backends, and this client."""

    def publish(self, ring: Keyring) -> list[str]:
        """Seal ``ring`` to every key slot on every backend; return the slots (or
        backends) that could not be written."""

    def save_local(self, ring: Keyring) -> None:
        """Keep ``ring`` as this client's keyring (atomically)."""

    def slot_labels(self) -> list[str]:
        """The slots ``publish`` seals to, as the user knows them (for the report)."""


@dataclass
class RotationReport:
    """What ``key rotate`` did."""

    epoch: int
    started: bool = False
    rewritten: int = 0
    slots: list[str] = field(default_factory=list)
    #: Items still under an older key, and backends that did not answer.
    left: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    retired: bool = False
    #: One line about slots that got no new key (planted, legacy, unreachable).
    notes: str = ""


class KeyRotation:
    """Rotating the data key of one repository (see the module docstring)."""

    def __init__(self, ctx: RepoContext, versions: Versions, reconfig: Reconfiguration,
                 slots: KeySlots) -> None:
        self.ctx = ctx
        self.versions = versions
        self.reconfig = reconfig
        self.slots = slots

    def run(self, progress: Callable[[str], None] = lambda _: None) -> RotationReport:
        """Start a rotation (or resume the one under way) and finish it if it can:
        ``report.retired`` says whether the old keys are gone."""
        ring = self.ctx.keyring
        if ring is None:
            raise UsageError("this repository is not encrypted: it has no key to rotate")
        config = self.versions.load_config(self.versions.learn_latest().config)
        report = RotationReport(epoch=config.key_epoch, slots=self.slots.slot_labels())
        if config.key_oldest == config.key_epoch:
            # Nothing under way: start. The ring reaches this client and every slot
            # before any configuration names its epoch, so no key holder meets an
            # epoch it cannot fetch.
            ring = ring.with_new_epoch()
            self.slots.save_local(ring)
            self.ctx.keyring = ring
            self.versions.keys_changed()  # records re-keyed below stay readable here
            failed = self.slots.publish(ring)
            if failed:
                raise BackendError(
                    f"could not give the new key to {', '.join(failed)}; nothing was changed "
                    "in the repository -- run `metasync key rotate` again when they answer")
            epoch = ring.current
            progress(f"new data key (epoch {epoch}) given to {len(report.slots)} key slot(s)")
            # Key epochs and re-keyed packs are format 4: older metasync must refuse
            # the repository with "upgrade", not misread it.
            change = self.reconfig.change_config(
                lambda c: replace(c, key_epoch=epoch, format=max(c.format, FORMAT_VERSION)))
            config = change.new
            report.epoch, report.started = epoch, True
            faults.crash_point("rotate:started")
        self.ctx.use_keys(config)
        for _ in range(MAX_PASSES):
            backends = self.ctx.pool.open(config)
            rekey = Rekeyer(self.ctx.codec, backends, self.ctx.store.scheme,
                            self.ctx.store.executor).run()
            report.rewritten += rekey.rewritten
            report.left, report.unreachable = rekey.left, rekey.unreachable
            progress(f"re-encrypted {rekey.rewritten} stored item(s)")
            if rekey.complete or rekey.rewritten == 0:
                break
        if report.left or report.unreachable:
            return report
        # Retire: the slots first (a crash after it leaves the configuration still
        # accepting the old keys, which no slot hands out any more; the next run
        # decides the rest).
        assert self.ctx.keyring is not None
        faults.crash_point("rotate:retiring")
        final = self.ctx.keyring.narrowed(report.epoch, report.epoch)
        failed = self.slots.publish(final)
        if failed:
            report.left.extend(f"key slot {name}" for name in failed)
            return report
        # This client keeps the older keys it holds (like every client that held them):
        # the log entries of the instances before the rotation stay under them.
        epoch = report.epoch
        change = self.reconfig.change_config(lambda c: replace(c, key_oldest=epoch))
        self.ctx.use_keys(change.new)
        report.retired = True
        return report


def rotate(ctx: RepoContext, versions: Versions, reconfig: Reconfiguration,
           progress: Callable[[str], None] = lambda _: None) -> RotationReport:
    """``metasync key rotate``: a new data key for everything, the old ones retired
    (resumes a rotation under way), over this repository's key slots; refused in one
    line where a passphrase could not receive the new key (a legacy key file)."""
    from metasync.maintenance.keymgmt import RotationSlots

    slots = RotationSlots(ctx, versions)
    slots.check()
    report = KeyRotation(ctx, versions, reconfig, slots).run(progress)
    if slots.last is not None:
        report.notes = slots.last.line()
    return report
