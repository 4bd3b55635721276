"""Issue 16, scenarios 2 and 9: the trust anchor of a clone, and key management.

A backend (here a ``dir:`` folder an attacker edits) must not be able to
downgrade a clone to no encryption, pass one repository off as another, or
keep a removed passphrase working; ``metasync key`` adds, lists, removes and
changes passphrases; new key files cost scrypt N >= 2**17 and older ones open.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import PASSPHRASE, one_line_error, run_cli, snapshot
from metasync import Repository, keys, keyslots
from metasync.backends import open_backend
from metasync.codec import Codec
from metasync.context import refresh_key
from metasync.errors import FormatError, KeyRevoked, NotTrusted, WrongPassphrase
from metasync.keys import Keyring, MasterKey, fingerprint
from metasync.keyslots import LocalKey, open_envelope, parse_slot
from metasync.maintenance.keymgmt import reseal
from metasync.objects import FORMAT_VERSION, Config

OTHER = "another passphrase"


def _one_line_failure(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    one_line_error(proc, *needles)


def _init(tmp_path: Path, name: str, n: int = 2, passphrase: str = PASSPHRASE) -> tuple[Path, list[Path]]:
    """A repository in ``tmp_path/name`` on ``n`` new dir: backends, with one file pushed."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "secret.txt").write_text("the launch codes\n")
    dirs = [tmp_path / f"{name}-b{i}" for i in range(n)]
    args = ["init", str(folder)]
    for d in dirs:
        d.mkdir()
        args += ["--backend", f"dir:{d}"]
    out = run_cli(*args, passphrase=passphrase).stdout
    assert "Fingerprint: " in out
    run_cli("push", cwd=folder, passphrase=None)
    return folder, dirs


def _ns(d: Path) -> Path:
    return d / "metasync"


def _key_files(d: Path) -> list[Path]:
    return sorted((_ns(d) / "keys").glob("*")) if (_ns(d) / "keys").exists() else []


def _local(folder: Path) -> LocalKey:
    return LocalKey.from_bytes((folder / ".metasync" / "key").read_bytes())


# --------------------------------------------------------------------------- scenario 2
def test_clone_downgraded_to_no_encryption_is_refused(tmp_path: Path) -> None:
    """A backend rewrites its descriptor and configuration to "none" (it needs no key
    for that). The clone used to ask no passphrase and print nothing unusual; now it
    is refused in one line unless --no-encrypt says the user expects it."""
    folder, dirs = _init(tmp_path, "victim")
    ns = _ns(dirs[0])
    desc = json.loads((ns / "metasync.json").read_bytes())
    real = Codec(_local(folder).ring)
    config_id = desc["config"]
    config = Config.from_bytes(real.decode("config", config_id, (ns / "config" / config_id).read_bytes()))
    plain = Codec(None)
    data = replace(config, encryption="none").to_bytes()
    forged_id = plain.id_of("config", data)
    (ns / "config" / forged_id).write_bytes(plain.encode("config", forged_id, data))
    (ns / "metasync.json").write_text(json.dumps(
        {"format": FORMAT_VERSION, "encryption": "none", "config": forged_id,
         "backend": desc["backend"]}))
    for path in _key_files(dirs[0]):
        path.unlink()

    proc = run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "c1"), passphrase=None, check=False)
    _one_line_failure(proc, "not encrypted", "--no-encrypt")
    assert not (tmp_path / "c1").exists()
    proc = run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "c2"), check=False)
    _one_line_failure(proc, "not encrypted")


def test_fingerprint_pins_the_repository(tmp_path: Path) -> None:
    """init and clone print the fingerprint; --fingerprint of another repository (same
    passphrase) is refused; the right one clones."""
    a, a_dirs = _init(tmp_path, "a")
    _b, b_dirs = _init(tmp_path, "b")
    with_fp = run_cli("clone", f"dir:{a_dirs[1]}", str(tmp_path / "a2")).stdout
    fp_a = fingerprint(_local(a).ring)
    assert f"Fingerprint: {fp_a}" in with_fp

    proc = run_cli("clone", f"dir:{b_dirs[0]}", str(tmp_path / "x"), "--fingerprint", fp_a,
                   check=False)
    _one_line_failure(proc, fp_a, "--fingerprint")
    assert not (tmp_path / "x").exists()
    run_cli("clone", f"dir:{a_dirs[0]}", str(tmp_path / "a3"), "--fingerprint", fp_a.upper())
    assert (tmp_path / "a3" / "secret.txt").read_text() == "the launch codes\n"
    proc = run_cli("clone", f"dir:{a_dirs[0]}", str(tmp_path / "y"), "--fingerprint", "zz",
                   check=False)
    _one_line_failure(proc, "not a fingerprint")


