"""Key management: the passphrases (key slots, :mod:`metasync.keyslots`) that
open a repository -- ``metasync key list/add/remove/passwd`` -- and
:func:`reseal`, which gives a new keyring to every slot (``key rotate``).

Every change is written to every backend of the current configuration, one
atomic ``put`` per slot file; backends that cannot be reached are reported in one
line (run the command again once they can be). A removed slot is overwritten by
a tombstone, so a backend that missed the removal cannot bring it back into a
rotation. Removing a passphrase stops it opening the key files; it does not take
back the keys a holder already has: ``metasync key rotate`` does that for what
is written afterwards.

A repository made by older metasync has one legacy key file (``keys/master``).
``key add`` leaves it (the old passphrase keeps working beside the new slot);
``key passwd`` from a client that holds a legacy key converts: it writes a slot
for this device under the new passphrase, deletes ``keys/master`` everywhere and
keeps the slot's key in ``.metasync/key``; ``key remove master`` deletes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from metasync.backends import Backend
from metasync.context import KEY_FILE, RepoContext, device_name, refresh_key, save_key
from metasync.errors import FormatError, MetasyncError, NotTrusted, ObjectNotFound, UsageError
from metasync.keys import Keyring
from metasync.keyslots import (
    LocalKey,
    Slot,
    is_slot_id,
    make_slot,
    new_slot_id,
    parse_slot,
    resealed,
    tombstone,
)
from metasync.layout import (
    DESCRIPTOR_KEY,
    KEYFILE_KEY,
    descriptor,
    key_file_keys,
    parse_descriptor,
    parse_slot_key,
    slot_key,
)
from metasync.lifecycle import MAX_SLOTS, today
from metasync.versions import Versions

#: The name ``key list`` and ``key remove`` give a legacy key file.
LEGACY_SLOT = "master"


@dataclass
class SlotInfo:
    """One passphrase as ``key list`` shows it."""

    slot: str
    label: str
    created: str
    #: This client's own slot.
    mine: bool
    #: The MAC verifies under this client's keys (False: planted, or made under
    #: keys this client does not hold).
    vouched: bool
    #: Backends holding it, of those that answered.
    held: int


@dataclass
class KeyReport:
    """What a key command did: the slot it concerns and the backends it missed."""

    slot: str
    unreachable: list[str] = field(default_factory=list)


@dataclass
class ResealReport:
    """What :func:`reseal` did."""

    #: ``(slot id, label)`` of every slot the new keyring was sealed to.
    sealed: list[tuple[str, str]] = field(default_factory=list)
    #: Slots whose MAC does not verify: not sealed to (a backend may have planted them).
    refused: list[str] = field(default_factory=list)
    #: ``backend name: reason`` for each backend a slot could not be written to.
    unreachable: list[str] = field(default_factory=list)
    #: A legacy key file (``keys/master``) is still there: its passphrase opens the
    #: keys of epoch 0 only, and whoever has it keeps them until it is removed.
    legacy: bool = False

    def line(self) -> str:
        """One line for the user about what could not be done ("" if nothing)."""
        parts = []
        if self.refused:
            parts.append(f"key slots {', '.join(self.refused)} are not vouched for by this "
                         "repository's key and got no new keys (remove them: metasync key remove)")
        if self.legacy:
            parts.append("the key file of older metasync (keys/master) still opens the old keys: "
                         "remove it (metasync key remove master) once every device has a slot")
        if self.unreachable:
            parts.append(f"could not write to {'; '.join(self.unreachable)} (run it again when "
                         "they can be reached)")
        return "; ".join(parts)


def read_slots(backends: Mapping[str, Backend]) -> tuple[dict[str, Slot], dict[str, int], bool]:
    """Every slot on ``backends``: ``(slot id -> slot, slot id -> backends holding
    it, whether any holds a legacy key file)``. A tombstone anywhere wins over a
    live copy elsewhere; a damaged file is skipped. Raises if no backend answers."""
    slots: dict[str, Slot] = {}
    held: dict[str, int] = {}
    legacy, answered = False, False
    for backend in backends.values():
        try:
            names = key_file_keys(backend)
        except MetasyncError:
            continue
        answered = True
        for key in names:
            if key == KEYFILE_KEY:
                legacy = True
                continue
            slot_id = parse_slot_key(key)
            try:
                slot = parse_slot(backend.get(key), slot_id or "")
            except (FormatError, ObjectNotFound):
                continue
            except MetasyncError:
                continue
            held[slot.slot] = held.get(slot.slot, 0) + 1
            if slot.slot not in slots or not slot.live:
                slots[slot.slot] = slot
    if not answered:
        raise UsageError("no backend of the repository could be read; retry when one is reachable")
    return slots, held, legacy


def _put_everywhere(backends: Mapping[str, Backend], key: str, data: bytes) -> list[str]:
    missed = []
    for backend in backends.values():
        try:
            backend.put(key, data)
        except MetasyncError as exc:
            missed.append(f"{backend.name}: {exc}")
    if len(missed) == len(backends):
        raise UsageError(f"no backend took {key} ({missed[-1]}); retry when one is reachable")
    return missed


def _delete_everywhere(backends: Mapping[str, Backend], key: str) -> list[str]:
    """Delete ``key`` on every backend (gone already is fine); the backends missed."""
    missed = []
    for backend in backends.values():
        try:
            backend.delete(key)
        except ObjectNotFound:
            continue
        except MetasyncError as exc:
            missed.append(f"{backend.name}: {exc}")
    return missed


def reseal(backends: Mapping[str, Backend], ring: Keyring) -> ResealReport:
    """Seal ``ring`` to every live slot on ``backends`` whose MAC verifies under
    ``ring`` (which therefore must still hold the data key the slots' MACs are
    under: rotate, reseal, and only then retire the old epoch), rewriting each
    slot's file on every backend (one atomic ``put`` per backend). Tombstones are
    copied to the backends that still hold the live slot."""
    slots, _held, legacy = read_slots(backends)
    report = ResealReport(legacy=legacy)
    for slot_id, slot in sorted(slots.items()):
        if not slot.live:
            data = slot.raw
        else:
            try:
                data = resealed(slot, ring)
            except NotTrusted:
                report.refused.append(slot_id)
                continue
            report.sealed.append((slot_id, slot.label))
        for backend in backends.values():
            try:
                backend.put(slot_key(slot_id), data)
            except MetasyncError as exc:
                report.unreachable.append(f"{backend.name}: {exc}")
    return report


class KeySlots:
    """The key commands of one open repository."""

    def __init__(self, ctx: RepoContext, versions: Versions) -> None:
        self.ctx = ctx
        self.versions = versions

    def _open(self) -> tuple[LocalKey, dict[str, Backend]]:
        """This client's keys -- brought up to the latest configuration's key epoch
        first, so a new slot never gets an older keyring -- and the backends of the
        latest configuration."""
        path = self.ctx.meta / KEY_FILE
        if not path.exists():
            raise UsageError("this repository is not encrypted: it has no keys")
        local = LocalKey.from_bytes(path.read_bytes())
        config = self.versions.load_config(self.versions.learn_latest().config)
        backends = self.ctx.pool.open(config)
        if config.key_epoch not in local.ring.data_keys:
            local = refresh_key(self.ctx.meta, local, backends.values(), config.key_epoch)
        return local, backends

    def list(self) -> list[SlotInfo]:
        """Every passphrase that opens the repository, this client's marked."""
        local, backends = self._open()
        slots, held, legacy = read_slots(backends)
        out = [SlotInfo(s.slot, s.label, s.created, s.slot == local.slot, s.mac_ok(local.ring),
                        held[s.slot]) for s in slots.values() if s.live]
        if legacy:
            out.append(SlotInfo(LEGACY_SLOT, "(key file of older metasync)", "", local.slot is None,
                                True, 0))
        return sorted(out, key=lambda s: (s.created, s.slot))

    def add(self, passphrase: str, label: str | None = None) -> KeyReport:
        """A new slot for ``passphrase`` (labelled ``label``, default this device's
        name), written to every backend."""
        local, backends = self._open()
        slots, _held, _legacy = read_slots(backends)
        if sum(1 for s in slots.values() if s.live) >= MAX_SLOTS:
            raise UsageError(f"a repository has at most {MAX_SLOTS} key slots (a clone tries each); "
                             "remove unused ones first (metasync key list)")
        slot_id = new_slot_id()
        try:
            data, _private = make_slot(local.ring, passphrase, slot=slot_id,
                                       label=label if label is not None else device_name(),
                                       created=today())
        except ValueError as exc:
            raise UsageError(f"bad --label: {exc}") from None
        self._authenticate_descriptors(backends, local.ring)
        return KeyReport(slot_id, _put_everywhere(backends, slot_key(slot_id), data))

    def _authenticate_descriptors(self, backends: dict[str, Backend], ring: Keyring) -> None:
        """Give each descriptor older metasync wrote (no MAC) the repository id and
        MAC: once slot files exist, a clone accepts only an authenticated descriptor."""
        for backend in backends.values():
            try:
                desc = parse_descriptor(backend.get(DESCRIPTOR_KEY), backend.name)
                if "repository" not in desc:
                    backend.put(DESCRIPTOR_KEY, descriptor(
                        self.versions.config, desc["config"], desc["backend"], ring))
            except MetasyncError:
                continue  # a clone from it fails in one line until a later key command

    def remove(self, slot_id: str, force: bool = False) -> KeyReport:
        """Remove slot ``slot_id`` from every backend (a tombstone replaces it). Refused
        for the last passphrase, and for this client's own unless ``force``."""
        local, backends = self._open()
        slots, _held, legacy = read_slots(backends)
        live = [i for i, s in slots.items() if s.live] + ([LEGACY_SLOT] if legacy else [])
        if slot_id not in live:
            raise UsageError(f"no key slot {slot_id!r}; see metasync key list")
        if len(live) == 1:
            raise UsageError("that is the repository's last passphrase; add another first "
                             "(metasync key add)")
        mine = slot_id == local.slot or (slot_id == LEGACY_SLOT and local.slot is None)
        if mine and not force:
            raise UsageError("that is this device's own key slot; give --force to remove it "
                             "(this folder keeps working until the keys are rotated)")
        if slot_id == LEGACY_SLOT:
            return KeyReport(slot_id, _delete_everywhere(backends, KEYFILE_KEY))
        assert is_slot_id(slot_id)
        data = tombstone(local.ring, slot_id, today())
        return KeyReport(slot_id, _put_everywhere(backends, slot_key(slot_id), data))

    def passwd(self, passphrase: str) -> KeyReport:
        """Rewrap this client's slot under ``passphrase`` (the same slot and key pair)
        on every backend, so the old passphrase opens nothing; a legacy key is
        converted (see the module docstring)."""
        local, backends = self._open()
        if local.slot is None or local.private is None:
            return self._convert(local, backends, passphrase)
        slots, _held, _legacy = read_slots(backends)
        slot = slots.get(local.slot)
        if slot is None or not slot.live:
            raise UsageError("this device's key slot was removed; clone again with a passphrase "
                             "that is still valid")
        data, _private = make_slot(local.ring, passphrase, slot=slot.slot, label=slot.label,
                                   created=slot.created, private=local.private)
        return KeyReport(slot.slot, _put_everywhere(backends, slot_key(slot.slot), data))

    def _convert(self, local: LocalKey, backends: dict[str, Backend], passphrase: str) -> KeyReport:
        slot_id = new_slot_id()
        data, private = make_slot(local.ring, passphrase, slot=slot_id, label=device_name(),
                                  created=today())
        self._authenticate_descriptors(backends, local.ring)
        missed = _put_everywhere(backends, slot_key(slot_id), data)
        save_key(self.ctx.meta, LocalKey(local.ring, slot_id, private))
        return KeyReport(slot_id, missed + _delete_everywhere(backends, KEYFILE_KEY))


