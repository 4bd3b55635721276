"""Key slots: one passphrase each, every one unlocking the repository's keyring.

A slot file (``keys/<slot id>``, docs/FORMAT.md §8.2) holds, for one person or
device, like a restic key or an age recipient:

- an X25519 public key, in clear;
- its private key, wrapped by AES-256-GCM under a key scrypt derives from the
  slot's passphrase; the associated data binds the repository id, the slot id
  and the public key, so a slot file moved to another repository, or given
  another slot's name or public key, does not open;
- an *envelope*: the current :class:`~metasync.keys.Keyring` sealed to the
  public key (ephemeral X25519, HKDF-SHA256, AES-256-GCM; the associated data
  binds the repository id, the slot id and the ring's epoch). A key holder can
  therefore seal a new keyring to every slot without knowing any passphrase
  (:func:`resealed`, used by ``metasync key rotate``);
- a MAC over (repository id, slot id, public key, label, date) under a key
  derived from one of the ring's data keys: a backend cannot swap a slot's
  public key for its own and so have a new keyring sealed to it. Its limit: a
  holder of that data key (anyone the keyring was ever given to) can make such a
  MAC, so a slot planted before a rotation is sealed to like any other -- ``key
  rotate`` lists the slots it seals to and ``key list`` shows labels and dates.

A removed slot is overwritten by a *tombstone* (the same name; a MAC, no key):
a backend that was out of reach at removal and still serves the slot cannot
bring it back into a rotation, because a tombstone anywhere wins.

The local copy a client keeps (``.metasync/key``, 0600) is a :class:`LocalKey`:
its slot id, the slot's private key and the keyring. Pure: no I/O here.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import stat
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from metasync.errors import FormatError, NotTrusted
from metasync.keys import (
    Keyring,
    MasterKey,
    check_scrypt_params,
    derive_slot_ahead,
    kek,
    new_kek,
    repository_id,
    wrong_passphrase,
)

#: The format of a slot file and of the local key file.
SLOT_FORMAT = 2
#: Longest label a slot may carry (labels are shown by ``key list``).
MAX_LABEL = 100


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: object, length: int | None = None) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not base64 text")
    data = base64.b64decode(text, validate=True)
    if length is not None and len(data) != length:
        raise ValueError("wrong length")
    return data


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def is_slot_id(text: str) -> bool:
    """True for a slot id: 16 lower-case hex digits."""
    return len(text) == 16 and all(ch in "0123456789abcdef" for ch in text)


def new_slot_id() -> str:
    return os.urandom(8).hex()


# --- keyrings as data ------------------------------------------------------------------------
def ring_to_json(ring: Keyring) -> dict[str, object]:
    return {"id_key": ring.id_key.hex(), "current": ring.current,
            "data_keys": {str(e): k.hex() for e, k in sorted(ring.data_keys.items())}}


def ring_from_json(doc: object) -> Keyring:
    """A keyring from :func:`ring_to_json`'s form; :class:`ValueError` if malformed."""
    if not isinstance(doc, dict) or set(doc) != {"id_key", "current", "data_keys"}:
        raise ValueError("malformed keyring")
    keys = doc["data_keys"]
    if not isinstance(keys, dict) or not isinstance(doc["current"], int):
        raise ValueError("malformed keyring")
    data_keys = {}
    for epoch, hexkey in keys.items():
        if not (isinstance(epoch, str) and epoch.isdigit() and isinstance(hexkey, str)):
            raise ValueError("malformed keyring")
        data_keys[int(epoch)] = bytes.fromhex(hexkey)
    return Keyring(id_key=bytes.fromhex(doc["id_key"]), data_keys=data_keys, current=doc["current"])