def test_key_file_of_another_repository_is_refused(tmp_path: Path) -> None:
    """Repository B's key file, with the same passphrase, put in place of A's: the
    clone of A names the cause (the key file is bound to B's id) and writes nothing.
    An edited copy claiming A's id does not open (its associated data binds B's)."""
    _a, a_dirs = _init(tmp_path, "a")
    _b, b_dirs = _init(tmp_path, "b")
    for path in _key_files(a_dirs[0]):
        path.unlink()
    for path in _key_files(b_dirs[0]):
        shutil.copy(path, _ns(a_dirs[0]) / "keys" / path.name)
    proc = run_cli("clone", f"dir:{a_dirs[0]}", str(tmp_path / "c"), check=False)
    _one_line_failure(proc, "another repository")
    assert not (tmp_path / "c").exists()

    a_id = json.loads((_ns(a_dirs[0]) / "metasync.json").read_bytes())["repository"]
    for path in _key_files(a_dirs[0]):
        doc = json.loads(path.read_bytes())
        doc["repository"] = a_id
        path.write_text(json.dumps(doc))
    proc = run_cli("clone", f"dir:{a_dirs[0]}", str(tmp_path / "c"), check=False)
    _one_line_failure(proc, "wrong passphrase")


def test_descriptor_edited_by_a_backend_is_refused(tmp_path: Path) -> None:
    """The descriptor's fields (here: which backend this is) are authenticated under
    the repository key; an edit is refused in one line."""
    _a, dirs = _init(tmp_path, "a")
    path = _ns(dirs[0]) / "metasync.json"
    doc = json.loads(path.read_bytes())
    doc["backend"] = json.loads((_ns(dirs[1]) / "metasync.json").read_bytes())["backend"]
    path.write_text(json.dumps(doc))
    proc = run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "c"), check=False)
    _one_line_failure(proc, "not authenticated")


def test_unencrypted_clone_needs_no_encrypt(tmp_path: Path) -> None:
    """A real unencrypted repository clones with --no-encrypt, and says so."""
    src = tmp_path / "plain"
    src.mkdir()
    (src / "a.txt").write_text("plain\n")
    d = tmp_path / "d"
    d.mkdir()
    run_cli("init", str(src), "--no-encrypt", "--backend", f"dir:{d}", passphrase=None)
    run_cli("push", cwd=src, passphrase=None)
    out = run_cli("clone", f"dir:{d}", str(tmp_path / "c"), "--no-encrypt", passphrase=None).stdout
    assert "NOT encrypted" in out
    assert snapshot(tmp_path / "c") == snapshot(src)


# --------------------------------------------------------------------------- scenario 9
def _slot_of(folder: Path) -> str:
    slot = _local(folder).slot
    assert slot is not None
    return slot


def test_removed_passphrase_opens_nothing(tmp_path: Path) -> None:
    """key add gives a second passphrase its own slot; key remove deletes it from every
    backend: a clone with it then fails on each, the other passphrase still works."""
    folder, dirs = _init(tmp_path, "a", n=3)
    out = run_cli("key", "add", "--label", "laptop of bob", cwd=folder, passphrase=None,
                  env_extra={"METASYNC_NEW_PASSPHRASE": OTHER}).stdout
    added = out.split()[-1]
    listing = run_cli("key", "list", "--json", cwd=folder, passphrase=None).stdout
    slots = {s["slot"]: s for s in json.loads(listing)}
    assert set(slots) == {_slot_of(folder), added}
    assert slots[added]["label"] == "laptop of bob" and slots[added]["vouched"]
    run_cli("clone", f"dir:{dirs[2]}", str(tmp_path / "bob"), passphrase=OTHER)

    proc = run_cli("key", "remove", _slot_of(folder), cwd=folder, passphrase=None, check=False)
    _one_line_failure(proc, "--force")
    run_cli("key", "remove", added, cwd=folder, passphrase=None)
    for i, d in enumerate(dirs):
        proc = run_cli("clone", f"dir:{d}", str(tmp_path / f"x{i}"), passphrase=OTHER, check=False)
        _one_line_failure(proc, "wrong passphrase")
        assert OTHER.encode() not in b"".join(p.read_bytes() for p in _key_files(d))
    run_cli("clone", f"dir:{dirs[1]}", str(tmp_path / "alice"))
    proc = run_cli("key", "remove", _slot_of(folder), "--force", cwd=folder, passphrase=None,
                   check=False)
    _one_line_failure(proc, "last passphrase")


