"""The repository's keys, and the passphrase-wrapped files that hold them.

A repository's keys are a :class:`Keyring`: the id key (keyed object ids, never
rotated) and the data keys by epoch (AES-256-GCM). A repository made by older
metasync has a random 32-byte master secret from which ``id_key`` and ``enc_key``
(epoch 0) are derived with HKDF-SHA256 (:class:`MasterKey`); its key file
(format 1, ``keys/master``, :func:`unwrap`) is still read.

Derived from the id key, so every key holder computes the same and nobody else
can: the repository id (:func:`repository_id`, bound into every key slot and
the descriptor), the descriptor's MAC key and the fingerprint a user pins
(:func:`fingerprint`). Key slots -- one passphrase each -- are in
:mod:`metasync.keyslots`.

scrypt costs: new files use ``N = SCRYPT_N`` (2**15) with ``p = SCRYPT_P`` (4):
the work of N = 2**17, p = 1 (what metasync wrote before issue 21; OWASP lists
the two as equal) in a quarter of the memory -- 32 MiB, not 128, which was most
of a clone's peak memory. Files with ``N`` from 2**15 up to 2**20 are read. The test suite may lower
the cost of the files *it* writes through ``METASYNC_INSECURE_TEST_SCRYPT_N``;
such a file has ``N`` below 2**15 and is refused by every reader that does not
have that variable set, so a weakened key file can never pass for a real one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from metasync.errors import FormatError, WrongPassphrase

#: The format of the legacy key file ``keys/master`` (read, never written).
KEYFILE_FORMAT = 1
_WRAP_AAD = b"metasync keyfile v1"
#: scrypt cost of new key files: 2**15 x 8 x 128 bytes = 32 MiB, four times over
#: (p = 4, one after another): the work of 2**17 with p = 1, ~0.4 s per unwrap.
SCRYPT_N = 2**15
SCRYPT_R = 8
SCRYPT_P = 4
#: The lowest cost a reader accepts (what metasync wrote before key slots).
MIN_SCRYPT_N = 2**15
#: The highest: bounds the memory and time a hostile key file can make us spend.
MAX_SCRYPT_N = 2**20
#: Test suites only: a lower N for the files this process writes (see the module
#: docstring); readers accept N >= 2**10 only while it is set.
TEST_SCRYPT_ENV = "METASYNC_INSECURE_TEST_SCRYPT_N"
_TEST_MIN_N = 2**10


@dataclass(frozen=True)
class MasterKey:
    """The repository secret and the keys derived from it."""

    secret: bytes

    @classmethod
    def generate(cls) -> MasterKey:
        return cls(os.urandom(32))

    def _derive(self, label: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(self.secret)

    @property
    def id_key(self) -> bytes:
        return self._derive(b"metasync object ids")

    @property
    def enc_key(self) -> bytes:
        return self._derive(b"metasync aes-256-gcm")

    def to_hex(self) -> str:
        return self.secret.hex()

    @classmethod
    def from_hex(cls, text: str) -> MasterKey:
        secret = bytes.fromhex(text.strip())
        if len(secret) != 32:
            raise ValueError("key must be 32 bytes")
        return cls(secret)

    def keyring(self) -> Keyring:
        """The keys a codec uses: this secret's id key and, as data key epoch 0,
        its encryption key."""
        return Keyring(id_key=self.id_key, data_keys={0: self.enc_key}, current=0)


@dataclass(frozen=True)
class Keyring:
    """What a codec needs: the id key (never rotated: object ids depend on it) and
    the data keys by epoch. New stored bytes are encrypted under ``current``; stored
    bytes under any epoch in ``data_keys`` are read. ``metasync key rotate`` adds an
    epoch and, once nothing is stored under the older ones, drops them."""

    id_key: bytes
    data_keys: dict[int, bytes]
    current: int

    def __post_init__(self) -> None:
        if len(self.id_key) != 32 or self.current not in self.data_keys:
            raise ValueError("a keyring needs a 32-byte id key and its current data key")
        if any(len(k) != 32 for k in self.data_keys.values()):
            raise ValueError("data keys must be 32 bytes")

    def with_new_epoch(self) -> Keyring:
        """This ring plus a random data key one epoch above the newest, made current."""
        epoch = max(self.data_keys) + 1
        return Keyring(self.id_key, {**self.data_keys, epoch: os.urandom(32)}, epoch)

    def narrowed(self, current: int, oldest: int = 0) -> Keyring:
        """The keys a configuration allows: writing under ``current``, reading under
        ``current`` and the epochs from ``oldest`` on. :class:`KeyError` if this ring
        lacks ``current`` (a rotation this client has not received yet)."""
        if current not in self.data_keys:
            raise KeyError(current)
        return Keyring(self.id_key, {e: k for e, k in self.data_keys.items() if e >= oldest
                                     or e == current}, current)




def scrypt_write_n() -> int:
    """The scrypt ``N`` for a key file written now: :data:`SCRYPT_N`, or the test
    suite's lower cost (a power of two from 2**10 below 2**15) if it set one."""
    raw = os.environ.get(TEST_SCRYPT_ENV, "")
    if raw.isdigit():
        n = int(raw)
        if _TEST_MIN_N <= n < MIN_SCRYPT_N and n & (n - 1) == 0:
            return n
    return SCRYPT_N