# --- the local key file ----------------------------------------------------------------------
@dataclass(frozen=True)
class LocalKey:
    """What ``.metasync/key`` holds: the keyring, and the slot it came from with the
    slot's private key (both ``None`` for a legacy key: a master secret in hex)."""

    ring: Keyring
    slot: str | None = None
    private: bytes | None = None

    def to_bytes(self) -> bytes:
        doc = {"format": SLOT_FORMAT, "slot": self.slot,
               "private": self.private.hex() if self.private is not None else None,
               "ring": ring_to_json(self.ring)}
        return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> LocalKey:
        """Either form; :class:`FormatError` naming the fix if it is damaged."""
        text = data.decode(errors="replace").strip()
        try:
            if not text.startswith("{"):
                return cls(MasterKey.from_hex(text).keyring())
            doc = json.loads(text)
            slot, private_hex = doc["slot"], doc["private"]
            if doc["format"] != SLOT_FORMAT or (slot is None) != (private_hex is None):
                raise ValueError("unknown local key format")
            if slot is None:
                return cls(ring_from_json(doc["ring"]))
            private = bytes.fromhex(private_hex)
            if not is_slot_id(slot) or len(private) != 32:
                raise ValueError("wrong slot id or private key length")
            return cls(ring_from_json(doc["ring"]), slot, private)
        except (ValueError, KeyError, TypeError, RecursionError):
            raise FormatError(
                "this folder's key (.metasync/key) is damaged; clone the repository again"
            ) from None


# --- slot files ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """A parsed slot file (or tombstone, when ``removed`` is set)."""

    repository: str
    slot: str
    label: str
    created: str
    #: The date a tombstone was written; "" for a live slot.
    removed: str
    public: bytes
    kdf: tuple[int, int, int, bytes]
    nonce: bytes
    wrapped: bytes
    envelope: dict[str, object]
    mac_epoch: int
    mac: str
    raw: bytes

    @property
    def live(self) -> bool:
        return not self.removed

    def _mac_body(self) -> bytes:
        if self.removed:
            return _canonical(["metasync slot removed v2", self.repository, self.slot, self.removed])
        return _canonical(["metasync slot v2", self.repository, self.slot, _b64(self.public),
                           self.label, self.created])

    def mac_ok(self, ring: Keyring) -> bool:
        """True if the MAC verifies under the ring's data key of its epoch (False
        if the ring does not hold that epoch: it cannot vouch for the slot)."""
        key = ring.data_keys.get(self.mac_epoch)
        if key is None or repository_id(ring) != self.repository:
            return False
        return hmac.compare_digest(_mac(key, self._mac_body()), self.mac)


def _mac(data_key: bytes, body: bytes) -> str:
    mac_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"metasync key slot").derive(data_key)
    return hmac.new(mac_key, body, hashlib.sha256).hexdigest()


def _wrap_ad(repository: str, slot: str, public: bytes) -> bytes:
    return _canonical(["metasync slot key v2", repository, slot, _b64(public)])


def _envelope_ad(repository: str, slot: str, epoch: int) -> bytes:
    return _canonical(["metasync envelope v2", repository, slot, epoch])


def _envelope_key(shared: bytes, ephemeral: bytes, public: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral + public,
                info=b"metasync envelope v2").derive(shared)


def seal(ring: Keyring, repository: str, slot: str, public: bytes) -> dict[str, object]:
    """The envelope of ``ring`` for the slot with X25519 public key ``public``."""
    ephemeral = X25519PrivateKey.generate()
    eph_public = ephemeral.public_key().public_bytes_raw()
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(public))
    nonce = os.urandom(12)
    sealed = AESGCM(_envelope_key(shared, eph_public, public)).encrypt(
        nonce, _canonical(ring_to_json(ring)), _envelope_ad(repository, slot, ring.current))
    return {"epoch": ring.current, "ephemeral": _b64(eph_public), "nonce": _b64(nonce),
            "sealed": _b64(sealed)}


def _document(slot: Slot, *, envelope: dict[str, object] | None = None) -> dict[str, object]:
    n, r, p, salt = slot.kdf
    return {
        "format": SLOT_FORMAT, "repository": slot.repository, "slot": slot.slot,
        "label": slot.label, "created": slot.created, "public": _b64(slot.public),
        "kdf": {"name": "scrypt", "n": n, "r": r, "p": p, "salt": _b64(salt)},
        "cipher": "aes-256-gcm", "nonce": _b64(slot.nonce), "wrapped": _b64(slot.wrapped),
        "envelope": envelope if envelope is not None else slot.envelope,
        "mac": {"epoch": slot.mac_epoch, "tag": slot.mac},
    }