def test_stolen_local_key_of_a_removed_slot_opens_no_later_epoch(tmp_path: Path) -> None:
    """Bob's device (its .metasync/key) is stolen and his slot removed. A new keyring
    (epoch 1) sealed to the remaining slots opens for Alice's device, and for the
    stolen key neither through its own slot (gone: one line) nor through any other."""
    folder, dirs = _init(tmp_path, "a", n=2)
    run_cli("key", "add", "--label", "bob", cwd=folder, passphrase=None,
            env_extra={"METASYNC_NEW_PASSPHRASE": OTHER})
    run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "bob"), passphrase=OTHER)
    stolen = _local(tmp_path / "bob")
    assert stolen.slot != _slot_of(folder)
    run_cli("key", "remove", str(stolen.slot), cwd=folder, passphrase=None)

    alice = _local(folder)
    ring = Keyring(alice.ring.id_key, {**alice.ring.data_keys, 1: bytes(range(32))}, 1)
    backends = {str(i): open_backend(f"dir:{d}", "metasync") for i, d in enumerate(dirs)}
    report = reseal(backends, ring)
    assert [s for s, _ in report.sealed] == [alice.slot] and not report.line()

    fresh = refresh_key(folder / ".metasync", alice, backends.values(), 1)
    assert fresh.ring == ring and _local(folder).ring == ring
    with pytest.raises(KeyRevoked, match="this device's key was removed"):
        refresh_key(tmp_path / "bob" / ".metasync", stolen, backends.values(), 1)
    assert stolen.private is not None
    for d in dirs:
        for path in _key_files(d):
            slot = parse_slot(path.read_bytes(), path.name)
            if slot.live:
                with pytest.raises(NotTrusted):
                    open_envelope(slot, stolen.private)
            else:
                assert slot.slot == stolen.slot and b"wrapped" not in path.read_bytes()


def test_reseal_refuses_a_slot_a_backend_planted(tmp_path: Path) -> None:
    """A slot made under another repository's keys (a backend's own public key) is
    not sealed to, and the report names it."""
    folder, dirs = _init(tmp_path, "a", n=1)
    ring = _local(folder).ring
    evil = Keyring(bytes(32), {0: bytes(32)}, 0)
    data, _ = keyslots.make_slot(evil, "x", slot="0123456789abcdef", label="evil", created="now")
    doc = json.loads(data)
    doc["repository"] = keys.repository_id(ring)
    (_ns(dirs[0]) / "keys" / "0123456789abcdef").write_text(json.dumps(doc))
    report = reseal({"0": open_backend(f"dir:{dirs[0]}", "metasync")}, ring)
    assert report.refused == ["0123456789abcdef"] and "0123456789abcdef" in report.line()
    assert [s for s, _ in report.sealed] == [_slot_of(folder)]


def test_key_passwd_changes_the_passphrase_everywhere(tmp_path: Path) -> None:
    """key passwd rewraps this device's slot on every backend: the old passphrase
    opens nothing, the new one clones, the folder keeps working."""
    folder, dirs = _init(tmp_path, "a", n=2)
    slot = _slot_of(folder)
    run_cli("key", "passwd", cwd=folder, passphrase=None,
            env_extra={"METASYNC_NEW_PASSPHRASE": OTHER})
    for i, d in enumerate(dirs):
        proc = run_cli("clone", f"dir:{d}", str(tmp_path / f"old{i}"), check=False)
        _one_line_failure(proc, "wrong passphrase")
    run_cli("clone", f"dir:{dirs[1]}", str(tmp_path / "new"), passphrase=OTHER)
    assert _slot_of(tmp_path / "new") == slot
    (folder / "more.txt").write_text("more\n")
    run_cli("push", cwd=folder, passphrase=None)


