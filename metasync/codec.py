"""Turning logical objects into the bytes stored on backends, and back.

Two stored forms (see docs/FORMAT.md):

- a *standalone object* (commit, index, config) is the translator chain's output
  for that object, stored under its logical id; reading it back decrypts,
  decompresses and re-derives the id;
- a *pack* bundles many small encoded objects (blobs, files, trees) so a tree
  of thousands of small files becomes a few backend objects. Each entry is
  encoded on its own, so one entry can be read with a range request and
  verified alone; a trailer lists the entries so a pack is self-describing.
  A pack is named by the hash of its stored bytes.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

from metasync.errors import CorruptObject
from metasync.keys import Keyring, MasterKey
from metasync.objects import ObjectHasher, PackEntry, canonical_json, parse_json, parse_pack_entry
from metasync.translators import Context, Translator, TranslatorChain
from metasync.translators.compress import ZstdTranslator
from metasync.translators.encrypt import AesGcmTranslator
from metasync.translators.integrity import IntegrityTranslator

PACK_MAGIC = b"MSP1"
_TRAILER = struct.Struct(">I4s")
#: A pack is closed once it holds this many stored bytes.
PACK_TARGET_SIZE = 16 * 1024 * 1024


class Codec:
    """Hashing and the translator chain for one repository."""

    def __init__(self, key: MasterKey | Keyring | None) -> None:
        ring = key.keyring() if isinstance(key, MasterKey) else key
        self.encrypted = ring is not None
        self.keyring = ring
        self.hasher = ObjectHasher(ring.id_key if ring else None)
        chain: list[Translator] = [IntegrityTranslator(self.hasher), ZstdTranslator()]
        if ring is not None:
            older = tuple(k for e, k in sorted(ring.data_keys.items(), reverse=True) if e != ring.current)
            chain.append(AesGcmTranslator(ring.data_keys[ring.current], older))
        self.chain = TranslatorChain(chain)

    def id_of(self, kind: str, data: bytes | memoryview) -> str:
        return self.hasher.id_of(kind, data)

    def encode(self, kind: str, object_id: str, plaintext: bytes) -> bytes:
        """Stored bytes of one object (or a labelled record such as a log entry)."""
        return self.chain.put(plaintext, Context(kind, object_id))

    def decode(self, kind: str, object_id: str, stored: bytes) -> bytes:
        """Plaintext of stored bytes; :class:`CorruptObject` if they fail any check."""
        return self.chain.get(stored, Context(kind, object_id))

    def check_pack(self, pack_id: str, stored: bytes) -> None:
        """Raise :class:`CorruptObject` unless ``stored`` hashes to ``pack_id``."""
        if self.id_of("pack", stored) != pack_id:
            raise CorruptObject(f"pack {pack_id[:12]}: content does not match its id")

    def pack_entries(self, pack_id: str, stored: bytes) -> list[PackEntry]:
        """Read a whole pack's trailer (for fsck and index rebuilding)."""
        self.check_pack(pack_id, stored)
        if len(stored) < _TRAILER.size:
            raise CorruptObject(f"pack {pack_id[:12]}: too short")
        header_len, magic = _TRAILER.unpack_from(stored, len(stored) - _TRAILER.size)
        if magic != PACK_MAGIC or header_len > len(stored) - _TRAILER.size:
            raise CorruptObject(f"pack {pack_id[:12]}: bad trailer")
        start = len(stored) - _TRAILER.size - header_len
        header = self.decode("packheader", "pack", stored[start : start + header_len])
        raw = parse_json(header, "pack header")
        if not isinstance(raw, list):
            raise CorruptObject(f"pack {pack_id[:12]}: bad header")
        return [parse_pack_entry(item) for item in raw]


@dataclass
class FinishedPack:
    """A closed pack ready to upload."""

    pack_id: str
    data: bytes
    entries: list[PackEntry]
    blobs: int = 0


@dataclass
class PackBuilder:
    """Accumulates encoded objects into packs of about ``target_size`` bytes.

    Thread-safe: encoding happens in the caller's thread, only the append is
    locked. ``add`` returns a :class:`FinishedPack` when the pack filled up.
    """

    codec: Codec
    target_size: int = PACK_TARGET_SIZE
    _parts: list[bytes] = field(default_factory=list)
    _entries: list[PackEntry] = field(default_factory=list)
    _size: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, object_id: str, plaintext: bytes) -> FinishedPack | None:
        encoded = self.codec.encode(kind, object_id, plaintext)
        with self._lock:
            self._entries.append(PackEntry(object_id, kind, self._size, len(encoded)))
            self._parts.append(encoded)
            self._size += len(encoded)
            if self._size >= self.target_size:
                return self._close()
        return None

    def flush(self) -> FinishedPack | None:
        """Close the current pack if it holds anything."""
        with self._lock:
            return self._close() if self._entries else None

    def _close(self) -> FinishedPack:
        entries = self._entries
        header = canonical_json([[e.object_id, e.kind, e.offset, e.length] for e in entries])
        encoded_header = self.codec.encode("packheader", "pack", header)
        self._parts.append(encoded_header)
        self._parts.append(_TRAILER.pack(len(encoded_header), PACK_MAGIC))
        data = b"".join(self._parts)
        self._parts, self._entries, self._size = [], [], 0
        blobs = sum(1 for e in entries if e.kind == "blob")
        return FinishedPack(self.codec.id_of("pack", data), data, entries, blobs)
