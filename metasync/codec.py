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

import io
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from metasync.errors import CorruptObject
from metasync.keys import Keyring, MasterKey
from metasync.objects import ObjectHasher, PackEntry, canonical_json, parse_json, parse_pack_entry
from metasync.translators import Context, Translator, TranslatorChain
from metasync.translators.compress import ZstdTranslator
from metasync.translators.encrypt import AesGcmTranslator
from metasync.translators.integrity import IntegrityTranslator

PACK_MAGIC = b"MSP1"
#: The trailer magic of a pack whose entries were re-encrypted under a newer data key
#: (docs/FORMAT.md §6, "Re-keyed packs"): its bytes no longer hash to its id, so its
#: header is bound to the id and carries a keyed hash of the entries instead.
REKEYED_PACK_MAGIC = b"MSP2"
_TRAILER = struct.Struct(">I4s")
#: The hash kind of a re-keyed pack's entries ("metasync:rekeyed", 16 bytes).
_BODY_KIND = "rekeyed"
#: A pack is closed once it holds this many stored bytes.
PACK_TARGET_SIZE = 16 * 1024 * 1024
#: A pack being built is written (and hashed) this many bytes at a time.
_SPOOL_WRITE = 1024 * 1024


class Codec:
    """Hashing and the translator chain for one repository."""

    def __init__(self, key: MasterKey | Keyring | None) -> None:
        ring = key.keyring() if isinstance(key, MasterKey) else key
        self.encrypted = ring is not None
        self._id_key = ring.id_key if ring else None
        self.hasher = ObjectHasher(self._id_key)
        self.use(ring)

    def use(self, ring: Keyring | None) -> None:
        """Encrypt under ``ring.current`` and read under its keys from now on (after a
        key rotation moved the configuration's epoch). The id key never changes."""
        if (ring is not None) != self.encrypted or (
                ring is not None and ring.id_key != self._id_key):
            raise ValueError("a codec's id key never changes")
        self.keyring = ring
        chain: list[Translator] = [IntegrityTranslator(self.hasher), ZstdTranslator()]
        self._aes: AesGcmTranslator | None = None
        #: Data key epochs in the order the AES translator tries them (current first).
        self._epochs: list[int] = []
        if ring is not None:
            self._epochs = [ring.current, *sorted((e for e in ring.data_keys if e != ring.current),
                                                  reverse=True)]
            self._aes = AesGcmTranslator(ring.data_keys[ring.current],
                                         tuple(ring.data_keys[e] for e in self._epochs[1:]))
            chain.append(self._aes)
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
        """Raise :class:`CorruptObject` unless ``stored`` is the pack ``pack_id``: its
        bytes hash to the id, or (a re-keyed pack) its header is bound to the id and
        the keyed hash of its entries matches."""
        self.pack_entries(pack_id, stored)

    def pack_entries(self, pack_id: str, stored: bytes) -> list[PackEntry]:
        """Check a whole pack (:meth:`check_pack`) and read its trailer (for fsck,
        index rebuilding and re-keying)."""
        if len(stored) < _TRAILER.size:
            raise CorruptObject(f"pack {pack_id[:12]}: too short")
        header_len, magic = _TRAILER.unpack_from(stored, len(stored) - _TRAILER.size)
        rekeyed = magic == REKEYED_PACK_MAGIC and self.encrypted
        if magic != PACK_MAGIC and not rekeyed:
            raise CorruptObject(f"pack {pack_id[:12]}: bad trailer")
        if not rekeyed and self.id_of("pack", stored) != pack_id:
            raise CorruptObject(f"pack {pack_id[:12]}: content does not match its id")
        if header_len > len(stored) - _TRAILER.size:
            raise CorruptObject(f"pack {pack_id[:12]}: bad trailer")
        start = len(stored) - _TRAILER.size - header_len
        encoded = stored[start : start + header_len]
        if not rekeyed:
            raw = parse_json(self.decode("packheader", "pack", encoded), "pack header")
            if not isinstance(raw, list):
                raise CorruptObject(f"pack {pack_id[:12]}: bad header")
            return [parse_pack_entry(item) for item in raw]
        # The header's context names the pack id, so it authenticates this pack alone;
        # the hash binds every entry byte to it.
        doc = parse_json(self.decode("packheader", pack_id, encoded), "pack header")
        if (not isinstance(doc, dict) or set(doc) != {"entries", "body"}
                or not isinstance(doc["entries"], list)
                or doc["body"] != self.id_of(_BODY_KIND, stored[:start])):
            raise CorruptObject(f"pack {pack_id[:12]}: re-keyed entries do not match its header")
        return [parse_pack_entry(item) for item in doc["entries"]]

    # --- key rotation -------------------------------------------------------------
    def stale(self, stored: bytes, kind: str, object_id: str) -> bool:
        """True if ``stored`` (one chain output) is encrypted under an older data key
        than the current one; :class:`CorruptObject` if no key opens it."""
        if self._aes is None:
            return False
        return self._aes.get_with_epoch(stored, Context(kind, object_id))[1] != 0

    def reencrypt(self, stored: bytes, kind: str, object_id: str) -> bytes:
        """``stored`` encrypted under the current data key instead: the same
        compressed plaintext, so the same length (pack offsets stay valid)."""
        assert self._aes is not None, "only an encrypted repository re-keys"
        ctx = Context(kind, object_id)
        return self._aes.put(self._aes.get(stored, ctx), ctx)

    def pack_is_stale(self, pack_id: str, stored: bytes, entries: list[PackEntry]) -> bool:
        """True if the pack ``stored`` -- checked, its ``entries`` from
        :meth:`pack_entries` -- holds anything under an older data key."""
        start, header_len = _header_span(stored)
        rekeyed = stored[-4:] == REKEYED_PACK_MAGIC
        header_ctx = ("packheader", pack_id if rekeyed else "pack")
        return self.stale(stored[start : start + header_len], *header_ctx) or any(
            self.stale(stored[e.offset : e.offset + e.length], e.kind, e.object_id) for e in entries)

    def rekey_pack(self, pack_id: str, stored: bytes) -> bytes | None:
        """The pack re-encrypted under the current data key (a re-keyed pack, FORMAT.md
        §6), or None if nothing in it is under an older key. Checks the pack first."""
        entries = self.pack_entries(pack_id, stored)
        if self.pack_is_stale(pack_id, stored, entries):
            start = _header_span(stored)[0]
            parts = [self.reencrypt(stored[e.offset : e.offset + e.length], e.kind, e.object_id)
                     for e in entries]
            body = b"".join(parts)
            if len(body) != start:
                raise CorruptObject(f"pack {pack_id[:12]}: entries do not fill the pack")
            header = self.encode("packheader", pack_id, canonical_json({
                "entries": [[e.object_id, e.kind, e.offset, e.length] for e in entries],
                "body": self.id_of(_BODY_KIND, body),
            }))
            return body + header + _TRAILER.pack(len(header), REKEYED_PACK_MAGIC)
        return None  # written under the current key already (a plain pack stays plain)


