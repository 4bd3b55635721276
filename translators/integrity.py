"""Integrity translator: on get, re-derive a content-addressed object's id.

Runs only on the way back (paper 3.5). A mismatch means a corrupt or substituted
copy; the caller then tries the next replica. Objects that are not content
addressed (log entries, per-client state) pass through; encryption
authenticates those.
"""

from __future__ import annotations

from metasync.errors import CorruptObject
from metasync.objects import ObjectHasher
from metasync.translators import Context

CONTENT_ADDRESSED = frozenset({"blob", "file", "tree", "commit", "index", "config"})


class IntegrityTranslator:
    """Verify ``hash(kind, data) == id`` for content-addressed kinds."""

    name = "integrity"

    def __init__(self, hasher: ObjectHasher) -> None:
        self.hasher = hasher

    def put(self, data: bytes, ctx: Context) -> bytes:
        return data

    def get(self, data: bytes, ctx: Context) -> bytes:
        if ctx.kind in CONTENT_ADDRESSED and self.hasher.id_of(ctx.kind, data) != ctx.id:
            raise CorruptObject(f"{ctx.kind} {ctx.id[:12]}: content does not match its id")
        return data
