"""The repository key and its passphrase-wrapped key file.

A random 32-byte master secret is generated at init. Two keys are derived from
it with HKDF-SHA256: ``id_key`` (keyed object ids) and ``enc_key`` (AES-256-GCM).
The secret leaves the client only inside the key file, wrapped by a key that
scrypt derives from the passphrase, so changing the passphrase rewrites one
small file and never re-encrypts data.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from metasync.errors import FormatError, WrongPassphrase

KEYFILE_FORMAT = 1
_WRAP_AAD = b"metasync keyfile v1"
#: scrypt cost: 2**15 x 8 x 128 bytes = 32 MiB and ~0.1 s per unwrap.
SCRYPT_N = 2**15
SCRYPT_R = 8
SCRYPT_P = 1


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


def _kek(passphrase: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(passphrase.encode())


def wrap(key: MasterKey, passphrase: str) -> bytes:
    """The key file: JSON holding the secret encrypted under the passphrase."""
    salt = os.urandom(16)
    nonce = os.urandom(12)
    kek = _kek(passphrase, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    wrapped = AESGCM(kek).encrypt(nonce, key.secret, _WRAP_AAD)
    doc = {
        "format": KEYFILE_FORMAT,
        "kdf": {"name": "scrypt", "n": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P,
                "salt": base64.b64encode(salt).decode()},
        "cipher": "aes-256-gcm",
        "nonce": base64.b64encode(nonce).decode(),
        "wrapped": base64.b64encode(wrapped).decode(),
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"


def unwrap(keyfile: bytes, passphrase: str) -> MasterKey:
    """Recover the secret; :class:`WrongPassphrase` if the passphrase is wrong."""
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
        # Bound the cost a hostile key file can make us pay.
        if not (2**10 <= n <= 2**20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
            raise FormatError("key file has out-of-range scrypt parameters")
        salt = base64.b64decode(kdf["salt"], validate=True)
        nonce = base64.b64decode(doc["nonce"], validate=True)
        wrapped = base64.b64decode(doc["wrapped"], validate=True)
        if len(salt) < 16 or len(nonce) != 12 or len(wrapped) != 32 + 16:
            raise ValueError("wrong salt, nonce or wrapped key length")
    except FormatError:
        raise
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise FormatError("the key file is damaged; clone from another backend") from exc
    kek = _kek(passphrase, salt, n, r, p)
    try:
        secret = AESGCM(kek).decrypt(nonce, wrapped, _WRAP_AAD)
    except InvalidTag:
        raise WrongPassphrase(
            "wrong passphrase: it does not unlock this repository's key; check "
            "METASYNC_PASSPHRASE or --passphrase-file"
        ) from None
    if len(secret) != 32:
        raise FormatError("the key file holds a key of the wrong size")
    return MasterKey(secret)