def test_new_key_files_cost_2_17_in_32_mib_and_test_cost_files_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the test suite's variable a slot is written with the work of N = 2**17
    (N x p) in 32 MiB of scrypt memory (128 x r x N: issue 21, it was most of a
    clone's peak); a slot written before, at N = 2**17 and p = 1, still opens; a key
    file written under the variable (N = 2**10) is refused by a reader without it,
    so the variable cannot weaken a real key file."""
    ring = MasterKey.generate().keyring()
    cheap, _ = keyslots.make_slot(ring, "p", slot="00000000000000aa", label="t", created="d")
    assert json.loads(cheap)["kdf"]["n"] == 2**10
    monkeypatch.delenv(keys.TEST_SCRYPT_ENV)
    real, private = keyslots.make_slot(ring, "p", slot="00000000000000bb", label="t", created="d")
    kdf = json.loads(real)["kdf"]
    assert kdf["n"] * kdf["p"] >= 2**17 and kdf["r"] == 8
    assert 128 * kdf["r"] * kdf["n"] <= 32 * 2**20
    assert keyslots.unlock(parse_slot(real, "00000000000000bb"), "p") == private
    with pytest.raises(FormatError, match="scrypt"):
        parse_slot(cheap, "00000000000000aa")
    monkeypatch.setattr(keys, "SCRYPT_N", 2**17)
    monkeypatch.setattr(keys, "SCRYPT_P", 1)
    older, old_private = keyslots.make_slot(ring, "p", slot="00000000000000cc", label="t",
                                            created="d")
    assert (json.loads(older)["kdf"]["n"], json.loads(older)["kdf"]["p"]) == (2**17, 1)
    assert keyslots.unlock(parse_slot(older, "00000000000000cc"), "p") == old_private


def test_legacy_key_file_at_2_15_still_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A format 1 key file (keys/master) with the old cost N = 2**15 opens without the
    test variable; its holder's keyring is epoch 0 with the keys derived as before."""
    monkeypatch.delenv(keys.TEST_SCRYPT_ENV)
    monkeypatch.setattr(keys, "SCRYPT_N", 2**15)
    master = MasterKey.generate()
    data = keys.wrap(master, "p")
    assert json.loads(data)["kdf"]["n"] == 2**15 and json.loads(data)["format"] == 1
    assert keys.unwrap(data, "p").keyring() == Keyring(master.id_key, {0: master.enc_key}, 0)
    assert LocalKey.from_bytes(master.to_hex().encode()).ring == master.keyring()


def _make_legacy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, list[Path]]:
    """A repository as older metasync wrote it: repository format 3, keys/master (key
    file format 1, N = 2**15), a descriptor without MAC, the master secret in hex in
    .metasync/key."""
    from metasync import Repository, context, lifecycle

    master = MasterKey.generate()
    monkeypatch.setattr(lifecycle, "Keyring", lambda **_: master.keyring())
    monkeypatch.setattr(lifecycle, "FORMAT_VERSION", 3)
    monkeypatch.setattr(context, "FORMAT_VERSION", 3)
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "f.txt").write_text("old data\n")
    dirs = [tmp_path / "old-b0", tmp_path / "old-b1"]
    for d in dirs:
        d.mkdir()
    with Repository.init(folder, [f"dir:{d}" for d in dirs], passphrase=lambda: PASSPHRASE) as r:
        r.push("first")
    monkeypatch.undo()
    monkeypatch.setattr(keys, "SCRYPT_N", 2**15)
    monkeypatch.delenv(keys.TEST_SCRYPT_ENV)
    legacy = keys.wrap(master, PASSPHRASE)
    monkeypatch.undo()
    for d in dirs:
        for path in _key_files(d):
            path.unlink()
        (_ns(d) / "keys" / "master").write_bytes(legacy)
        desc = json.loads((_ns(d) / "metasync.json").read_bytes())
        del desc["repository"], desc["mac"]
        (_ns(d) / "metasync.json").write_text(json.dumps(desc))
    (folder / ".metasync" / "key").write_text(master.to_hex())
    return folder, dirs


