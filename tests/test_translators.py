"""Translators (compress, encrypt, integrity), their chain, and the key file.

A backend is untrusted: whatever it returns in place of a stored object must
decode to the original or raise CorruptObject. scrypt is slow (~0.1 s per call),
so the key-file tests share one wrapped key and call it only a few times.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from metasync import keys
from metasync.codec import Codec
from metasync.errors import CorruptObject, FormatError, WrongPassphrase
from metasync.keys import MasterKey, unwrap, wrap
from metasync.objects import ObjectHasher
from metasync.translators import Context, TranslatorChain
from metasync.translators import compress as compress_mod
from metasync.translators.compress import MAX_DECOMPRESSED, ZstdTranslator
from metasync.translators.encrypt import NONCE_SIZE, TAG_SIZE, AesGcmTranslator
from metasync.translators.integrity import CONTENT_ADDRESSED, IntegrityTranslator

KEY = MasterKey(bytes(range(32)))
KINDS = ["blob", "file", "tree", "commit", "index", "config", "log", "hint", "packheader"]

payloads = st.one_of(
    st.binary(max_size=3000),
    # compressible: a short pattern repeated
    st.tuples(st.binary(min_size=1, max_size=8), st.integers(1, 500)).map(lambda t: t[0] * t[1]),
)


def chain_for(key: MasterKey | None) -> TranslatorChain:
    hasher = ObjectHasher(key.id_key if key else None)
    translators: list[Any] = [IntegrityTranslator(hasher), ZstdTranslator()]
    if key is not None:
        translators.append(AesGcmTranslator(key.enc_key))
    return TranslatorChain(translators)


def ctx_for(key: MasterKey | None, kind: str, data: bytes) -> Context:
    """The context the codec uses: the id for content-addressed kinds, else a label."""
    if kind not in CONTENT_ADDRESSED:
        return Context(kind, "label-7")
    return Context(kind, ObjectHasher(key.id_key if key else None).id_of(kind, data))


# ----------------------------------------------------------------------------- chain


@settings(max_examples=60, deadline=None)
@given(data=payloads, kind=st.sampled_from(KINDS), encrypted=st.booleans())
def test_chain_round_trip(data: bytes, kind: str, encrypted: bool) -> None:
    """get(put(x, c), c) == x for any data and kind, with and without encryption;
    Codec.encode/decode is the same chain."""
    key = KEY if encrypted else None
    chain = chain_for(key)
    ctx = ctx_for(key, kind, data)
    stored = chain.put(data, ctx)
    assert chain.get(stored, ctx) == data
    codec = Codec(key)
    assert codec.decode(kind, ctx.id, codec.encode(kind, ctx.id, data)) == data
    # and the two are interchangeable: same keys, same format
    assert codec.decode(kind, ctx.id, stored) == data


def test_chain_order() -> None:
    """put applies translators in order, get in reverse (compress before encrypt)."""
    calls: list[str] = []

    class Tag:
        def __init__(self, name: str) -> None:
            self.name = name

        def put(self, data: bytes, ctx: Context) -> bytes:
            calls.append(f"put {self.name}")
            return data + self.name.encode()

        def get(self, data: bytes, ctx: Context) -> bytes:
            calls.append(f"get {self.name}")
            assert data.endswith(self.name.encode())
            return data[: -len(self.name)]

    chain = TranslatorChain([Tag("a"), Tag("b")])
    assert chain.names == ("a", "b")
    assert chain.put(b"x", Context("log", "1")) == b"xab"
    assert chain.get(b"xab", Context("log", "1")) == b"x"
    assert calls == ["put a", "put b", "get b", "get a"]


def test_default_chain_names() -> None:
    """The codec's chain is integrity, zstd, then AES-GCM only when encrypted."""
    assert Codec(KEY).chain.names == ("integrity", "zstd", "aes-256-gcm")
    assert Codec(None).chain.names == ("integrity", "zstd")
    assert Codec(KEY).encrypted and not Codec(None).encrypted