def check_scrypt_params(n: int, r: int, p: int) -> None:
    """Raise :class:`FormatError` unless a key file's scrypt cost is within what a
    reader accepts: a power of two from :data:`MIN_SCRYPT_N` (2**10 under the test
    variable) to :data:`MAX_SCRYPT_N`, ``1 <= r <= 32``, ``1 <= p <= 16``."""
    low = _TEST_MIN_N if scrypt_write_n() < MIN_SCRYPT_N else MIN_SCRYPT_N
    if not (low <= n <= MAX_SCRYPT_N and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
        raise FormatError(
            f"key file has out-of-range scrypt parameters (N={n}, r={r}, p={p}); "
            "it was not written by metasync"
        )


def kek(passphrase: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    """The key-encryption key scrypt derives from ``passphrase``: the one
    :func:`derive_slot_ahead` started for exactly these inputs if there is one
    (taken once), else derived now."""
    for ahead in _SLOTS_AHEAD:
        if ahead.matches(passphrase, salt, (n, r, p)):
            _SLOTS_AHEAD.remove(ahead)
            ahead.thread.join()
            if ahead.key:  # empty if the derivation failed: derived again here, raising
                return ahead.key
            break
    return _scrypt(passphrase, salt, (n, r, p))


def _scrypt(passphrase: str, salt: bytes, cost: tuple[int, int, int]) -> bytes:
    n, r, p = cost
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


class _Ahead:
    """A key-encryption key being derived in a thread (scrypt lets go of the
    interpreter lock): :func:`derive_ahead`, :func:`derive_slot_ahead`."""

    def __init__(self, passphrase: str, salt: bytes, cost: tuple[int, int, int]) -> None:
        self.passphrase = passphrase
        self.salt, self.cost = salt, cost
        self.key = b""
        self.thread = threading.Thread(target=self._derive, name="metasync-kdf", daemon=True)
        self.thread.start()

    def _derive(self) -> None:
        try:  # not kek(): it would find this very derivation and wait for itself
            self.key = _scrypt(self.passphrase, self.salt, self.cost)
        except Exception:  # said where it is asked for: derived again there
            self.key = b""  # a passphrase that is not UTF-8: no traceback from this thread

    def matches(self, passphrase: str, salt: bytes, cost: tuple[int, int, int]) -> bool:
        return (self.cost == cost and hmac.compare_digest(self.salt, salt)
                and hmac.compare_digest(self.passphrase.encode(), passphrase.encode()))


#: The new key file's key derived ahead, until :func:`new_kek` takes it.
_AHEAD: list[_Ahead] = []
#: Keys of existing key files derived ahead, until :func:`kek` is asked for one.
_SLOTS_AHEAD: list[_Ahead] = []


def derive_ahead(passphrase: str) -> None:
    """Start deriving the key-encryption key of a key file this process is about
    to write under ``passphrase``, with a new salt: ``metasync init`` with the
    passphrase in the environment starts it while the program loads (a third of
    a second of scrypt beside ~0.2 s of imports). Only :func:`new_kek` uses it."""
    _AHEAD[:] = [_Ahead(passphrase, os.urandom(16), (scrypt_write_n(), SCRYPT_R, SCRYPT_P))]


def derive_slot_ahead(passphrase: str, salt: bytes, n: int, r: int, p: int) -> None:
    """Start deriving the key-encryption key of an existing key file (its salt and
    cost, checked by :func:`check_scrypt_params`): ``metasync clone`` from a local
    folder reads its key slot while the program loads. :func:`kek` uses it only
    when asked for exactly this passphrase, salt and cost."""
    check_scrypt_params(n, r, p)
    _SLOTS_AHEAD[:] = [_Ahead(passphrase, salt, (n, r, p))]


def new_kek(passphrase: str) -> tuple[bytes, tuple[int, int, int], bytes]:
    """``(salt, (N, r, p), key)`` for a new key file under ``passphrase``: the one
    :func:`derive_ahead` started if it was for this passphrase and this cost (taken
    once: a salt is never used twice), else derived now with a new salt."""
    cost = (scrypt_write_n(), SCRYPT_R, SCRYPT_P)
    ahead = _AHEAD.pop() if _AHEAD else None
    if ahead is not None and ahead.matches(passphrase, ahead.salt, cost):
        ahead.thread.join()
        if ahead.key:  # empty if the derivation failed: derived again here, raising
            return ahead.salt, cost, ahead.key
    salt = os.urandom(16)
    return salt, cost, kek(passphrase, salt, *cost)


def wrong_passphrase() -> WrongPassphrase:
    return WrongPassphrase(
        "wrong passphrase: it does not unlock this repository's key; check "
        "METASYNC_PASSPHRASE or --passphrase-file"
    )


def wrap(key: MasterKey, passphrase: str) -> bytes:
    """A legacy (format 1) key file for ``key``: only tests write these now, to
    check that older repositories still open."""
    salt, (n, r, p), key_key = new_kek(passphrase)
    nonce = os.urandom(12)
    wrapped = AESGCM(key_key).encrypt(nonce, key.secret, _WRAP_AAD)
    doc = {
        "format": KEYFILE_FORMAT,
        "kdf": {"name": "scrypt", "n": n, "r": r, "p": p,
                "salt": base64.b64encode(salt).decode()},
        "cipher": "aes-256-gcm",
        "nonce": base64.b64encode(nonce).decode(),
        "wrapped": base64.b64encode(wrapped).decode(),
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def unwrap(keyfile: bytes, passphrase: str) -> MasterKey:
    """The secret of a legacy (format 1) key file; :class:`WrongPassphrase` if the
    passphrase is wrong, :class:`FormatError` if the file is damaged."""
    try:
        doc = json.loads(keyfile)
        if doc["format"] != KEYFILE_FORMAT:
            raise FormatError(
                f"key file format {doc['format']} is not supported (this metasync reads "
                f"{KEYFILE_FORMAT}); upgrade metasync"
            )
        kdf = doc["kdf"]
        if kdf["name"] != "scrypt" or doc["cipher"] != "aes-256-gcm":
            raise FormatError("key file uses an unknown KDF or cipher; upgrade metasync")
        n, r, p = int(kdf["n"]), int(kdf["r"]), int(kdf["p"])
        check_scrypt_params(n, r, p)
        salt = base64.b64decode(kdf["salt"], validate=True)
        nonce = base64.b64decode(doc["nonce"], validate=True)
        wrapped = base64.b64decode(doc["wrapped"], validate=True)
        if len(salt) < 16 or len(nonce) != 12 or len(wrapped) != 32 + 16:
            raise ValueError("wrong salt, nonce or wrapped key length")
    except FormatError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise FormatError("the key file is damaged; clone from another backend") from exc
    try:
        secret = AESGCM(kek(passphrase, salt, n, r, p)).decrypt(nonce, wrapped, _WRAP_AAD)
    except InvalidTag:
        raise wrong_passphrase() from None
    if len(secret) != 32:
        raise FormatError("the key file holds a key of the wrong size")
    return MasterKey(secret)


# --- what the id key vouches for ------------------------------------------------------------
def _derive(key: bytes, label: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=label).derive(key)


def repository_id(ring: Keyring) -> str:
    """The repository's id: 32 hex digits derived from its id key, so it is fixed
    at init, survives ``recover`` and rotations (the id key never changes), and no
    one without the key can make another repository's id match it."""
    return _derive(ring.id_key, b"metasync repository id", 16).hex()


def fingerprint(ring: Keyring) -> str:
    """What ``init`` and ``clone`` print and ``clone --fingerprint`` pins: 80 bits of
    an HMAC under the id key over the repository id, as ``ab12-cd34-ef56-7890-1a2b``."""
    tag = hmac.new(_derive(ring.id_key, b"metasync fingerprint"),
                   repository_id(ring).encode(), hashlib.sha256).hexdigest()[:20]
    return "-".join(tag[i:i + 4] for i in range(0, 20, 4))


def normalize_fingerprint(text: str) -> str:
    """A fingerprint as the user typed it, in :func:`fingerprint`'s form (case,
    spaces and dashes do not matter); :class:`ValueError` if it cannot be one."""
    digits = "".join(ch for ch in text.lower() if ch not in "- :")
    if len(digits) != 20 or any(ch not in "0123456789abcdef" for ch in digits):
        raise ValueError(text)
    return "-".join(digits[i:i + 4] for i in range(0, 20, 4))


def descriptor_mac(ring: Keyring, body: bytes) -> str:
    """The MAC of a descriptor's canonical body, under a key derived from the id key."""
    return hmac.new(_derive(ring.id_key, b"metasync descriptor"), body, hashlib.sha256).hexdigest()
