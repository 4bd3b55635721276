"""Compression translator (zstandard).

Output is one flag byte then the payload: ``0`` raw, ``1`` a zstd frame. Data
that does not shrink (already compressed media, ciphertext) is stored raw so
nothing ever grows by more than one byte.
"""

from __future__ import annotations

import threading

import zstandard

from metasync.errors import CorruptObject
from metasync.translators import Context

RAW = 0
ZSTD = 1
#: Refuse to inflate beyond this: a hostile backend must not exhaust memory.
MAX_DECOMPRESSED = 64 * 1024 * 1024


class ZstdTranslator:
    """Compress on put, decompress on get."""

    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        self.level = level
        # zstandard contexts are not thread-safe; keep one per thread.
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.level)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def put(self, data: bytes, ctx: Context) -> bytes:
        if len(data) >= 64:
            packed = self._compressor().compress(data)
            if len(packed) < len(data):
                return bytes([ZSTD]) + packed
        return bytes([RAW]) + data

    def get(self, data: bytes, ctx: Context) -> bytes:
        if not data:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: empty compressed payload")
        flag, payload = data[0], memoryview(data)[1:]
        if flag == RAW:
            return bytes(payload)
        if flag != ZSTD:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: unknown compression flag {flag}")
        try:
            # decompress() trusts a content size declared in the frame header over
            # max_output_size, so check the declaration first (-1: not declared).
            if zstandard.frame_content_size(payload) > MAX_DECOMPRESSED:
                raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: would inflate beyond the limit")
            return self._decompressor().decompress(payload, max_output_size=MAX_DECOMPRESSED)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: bad zstd data") from exc