def test_plaintext_not_visible_when_encrypted() -> None:
    """With encryption on, neither the plaintext nor its compressed form is stored."""
    data = b"top secret payroll " * 50
    ctx = ctx_for(KEY, "blob", data)
    stored = chain_for(KEY).put(data, ctx)
    assert b"secret" not in stored
    assert zstandard.ZstdCompressor().compress(data)[4:20] not in stored
    unencrypted = chain_for(None).put(data, ctx_for(None, "blob", data))
    assert unencrypted[0] == compress_mod.ZSTD


# ----------------------------------------------------------------------------- encryption


def test_ciphertext_differs_each_time() -> None:
    """Encrypting the same object twice gives different bytes (random nonce), both
    of which decrypt."""
    aes = AesGcmTranslator(KEY.enc_key)
    ctx = Context("blob", "a" * 64)
    outputs = {aes.put(b"same bytes", ctx) for _ in range(20)}
    assert len(outputs) == 20
    assert {o[:NONCE_SIZE] for o in outputs}.__len__() == 20
    for out in outputs:
        assert len(out) == NONCE_SIZE + len(b"same bytes") + TAG_SIZE
        assert aes.get(out, ctx) == b"same bytes"


@pytest.mark.parametrize("encrypted_chain", [False, True], ids=["aes-only", "full-chain"])
def test_tampering_any_byte_is_detected(encrypted_chain: bool) -> None:
    """Flipping any bit of any byte of the encrypted output, truncating it or
    appending to it raises CorruptObject."""
    data = b"hello world, this is an object " * 3
    if encrypted_chain:
        t: Any = chain_for(KEY)
        ctx = ctx_for(KEY, "tree", data)
    else:
        t = AesGcmTranslator(KEY.enc_key)
        ctx = Context("log", "7")
    stored = t.put(data, ctx)
    for i in range(len(stored)):
        for bit in (0x01, 0x80):
            bad = bytearray(stored)
            bad[i] ^= bit
            with pytest.raises(CorruptObject):
                t.get(bytes(bad), ctx)
    for bad_bytes in (stored[:-1], stored + b"\x00", stored[: NONCE_SIZE + TAG_SIZE - 1], b""):
        with pytest.raises(CorruptObject):
            t.get(bad_bytes, ctx)


@pytest.mark.parametrize(
    "other",
    [Context("log", "8"), Context("hint", "7"), Context("log", "70"), Context("log", "7 ")],
    ids=["other-id", "other-kind", "longer-id", "suffix"],
)
def test_wrong_context_is_rejected(other: Context) -> None:
    """A ciphertext only decrypts under the (kind, id) it was written for: the
    context is bound as associated data, so a backend cannot move it."""
    aes = AesGcmTranslator(KEY.enc_key)
    stored = aes.put(b"payload", Context("log", "7"))
    assert aes.get(stored, Context("log", "7")) == b"payload"
    with pytest.raises(CorruptObject):
        aes.get(stored, other)
    # also through the full chain, for kinds the integrity check does not cover
    chain = chain_for(KEY)
    stored = chain.put(b"payload", Context("log", "7"))
    with pytest.raises(CorruptObject):
        chain.get(stored, other)


def test_swapped_content_addressed_objects_are_rejected() -> None:
    """A backend returning one valid encrypted object in place of another is caught."""
    chain = chain_for(KEY)
    one, two = b"first object", b"second object"
    c1, c2 = ctx_for(KEY, "blob", one), ctx_for(KEY, "blob", two)
    s1, s2 = chain.put(one, c1), chain.put(two, c2)
    with pytest.raises(CorruptObject):
        chain.get(s2, c1)
    with pytest.raises(CorruptObject):
        chain.get(s1, Context("tree", c1.id))
    assert chain.get(s1, c1) == one


def test_wrong_key_is_rejected() -> None:
    """Data encrypted under another repository's key does not decrypt."""
    ctx = Context("log", "1")
    stored = AesGcmTranslator(KEY.enc_key).put(b"x", ctx)
    with pytest.raises(CorruptObject):
        AesGcmTranslator(MasterKey.generate().enc_key).get(stored, ctx)


def test_aes_key_must_be_32_bytes() -> None:
    """AesGcmTranslator refuses keys that are not 32 bytes."""
    for bad in (b"", b"k" * 16, b"k" * 33):
        with pytest.raises(ValueError):
            AesGcmTranslator(bad)