def _header_span(stored: bytes) -> tuple[int, int]:
    """Where a checked pack's encoded header starts, and its length (from the trailer)."""
    header_len = _TRAILER.unpack_from(stored, len(stored) - _TRAILER.size)[0]
    return len(stored) - _TRAILER.size - header_len, header_len


@dataclass
class FinishedPack:
    """A closed pack ready to upload: its bytes in ``data``, or, for a pack built
    into a spool, in that file (``spool``, flushed but not yet synced)."""

    pack_id: str
    data: bytes
    entries: list[PackEntry]
    blobs: int = 0
    spool: BinaryIO | None = None


class PackBuilder:
    """Accumulates encoded objects into packs of about ``target_size`` bytes.

    Thread-safe: encoding happens in the caller's thread, only the append is
    locked. ``add`` returns a :class:`FinishedPack` when the pack filled up.

    With ``open_spool``, each pack's bytes are written to a fresh file from it as
    they come (and hashed as they go), so no pack is ever held in memory; without,
    they are gathered in memory and returned in :attr:`FinishedPack.data`.
    """

    def __init__(self, codec: Codec, target_size: int = PACK_TARGET_SIZE,
                 open_spool: Callable[[], BinaryIO] | None = None) -> None:
        self.codec = codec
        self.target_size = target_size
        self._open_spool = open_spool
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self._out: BinaryIO | None = None  # opened by the first write
        self._buf = bytearray()
        self._hash = self.codec.hasher.new("pack")
        self._entries: list[PackEntry] = []
        self._size = 0

    def _write(self, data: bytes, last: bool = False) -> None:
        # Gathered into _SPOOL_WRITE bytes before each write and hash (not a call of
        # each per object, with the lock held).
        self._buf += data
        if len(self._buf) >= _SPOOL_WRITE or last:
            if self._out is None:
                self._out = io.BytesIO() if self._open_spool is None else self._open_spool()
            self._out.write(self._buf)
            self._hash.update(self._buf)
            self._buf.clear()

    def add(self, kind: str, object_id: str, plaintext: bytes) -> FinishedPack | None:
        encoded = self.codec.encode(kind, object_id, plaintext)
        with self._lock:
            self._entries.append(PackEntry(object_id, kind, self._size, len(encoded)))
            self._write(encoded)
            self._size += len(encoded)
            if self._size >= self.target_size:
                return self._close()
        return None

    def flush(self) -> FinishedPack | None:
        """Close the current pack if it holds anything."""
        with self._lock:
            return self._close() if self._entries else None

    def discard(self) -> BinaryIO | None:
        """Drop the pack being built (its commit failed): close its spool and return
        it (the caller removes the file), None if nothing was written yet."""
        with self._lock:
            out = self._out
            self._start()
        if out is not None:
            out.close()
        return out

    def _close(self) -> FinishedPack:
        entries = self._entries
        header = canonical_json([[e.object_id, e.kind, e.offset, e.length] for e in entries])
        encoded_header = self.codec.encode("packheader", "pack", header)
        self._write(encoded_header)
        self._write(_TRAILER.pack(len(encoded_header), PACK_MAGIC), last=True)
        out, pack_id = self._out, self._hash.hexdigest()
        assert out is not None
        self._start()
        blobs = sum(1 for e in entries if e.kind == "blob")
        if isinstance(out, io.BytesIO):
            return FinishedPack(pack_id, out.getvalue(), entries, blobs)
        out.flush()
        return FinishedPack(pack_id, b"", entries, blobs, out)