def test_legacy_repository_clones_and_passwd_converts_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An older repository clones with its passphrase; key passwd from its folder
    writes a slot, authenticates the descriptors and deletes keys/master, so the old
    passphrase opens nothing and the new one clones -- to the same repository."""
    folder, dirs = _make_legacy(monkeypatch, tmp_path)
    run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "c1"))
    assert (tmp_path / "c1" / "f.txt").read_text() == "old data\n"
    fp = fingerprint(_local(folder).ring)
    run_cli("key", "passwd", cwd=folder, passphrase=None,
            env_extra={"METASYNC_NEW_PASSPHRASE": OTHER})
    for d in dirs:
        assert [p.name for p in _key_files(d)] == [_slot_of(folder)]
        assert "mac" in json.loads((_ns(d) / "metasync.json").read_bytes())
    proc = run_cli("clone", f"dir:{dirs[1]}", str(tmp_path / "c2"), check=False)
    _one_line_failure(proc, "wrong passphrase")
    run_cli("clone", f"dir:{dirs[1]}", str(tmp_path / "c3"), "--fingerprint", fp, passphrase=OTHER)
    run_cli("pull", cwd=tmp_path / "c1", passphrase=None)
    # A format 3 repository stays format 3 until a key rotation, which needs format 4.
    assert {json.loads((_ns(d) / "metasync.json").read_bytes())["format"] for d in dirs} == {3}
    (folder / "g.txt").write_text("pushed by the new code\n")
    run_cli("push", cwd=folder, passphrase=None)
    run_cli("pull", cwd=tmp_path / "c3", passphrase=None)
    assert (tmp_path / "c3" / "g.txt").exists()
    with Repository.open(folder) as repo:
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == 3
        repo.rotate_keys()
        assert repo.versions.load_config(repo.versions.learn_latest().config).format == FORMAT_VERSION
    run_cli("pull", cwd=tmp_path / "c3", passphrase=None)
    run_cli("fsck", cwd=tmp_path / "c3", passphrase=None)


def test_backend_remove_deletes_the_key_files(tmp_path: Path) -> None:
    """backend remove deletes the key files from the removed backend (when reachable)."""
    folder, dirs = _init(tmp_path, "a", n=3)
    assert _key_files(dirs[2])
    run_cli("backend", "remove", f"dir:{dirs[2]}", cwd=folder, passphrase=None)
    assert _key_files(dirs[2]) == []
    assert all(_key_files(d) for d in dirs[:2])


def _slot_edit(data: bytes, path: tuple[str, ...], value: object) -> bytes:
    doc = json.loads(data)
    where = doc
    for part in path[:-1]:
        where = where[part]
    if value is ...:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return json.dumps(doc).encode()


SLOT_DAMAGE = {
    "garbage": lambda d: b"\x00garbage",
    "json list": lambda d: b"[1]",
    "deeply nested": lambda d: b"[" * 100_000,
    "other slot id": lambda d: _slot_edit(d, ("slot",), "ffffffffffffffff"),
    "no envelope": lambda d: _slot_edit(d, ("envelope",), ...),
    "public short": lambda d: _slot_edit(d, ("public",), "AAAA"),
    "n huge": lambda d: _slot_edit(d, ("kdf", "n"), 2**21),
    "n not power of two": lambda d: _slot_edit(d, ("kdf", "n"), 2**15 + 1),
    "mac epoch string": lambda d: _slot_edit(d, ("mac", "epoch"), "0"),
    "unknown kdf": lambda d: _slot_edit(d, ("kdf", "name"), "argon2id"),
    "repository short": lambda d: _slot_edit(d, ("repository",), "ab"),
}


@pytest.mark.parametrize("damage", SLOT_DAMAGE.values(), ids=SLOT_DAMAGE.keys())
def test_damaged_slot_file_is_format_error(damage: object) -> None:
    """A damaged slot file raises FormatError, never another exception, before any
    scrypt call (a hostile backend cannot make a reader burn unbounded time)."""
    ring = MasterKey.generate().keyring()
    data, _ = keyslots.make_slot(ring, "p", slot="00000000000000cc", label="t", created="d")
    assert callable(damage)
    with pytest.raises(FormatError):
        parse_slot(damage(data), "00000000000000cc")


def test_a_client_follows_a_new_key_epoch_and_a_removed_one_cannot(tmp_path: Path) -> None:
    """After a rotation (a new keyring sealed to the remaining slots, then a
    configuration naming key epoch 1), a client of a remaining slot picks the new
    keyring up as it learns that configuration; the device of a removed slot fails in
    one line naming the fix."""
    from metasync import Repository

    folder, dirs = _init(tmp_path, "a", n=2)
    run_cli("key", "add", "--label", "bob", cwd=folder, passphrase=None,
            env_extra={"METASYNC_NEW_PASSPHRASE": OTHER})
    run_cli("clone", f"dir:{dirs[0]}", str(tmp_path / "bob"), passphrase=OTHER)
    run_cli("clone", f"dir:{dirs[1]}", str(tmp_path / "alice2"))
    run_cli("key", "remove", _slot_of(tmp_path / "bob"), cwd=folder, passphrase=None)

    alice = _local(folder)
    ring = Keyring(alice.ring.id_key, {**alice.ring.data_keys, 1: bytes(range(32))}, 1)
    backends = {str(i): open_backend(f"dir:{d}", "metasync") for i, d in enumerate(dirs)}
    assert not reseal(backends, ring).line()
    with Repository.open(folder) as r:
        r._reconfig.change_config(lambda c: replace(c, key_epoch=1))

    run_cli("pull", cwd=tmp_path / "alice2", passphrase=None)
    # Bob's pull learns the configuration naming epoch 1 and stops there.
    proc = run_cli("pull", cwd=tmp_path / "bob", passphrase=None, check=False)
    _one_line_failure(proc, "this device's key was removed", "clone again")
    run_cli("status", cwd=tmp_path / "alice2", passphrase=None)
    assert _local(tmp_path / "alice2").ring == ring
    assert 1 not in _local(tmp_path / "bob").ring.data_keys


# ------------------------------------------------------- init's key derived ahead


def test_a_key_derived_ahead_is_used_once_and_only_for_its_passphrase() -> None:
    """``init`` starts a new slot's scrypt while the program loads: the slot then
    uses that salt and key -- only under the same passphrase, and only once (a
    salt is never used twice)."""
    keys.derive_ahead("the phrase")
    ahead = keys._AHEAD[0]
    salt, cost, key = keys.new_kek("the phrase")
    assert salt == ahead.salt and cost == (keys.scrypt_write_n(), keys.SCRYPT_R, keys.SCRYPT_P)
    assert key == keys.kek("the phrase", salt, *cost)
    again = keys.new_kek("the phrase")
    assert again[0] != salt  # taken once
    keys.derive_ahead("the phrase")
    other = keys.new_kek("another phrase")
    assert other[0] != ahead.salt  # derived now, with a salt of its own
    assert other[2] == keys.kek("another phrase", other[0], *other[1])
    assert not keys._AHEAD  # the mismatched one is dropped, never used later


def test_the_key_slot_init_writes_opens_with_the_passphrase_derived_ahead(tmp_path: Path) -> None:
    """Through the slot file: made from the key derived ahead, it opens with the
    passphrase (and not with another)."""
    ring = Keyring(id_key=b"i" * 32, data_keys={0: b"d" * 32}, current=0)
    keys.derive_ahead(PASSPHRASE)
    raw, _ = keyslots.make_slot(ring, PASSPHRASE, slot="ab12cd34ef56ab78", label="here",
                                created="2026-11-27")
    slot = parse_slot(raw, "ab12cd34ef56ab78")
    assert open_envelope(slot, keyslots.unlock(slot, PASSPHRASE)) == ring
    with pytest.raises(WrongPassphrase):
        keyslots.unlock(slot, "not it")


@pytest.mark.parametrize(("argv", "ahead"), [
    (["init", "/x", "--backend", "dir:/b"], True),
    (["--quiet", "init", "/x"], True),
    (["init", "/x", "--no-encrypt"], False),
    (["clone", "dir:/b", "/x"], False),
    (["push"], False),
])
def test_only_init_with_the_passphrase_in_the_environment_derives_ahead(
    argv: list[str], ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metasync import entry

    monkeypatch.setattr(keys, "_AHEAD", [])
    monkeypatch.setenv("METASYNC_PASSPHRASE", "set")
    entry.derive_init_key_ahead(argv)
    assert bool(keys._AHEAD) == ahead
    monkeypatch.delenv("METASYNC_PASSPHRASE")
    keys._AHEAD.clear()
    entry.derive_init_key_ahead(argv)
    assert not keys._AHEAD


def test_a_key_derived_ahead_that_fails_says_nothing_until_it_is_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A passphrase that is not UTF-8 (an undecodable byte in the environment): the
    thread deriving ahead prints no traceback; the slot's own derivation fails as
    it did before there was one."""
    import threading

    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    keys.derive_ahead("\udcff")
    keys._AHEAD[0].thread.join()
    assert raised == []
    with pytest.raises(UnicodeEncodeError):
        keys.new_kek("\udcff")