class RotationSlots:
    """The key slots as :class:`~metasync.maintenance.rotation.KeyRotation` uses them:
    every live slot of the latest configuration's backends, and this client's key."""

    def __init__(self, ctx: RepoContext, versions: Versions) -> None:
        self.ctx = ctx
        self.versions = versions
        self.last: ResealReport | None = None

    def _backends(self) -> dict[str, Backend]:
        config = self.versions.load_config(self.versions.learn_latest().config)
        return self.ctx.pool.open(config)

    def check(self) -> None:
        """Refuse a rotation that could not give its key to every passphrase."""
        _slots, _held, legacy = read_slots(self._backends())
        if legacy:
            raise UsageError(
                "this repository still has the key file of older metasync (keys/master), which "
                "cannot receive a new key; run `metasync key passwd` first (it converts it)")
        local = LocalKey.from_bytes((self.ctx.meta / KEY_FILE).read_bytes())
        if local.slot is None:
            raise UsageError("this folder holds a key from before key slots; run "
                             "`metasync key passwd` first, then rotate")

    def publish(self, ring: Keyring) -> list[str]:
        self.last = report = reseal(self._backends(), ring)
        return report.unreachable

    def save_local(self, ring: Keyring) -> None:
        local = LocalKey.from_bytes((self.ctx.meta / KEY_FILE).read_bytes())
        save_key(self.ctx.meta, LocalKey(ring, local.slot, local.private))

    def slot_labels(self) -> list[str]:
        slots, _held, _legacy = read_slots(self._backends())
        return [f"{slot_id} ({slot.label})" for slot_id, slot in sorted(slots.items())
                if slot.live]