def test_derived_keys_differ() -> None:
    """id_key and enc_key are distinct, 32 bytes, deterministic, and not the secret."""
    assert KEY.id_key != KEY.enc_key
    assert len(KEY.id_key) == len(KEY.enc_key) == 32
    assert KEY.secret not in (KEY.id_key, KEY.enc_key)
    assert MasterKey(KEY.secret).id_key == KEY.id_key
    assert MasterKey.from_hex(KEY.to_hex()) == KEY
    with pytest.raises(ValueError):
        MasterKey.from_hex("00" * 31)


# ----------------------------------------------------------------------------- compression


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000))
def test_zstd_never_grows_more_than_one_byte(data: bytes) -> None:
    """Whatever the input, compressed output is at most one byte longer, and it
    round-trips."""
    z = ZstdTranslator()
    ctx = Context("blob", "a" * 64)
    out = z.put(data, ctx)
    assert len(out) <= len(data) + 1
    assert z.get(out, ctx) == data


def test_zstd_incompressible_and_compressible() -> None:
    """Random data is stored raw (exactly one byte more); repetitive data shrinks a lot."""
    z = ZstdTranslator()
    ctx = Context("blob", "a" * 64)
    noise = os.urandom(100_000)
    out = z.put(noise, ctx)
    assert len(out) == len(noise) + 1
    assert out[0] == compress_mod.RAW
    text = b"the quick brown fox jumps over the lazy dog\n" * 2000
    packed = z.put(text, ctx)
    assert packed[0] == compress_mod.ZSTD
    assert len(packed) < len(text) // 20
    assert z.get(packed, ctx) == text
    assert z.put(b"", ctx) == b"\x00"
    assert z.get(b"\x00", ctx) == b""


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x02abc", b"\xffabc", b"\x01", b"\x01not a zstd frame", b"\x01" + b"\x28\xb5\x2f\xfd"],
    ids=["empty", "flag-2", "flag-255", "zstd-empty", "zstd-garbage", "zstd-magic-only"],
)
def test_zstd_rejects_garbage(payload: bytes) -> None:
    """An empty payload, an unknown flag or a broken zstd frame is CorruptObject."""
    with pytest.raises(CorruptObject):
        ZstdTranslator().get(payload, Context("blob", "a" * 64))


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(max_size=200))
def test_zstd_fuzz_only_corrupt_object(payload: bytes) -> None:
    """Random bytes after the zstd flag decode or raise CorruptObject, nothing else."""
    try:
        ZstdTranslator().get(b"\x01" + payload, Context("blob", "a" * 64))
    except CorruptObject:
        pass


def _frame_claiming(size: int, content: bytes = b"A") -> bytes:
    """A hand-made zstd frame whose header declares ``size`` bytes of content
    (single segment, 8-byte content size, one raw block)."""
    block_header = (1 | (0 << 1) | (len(content) << 3)).to_bytes(3, "little")
    return struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", size) + block_header + content


def test_zstd_bomb_with_declared_size_is_rejected() -> None:
    """A genuine frame that inflates beyond MAX_DECOMPRESSED (size in its header)
    is refused, as is a forged header claiming a terabyte (no huge allocation)."""
    z = ZstdTranslator()
    ctx = Context("blob", "a" * 64)
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(MAX_DECOMPRESSED + 1))
    assert len(bomb) < 100_000
    with pytest.raises(CorruptObject):
        z.get(b"\x01" + bomb, ctx)
    with pytest.raises(CorruptObject):
        z.get(b"\x01" + _frame_claiming(2**40), ctx)
    # the hand-made frame format itself is right: an honest claim decodes
    assert z.get(b"\x01" + _frame_claiming(1), ctx) == b"A"