def _dump(doc: dict[str, object]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def make_slot(ring: Keyring, passphrase: str, *, slot: str, label: str, created: str,
              private: bytes | None = None) -> tuple[bytes, bytes]:
    """A new slot file for ``ring`` under ``passphrase``; returns ``(file bytes, the
    slot's private key)``. ``private`` keeps an existing slot's key pair (``key
    passwd``: the same slot, rewrapped)."""
    if len(label) > MAX_LABEL or any(ord(ch) < 32 for ch in label):
        raise ValueError("a label is at most 100 printable characters")
    key = X25519PrivateKey.from_private_bytes(private) if private else X25519PrivateKey.generate()
    private = key.private_bytes_raw()
    public = key.public_key().public_bytes_raw()
    repository = repository_id(ring)
    salt, (n, r, p), key_key = new_kek(passphrase)
    nonce = os.urandom(12)
    wrapped = AESGCM(key_key).encrypt(nonce, private, _wrap_ad(repository, slot, public))
    draft = Slot(repository, slot, label, created, "", public, (n, r, p, salt),
                 nonce, wrapped, seal(ring, repository, slot, public), ring.current, "", b"")
    doc = _document(draft)
    doc["mac"] = {"epoch": ring.current, "tag": _mac(ring.data_keys[ring.current], draft._mac_body())}
    return _dump(doc), private


def tombstone(ring: Keyring, slot: str, removed: str) -> bytes:
    """What replaces a removed slot's file (see the module docstring)."""
    repository = repository_id(ring)
    body = _canonical(["metasync slot removed v2", repository, slot, removed])
    return _dump({"format": SLOT_FORMAT, "repository": repository, "slot": slot,
                  "removed": removed,
                  "mac": {"epoch": ring.current, "tag": _mac(ring.data_keys[ring.current], body)}})


def parse_slot(raw: bytes, slot_id: str) -> Slot:
    """A slot file read as ``keys/<slot_id>``, checked field by field;
    :class:`FormatError` if it is damaged or names another slot."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != SLOT_FORMAT:
            raise ValueError("not a slot file")
        repository, slot, mac = doc["repository"], doc["slot"], doc["mac"]
        if not (isinstance(repository, str) and len(repository) == 32 and slot == slot_id
                and isinstance(mac, dict) and isinstance(mac["epoch"], int)
                and isinstance(mac["tag"], str)):
            raise ValueError("bad slot header")
        if "removed" in doc:
            if set(doc) != {"format", "repository", "slot", "removed", "mac"} or not (
                    isinstance(doc["removed"], str) and doc["removed"]):
                raise ValueError("bad tombstone")
            return Slot(repository, slot, "", "", doc["removed"], b"", (0, 0, 0, b""), b"", b"",
                        {}, mac["epoch"], mac["tag"], raw)
        kdf, env = doc["kdf"], doc["envelope"]
        if kdf["name"] != "scrypt" or doc["cipher"] != "aes-256-gcm":
            raise FormatError("a key slot uses an unknown KDF or cipher; upgrade metasync")
        n, r, p = int(kdf["n"]), int(kdf["r"]), int(kdf["p"])
        check_scrypt_params(n, r, p)
        salt = _unb64(kdf["salt"])
        if len(salt) < 16 or not isinstance(doc["label"], str) or not isinstance(doc["created"], str):
            raise ValueError("bad slot fields")
        if not (isinstance(env, dict) and set(env) == {"epoch", "ephemeral", "nonce", "sealed"}
                and isinstance(env["epoch"], int)):
            raise ValueError("bad envelope")
        _unb64(env["ephemeral"], 32), _unb64(env["nonce"], 12), _unb64(env["sealed"])
        return Slot(repository, slot, doc["label"], doc["created"], "", _unb64(doc["public"], 32),
                    (n, r, p, salt), _unb64(doc["nonce"], 12), _unb64(doc["wrapped"], 32 + 16),
                    env, mac["epoch"], mac["tag"], raw)
    except FormatError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise FormatError(f"key slot {slot_id} is damaged") from exc


#: What :func:`derive_ahead_in` looks at: names listed, and bytes of a slot file.
AHEAD_NAMES = 256
AHEAD_FILE_BYTES = 64 * 1024


def derive_ahead_in(folder: str, passphrase: str) -> None:
    """Start deriving the key of the first live slot file in ``folder`` (a local
    backend's ``keys`` folder: untrusted bytes, parsed by :func:`parse_slot`) while
    the program loads: ``metasync clone dir:PATH``. The key is used only if the
    clone then unlocks a slot of the same salt and cost with this passphrase
    (:func:`metasync.keys.kek`); anything odd here -- no folder, a damaged or
    oversized file, a link -- just leaves the work to the clone, which says why."""
    try:
        with os.scandir(folder) as listing:
            names = sorted(e.name for e in itertools.islice(listing, AHEAD_NAMES)
                           if is_slot_id(e.name))
        for name in names:
            # Not blocking (a FIFO planted under a slot's name would wait for a
            # writer), not following a link, and only a regular file is read.
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0))
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                raw = f.read(AHEAD_FILE_BYTES + 1)
            if len(raw) > AHEAD_FILE_BYTES:
                return
            slot = parse_slot(raw, name)
            if slot.live:
                n, r, p, salt = slot.kdf
                derive_slot_ahead(passphrase, salt, n, r, p)
                return
    except (OSError, FormatError):
        return


def unlock(slot: Slot, passphrase: str) -> bytes:
    """The slot's private key; :class:`WrongPassphrase` unless ``passphrase`` is the
    slot's (or the file was edited: its associated data binds the clear fields)."""
    n, r, p, salt = slot.kdf
    try:
        return AESGCM(kek(passphrase, salt, n, r, p)).decrypt(
            slot.nonce, slot.wrapped, _wrap_ad(slot.repository, slot.slot, slot.public))
    except InvalidTag:
        raise wrong_passphrase() from None


def open_envelope(slot: Slot, private: bytes) -> Keyring:
    """The keyring sealed in the slot's envelope; :class:`NotTrusted` if it does not
    open with ``private`` or holds another repository's keys."""
    env = slot.envelope
    try:
        key = X25519PrivateKey.from_private_bytes(private)
        if key.public_key().public_bytes_raw() != slot.public:
            raise ValueError("the slot's public key is not this private key's")
        ephemeral = _unb64(env["ephemeral"], 32)
        shared = key.exchange(X25519PublicKey.from_public_bytes(ephemeral))
        plain = AESGCM(_envelope_key(shared, ephemeral, slot.public)).decrypt(
            _unb64(env["nonce"], 12), _unb64(env["sealed"]),
            _envelope_ad(slot.repository, slot.slot, int(env["epoch"])))  # type: ignore[call-overload]
        ring = ring_from_json(json.loads(plain))
    except (InvalidTag, ValueError, KeyError, TypeError, RecursionError):
        raise NotTrusted(
            f"key slot {slot.slot} does not open with this device's key (changed on a "
            "backend?); clone again with a passphrase that is still valid"
        ) from None
    if ring.current != env["epoch"] or repository_id(ring) != slot.repository:
        raise NotTrusted(f"key slot {slot.slot} holds another repository's keys")
    return ring


def resealed(slot: Slot, ring: Keyring) -> bytes:
    """The slot's file with a new envelope of ``ring`` and a MAC under its current
    data key. :class:`NotTrusted` if the slot's MAC does not verify under ``ring``
    (a public key a backend planted must not receive the keys)."""
    if not slot.live:
        raise ValueError("a removed slot is never resealed")
    if not slot.mac_ok(ring):
        raise NotTrusted(f"key slot {slot.slot} is not vouched for by this repository's key")
    doc = _document(slot, envelope=seal(ring, slot.repository, slot.slot, slot.public))
    fresh = Slot(**{**slot.__dict__, "mac_epoch": ring.current})
    doc["mac"] = {"epoch": ring.current, "tag": _mac(ring.data_keys[ring.current], fresh._mac_body())}
    return _dump(doc)