# ------------------------------------------------------ clone's key derived ahead


def _slot_file(backend: Path) -> Path:
    [path] = [p for p in _key_files(backend) if keyslots.is_slot_id(p.name)]
    return path


def test_clone_from_a_folder_derives_its_slot_key_while_the_program_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``metasync clone dir:PATH`` reads the folder's key slot and starts its scrypt
    before the CLI loads; the clone's unlock takes that key -- once, and only for
    the same passphrase, salt and cost -- and the clone (the console script, which
    derives ahead) is whole."""
    from metasync import entry

    folder, dirs = _init(tmp_path, "a")
    monkeypatch.setattr(keys, "_SLOTS_AHEAD", [])
    monkeypatch.setenv("METASYNC_PASSPHRASE", PASSPHRASE)
    entry.derive_clone_key_ahead(["--quiet", "clone", f"dir:{dirs[0]}", str(tmp_path / "c")])
    [ahead] = keys._SLOTS_AHEAD
    slot_path = _slot_file(dirs[0])
    slot = parse_slot(slot_path.read_bytes(), slot_path.name)
    assert (ahead.salt, ahead.cost) == (slot.kdf[3], slot.kdf[:3])
    ahead.thread.join()
    real_scrypt = keys.Scrypt

    def no_scrypt(*args: object, **kwargs: object) -> object:
        raise AssertionError("derived again")

    with pytest.raises(WrongPassphrase):  # another passphrase: derived now, not the key ahead
        keyslots.unlock(slot, "not it")
    monkeypatch.setattr(keys, "Scrypt", no_scrypt)
    assert keyslots.unlock(slot, PASSPHRASE) == _local(folder).private
    assert not keys._SLOTS_AHEAD  # taken once
    with pytest.raises(AssertionError, match="derived again"):
        keyslots.unlock(slot, PASSPHRASE)
    monkeypatch.setattr(keys, "Scrypt", real_scrypt)
    run_cli("--quiet", "clone", f"dir:{dirs[0]}", str(tmp_path / "c"), cwd=tmp_path)
    assert snapshot(tmp_path / "c") == snapshot(folder)


def test_the_folder_clone_reads_ahead_is_where_a_dir_backend_keeps_its_slots(
        tmp_path: Path) -> None:
    from metasync import entry
    from metasync.backends.local import LocalBackend
    from metasync.layout import DEFAULT_NAMESPACE, slot_key

    backend = LocalBackend(f"dir:{tmp_path}", DEFAULT_NAMESPACE)
    assert backend._path(slot_key("ab12cd34ef56ab78")) == os.path.join(
        tmp_path, *entry.CLONE_KEYS_FOLDER, "ab12cd34ef56ab78")


def _as_link(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


CLONE_AHEAD_REFUSED = {
    "n huge": lambda p: p.write_bytes(_slot_edit(p.read_bytes(), ("kdf", "n"), 2**21)),
    "damaged": lambda p: p.write_bytes(b"[" * 100_000),
    "oversized": lambda p: p.write_bytes(p.read_bytes() + b" " * keyslots.AHEAD_FILE_BYTES),
    "a link": _as_link,
    "a fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "no keys folder": lambda p: shutil.rmtree(p.parent),
}


@pytest.mark.parametrize("spoil", CLONE_AHEAD_REFUSED.values(), ids=CLONE_AHEAD_REFUSED.keys())
def test_a_slot_file_clone_may_not_trust_is_not_derived_ahead(
        spoil: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's slot file is untrusted: a cost out of range, a damaged or
    oversized file, a link, a FIFO (never waited on), or no folder -- nothing is
    derived ahead and nothing is raised (the clone itself then reads the slots and
    says what is wrong)."""
    from metasync import entry

    _, dirs = _init(tmp_path, "a", n=1)
    assert callable(spoil)
    spoil(_slot_file(dirs[0]) if _key_files(dirs[0]) else None)
    monkeypatch.setattr(keys, "_SLOTS_AHEAD", [])
    monkeypatch.setenv("METASYNC_PASSPHRASE", PASSPHRASE)
    entry.derive_clone_key_ahead(["clone", f"dir:{dirs[0]}", str(tmp_path / "c")])
    assert not keys._SLOTS_AHEAD