def test_zstd_bomb_without_declared_size_is_rejected() -> None:
    """A streamed frame (no content size in its header) inflating beyond
    MAX_DECOMPRESSED is refused."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    bomb = cobj.compress(bytes(MAX_DECOMPRESSED + 1)) + cobj.flush()
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(CorruptObject):
        ZstdTranslator().get(b"\x01" + bomb, Context("blob", "a" * 64))


def test_zstd_limit_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output of exactly MAX_DECOMPRESSED bytes decodes; one byte more does not
    (checked with a small limit, with and without a declared size)."""
    monkeypatch.setattr(compress_mod, "MAX_DECOMPRESSED", 1000)
    z = ZstdTranslator()
    ctx = Context("blob", "a" * 64)
    for write_size in (True, False):
        cctx = zstandard.ZstdCompressor(write_content_size=write_size)
        ok = cctx.compressobj()
        ok_frame = ok.compress(bytes(1000)) + ok.flush()
        assert z.get(b"\x01" + ok_frame, ctx) == bytes(1000)
        big = cctx.compressobj()
        big_frame = big.compress(bytes(1001)) + big.flush()
        with pytest.raises(CorruptObject):
            z.get(b"\x01" + big_frame, ctx)


# ----------------------------------------------------------------------------- integrity


def test_integrity_rejects_mismatched_content() -> None:
    """For content-addressed kinds, get() re-derives the id and refuses a mismatch
    (other content, other kind, other hasher key); other kinds pass through."""
    hasher = ObjectHasher(None)
    t = IntegrityTranslator(hasher)
    data = b"content"
    for kind in ("blob", "file", "tree", "commit", "index", "config"):
        good = Context(kind, hasher.id_of(kind, data))
        assert t.put(data, good) == data
        assert t.get(data, good) == data
        with pytest.raises(CorruptObject):
            t.get(data + b"!", good)
        with pytest.raises(CorruptObject):
            t.get(data, Context("blob" if kind != "blob" else "tree", good.id))
        with pytest.raises(CorruptObject):
            IntegrityTranslator(ObjectHasher(b"k" * 32)).get(data, good)
    for kind in ("log", "hint", "packheader"):
        assert t.get(b"anything", Context(kind, "whatever")) == b"anything"


def test_unencrypted_chain_catches_substitution() -> None:
    """Without encryption, a substituted blob still fails the integrity check."""
    chain = chain_for(None)
    ctx = ctx_for(None, "blob", b"real")
    forged = chain.put(b"fake", ctx)  # a backend can produce this: no key needed
    with pytest.raises(CorruptObject):
        chain.get(forged, ctx)


# ----------------------------------------------------------------------------- key file


@pytest.fixture(scope="module")
def keyfile() -> tuple[MasterKey, bytes]:
    """One key wrapped (at the test suite's scrypt cost: one cheap scrypt call)."""
    key = MasterKey.generate()
    return key, wrap(key, "pass phrase ☃")


def test_keyfile_round_trip_and_wrong_passphrase(keyfile: tuple[MasterKey, bytes]) -> None:
    """unwrap(wrap(k, p), p) == k; any other passphrase raises WrongPassphrase."""
    key, data = keyfile
    assert unwrap(data, "pass phrase ☃") == key
    with pytest.raises(WrongPassphrase):
        unwrap(data, "pass phrase ☃ ")


def test_keyfile_is_json_with_documented_fields(keyfile: tuple[MasterKey, bytes]) -> None:
    """The legacy key file is JSON: format 1, scrypt with the cost of the moment (the
    test suite's, here), AES-256-GCM."""
    doc = json.loads(keyfile[1])
    assert doc["format"] == 1
    assert doc["cipher"] == "aes-256-gcm"
    assert doc["kdf"]["name"] == "scrypt"
    assert (doc["kdf"]["n"], doc["kdf"]["r"], doc["kdf"]["p"]) == (
        keys.scrypt_write_n(), keys.SCRYPT_R, keys.SCRYPT_P,
    )


def _encodings(secret: bytes) -> list[bytes]:
    forms = [
        secret,
        secret.hex().encode(),
        secret.hex().upper().encode(),
        base64.b64encode(secret),
        base64.urlsafe_b64encode(secret),
        base64.b32encode(secret),
        base64.b85encode(secret),
    ]
    # without padding, and a prefix long enough to be unmistakable
    forms += [f.rstrip(b"=")[:24] for f in forms[3:]]
    return forms


