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

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self._aead = AESGCM(key)

    def put(self, data: bytes, ctx: Context) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, data, ctx.associated_data())

    def get(self, data: bytes, ctx: Context) -> bytes:
        if len(data) < NONCE_SIZE + TAG_SIZE:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: ciphertext too short")
        try:
            return self._aead.decrypt(data[:NONCE_SIZE], data[NONCE_SIZE:], ctx.associated_data())
        except InvalidTag as exc:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: authentication failed") from exc