@pytest.mark.parametrize(("argv", "ahead"), [
    (["clone", "dir:{b}"], True),
    (["-q", "--debug", "clone", "{b}", "/x"], True),
    (["clone", "dir:{b}", "/x", "--namespace", "n"], False),
    (["clone", "dir:{b}", "/x", "--passphrase-file", "f"], False),
    (["clone", "dir:relative", "/x"], False),
    (["clone", "sftp://host/{b}", "/x"], False),
    (["init", "/x", "--backend", "dir:{b}"], False),
])
def test_only_a_plain_clone_from_a_folder_derives_its_key_ahead(
        argv: list[str], ahead: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from metasync import entry

    _, dirs = _init(tmp_path, "a", n=1)
    args = [arg.replace("{b}", str(dirs[0])) for arg in argv]
    monkeypatch.setattr(keys, "_SLOTS_AHEAD", [])
    monkeypatch.setattr(keys, "_AHEAD", [])
    monkeypatch.setenv("METASYNC_PASSPHRASE", PASSPHRASE)
    entry.derive_clone_key_ahead(args)
    assert bool(keys._SLOTS_AHEAD) == ahead
    keys._SLOTS_AHEAD.clear()
    monkeypatch.delenv("METASYNC_PASSPHRASE")
    entry.derive_clone_key_ahead(args)
    assert not keys._SLOTS_AHEAD


def test_a_passphrase_that_is_not_utf8_text_is_a_one_line_error(tmp_path: Path) -> None:
    """A passphrase holding bytes that are not UTF-8 -- in METASYNC_PASSPHRASE (the
    environment hands them over as lone surrogates), in a passphrase file, or as the
    new passphrase of ``key passwd`` -- is refused in one line naming where it came
    from, before anything is written (before, "unexpected UnicodeEncodeError ...
    report it")."""
    backend = tmp_path / "b"
    backend.mkdir()
    folder = tmp_path / "f"
    folder.mkdir()
    proc = run_cli("init", str(folder), f"--backend=dir:{backend}", passphrase="caf\udce9",
                   check=False)
    one_line_error(proc, "METASYNC_PASSPHRASE is not UTF-8 text")
    assert proc.returncode == 2
    secret = tmp_path / "secret"
    secret.write_bytes(b"caf\xe9\n")
    proc = run_cli("init", str(folder), f"--backend=dir:{backend}", "--passphrase-file",
                   str(secret), passphrase=None, check=False)
    one_line_error(proc, f"passphrase file {secret} is not UTF-8 text")
    assert not list(backend.iterdir()) and not (folder / ".metasync").exists()
    run_cli("init", str(folder), f"--backend=dir:{backend}")
    proc = run_cli("key", "passwd", cwd=folder, check=False,
                   env_extra={"METASYNC_NEW_PASSPHRASE": "caf\udce9"})
    one_line_error(proc, "METASYNC_NEW_PASSPHRASE is not UTF-8 text")
    run_cli("status", cwd=folder)  # the old passphrase still opens it