def test_keyfile_does_not_contain_the_secret(keyfile: tuple[MasterKey, bytes]) -> None:
    """Neither the secret nor its derived keys appear in the key file, raw or in
    hex, base64, base32 or base85."""
    key, data = keyfile
    for value in (key.secret, key.id_key, key.enc_key):
        for form in _encodings(value):
            assert form not in data


def test_wraps_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrapping the same key twice uses a fresh salt and nonce (cheap scrypt cost
    here: the format records the cost, so unwrap follows it)."""
    monkeypatch.setattr(keys, "SCRYPT_N", 2**10)
    key = MasterKey.generate()
    one, two = wrap(key, "p"), wrap(key, "p")
    d1, d2 = json.loads(one), json.loads(two)
    assert d1["kdf"]["salt"] != d2["kdf"]["salt"]
    assert d1["nonce"] != d2["nonce"]
    assert d1["wrapped"] != d2["wrapped"]
    assert unwrap(one, "p") == unwrap(two, "p") == key


def _edit(data: bytes, **changes: Any) -> bytes:
    doc = json.loads(data)
    for name, value in changes.items():
        target, _, field_name = name.rpartition("__")
        where = doc[target] if target else doc
        if value is ...:
            del where[field_name]
        else:
            where[field_name] = value
    return json.dumps(doc).encode()


DAMAGE: dict[str, Any] = {
    "empty": lambda d: b"",
    "truncated": lambda d: d[: len(d) // 2],
    "garbage": lambda d: b"\x00\xff garbage",
    "json list": lambda d: b"[1, 2]",
    "json string": lambda d: b'"key"',
    "deeply nested": lambda d: b"[" * 100_000,
    "no kdf": lambda d: _edit(d, kdf=...),
    "no nonce": lambda d: _edit(d, nonce=...),
    "kdf not dict": lambda d: _edit(d, kdf=[1]),
    "salt not base64": lambda d: _edit(d, kdf__salt="***"),
    "salt int": lambda d: _edit(d, kdf__salt=5),
    "salt empty": lambda d: _edit(d, kdf__salt=""),
    "n string": lambda d: _edit(d, kdf__n="many"),
    "n infinite": lambda d: _edit(d, kdf__n=float("inf")),
    "nonce short": lambda d: _edit(d, nonce=base64.b64encode(b"123").decode()),
    "nonce empty": lambda d: _edit(d, nonce=""),
    "wrapped truncated": lambda d: _edit(
        d, wrapped=base64.b64encode(base64.b64decode(json.loads(d)["wrapped"])[:-1]).decode()
    ),
    "wrapped empty": lambda d: _edit(d, wrapped=""),
    "unknown format": lambda d: _edit(d, format=2),
    "unknown kdf": lambda d: _edit(d, kdf__name="argon2id"),
    "unknown cipher": lambda d: _edit(d, cipher="chacha20"),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_keyfile_is_format_error(keyfile: tuple[MasterKey, bytes], damage: Any) -> None:
    """A damaged or unsupported key file raises FormatError (never another
    exception, never WrongPassphrase), without running scrypt."""
    with pytest.raises(FormatError):
        unwrap(damage(keyfile[1]), "pass phrase ☃")


SCRYPT_PARAMS = {
    "n tiny": {"kdf__n": 2**9},
    "n huge": {"kdf__n": 2**21},
    "n not power of two": {"kdf__n": 2**15 + 1},
    "n zero": {"kdf__n": 0},
    "n bool": {"kdf__n": True},
    "r zero": {"kdf__r": 0},
    "r huge": {"kdf__r": 33},
    "p zero": {"kdf__p": 0},
    "p huge": {"kdf__p": 17},
    "p negative": {"kdf__p": -1},
}


@pytest.mark.parametrize("params", SCRYPT_PARAMS.values(), ids=SCRYPT_PARAMS.keys())
def test_out_of_range_scrypt_params_are_format_error(
    keyfile: tuple[MasterKey, bytes], params: dict[str, Any]
) -> None:
    """scrypt parameters outside the accepted bounds (or that scrypt itself refuses)
    raise FormatError before any key derivation: a hostile key file cannot make
    unwrap burn unbounded memory or time."""
    with pytest.raises(FormatError):
        unwrap(_edit(keyfile[1], **params), "pass phrase ☃")
