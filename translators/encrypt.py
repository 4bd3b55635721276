"""Authenticated encryption translator (AES-256-GCM).

Output: a 12-byte random nonce, then the ciphertext with its 16-byte tag. The
object's kind and id are the associated data, so a ciphertext only decrypts as
the object it was written as: a backend can neither read, alter, nor swap it.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from metasync.errors import CorruptObject
from metasync.translators import Context

NONCE_SIZE = 12
TAG_SIZE = 16


class AesGcmTranslator:
    """Encrypt on put, decrypt and authenticate on get."""

    name = "aes-256-gcm"

    def __init__(self, key: bytes, older: tuple[bytes, ...] = ()) -> None:
        """Encrypt under ``key``; decrypt under ``key`` or any of ``older`` (the
        data keys of earlier epochs while a key rotation is under way)."""
        if any(len(k) != 32 for k in (key, *older)):
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self._aead = AESGCM(key)
        self._readers = [self._aead, *(AESGCM(k) for k in older)]

    def put(self, data: bytes, ctx: Context) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, data, ctx.associated_data())

    def get(self, data: bytes, ctx: Context) -> bytes:
        return self.get_with_epoch(data, ctx)[0]

    def get_with_epoch(self, data: bytes, ctx: Context) -> tuple[bytes, int]:
        """The plaintext, and which key opened it: 0 for the current key, i for
        ``older[i - 1]``."""
        if len(data) < NONCE_SIZE + TAG_SIZE:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: ciphertext too short")
        # A tag failure under the wrong key costs one GHASH pass; the current key is
        # tried first, so only objects not yet rotated pay for a second try.
        for which, aead in enumerate(self._readers):
            try:
                return aead.decrypt(data[:NONCE_SIZE], data[NONCE_SIZE:], ctx.associated_data()), which
            except InvalidTag:
                continue
        raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: authentication failed")
