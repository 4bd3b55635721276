"""Translators (paper 3.5): transforms applied to every object leaving the machine.

A :class:`Translator` has ``put`` (before storing) and ``get`` (after reading).
A :class:`TranslatorChain` calls ``put`` in order and ``get`` in reverse, so the
default chain ``[integrity, compress, encrypt]`` compresses then encrypts on the
way out, and decrypts, decompresses, then re-derives the id on the way back.

Every call carries a :class:`Context` naming the object (kind and id). The
encryption translator binds it as associated data, so a backend cannot swap one
valid ciphertext for another; the integrity translator checks the id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Context:
    """Which object is being translated: its kind and id (or another stable label)."""

    kind: str
    id: str

    def associated_data(self) -> bytes:
        return f"metasync:{self.kind}:{self.id}".encode()


class Translator(Protocol):
    """One reversible transform. ``get(put(x, c), c) == x``; ``get`` raises
    :class:`metasync.errors.CorruptObject` on input it can prove wrong."""

    name: str

    def put(self, data: bytes, ctx: Context) -> bytes: ...

    def get(self, data: bytes, ctx: Context) -> bytes: ...


class TranslatorChain:
    """Translators applied in order on put and in reverse on get."""

    def __init__(self, translators: Sequence[Translator]) -> None:
        self.translators = tuple(translators)

    def put(self, data: bytes, ctx: Context) -> bytes:
        for t in self.translators:
            data = t.put(data, ctx)
        return data

    def get(self, data: bytes, ctx: Context) -> bytes:
        for t in reversed(self.translators):
            data = t.get(data, ctx)
        return data

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.translators)


__all__ = ["Context", "Translator", "TranslatorChain"]
