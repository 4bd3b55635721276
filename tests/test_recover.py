"""`metasync recover`: a majority of backends lost for good (issue 15, point 3).

R=3 over 3: every object is on every backend. Two providers close the user's
accounts. The third holds every byte, and pPaxos rightly refuses to decide with
one of three acceptors; `recover` is the explicit way out, and a client that can
still reach the lost backends must not go on using them.
"""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli, snapshot

TIMEOUT = ("--timeout", "10")


def test_recover_from_the_one_backend_left(tmp_path: Path) -> None:
    b = {n: tmp_path / n for n in ("b1", "b2", "b3", "b4")}
    for d in b.values():
        d.mkdir()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first\n")
    (src / "docs").mkdir()
    (src / "docs" / "report.txt").write_bytes(bytes(range(256)) * 400)
    out = run_cli("init", "--replicas", "3",
                  *(f"--backend=dir:{b[n]}" for n in ("b1", "b2", "b3")), cwd=src).stdout
    fingerprint = out.split("Fingerprint: ")[1].split()[0]
    run_cli("push", cwd=src)
    old = tmp_path / "old"  # another computer, on the old configuration
    run_cli("clone", f"dir:{b['b3']}", str(old))
    (src / "a.txt").write_text("the last pushed version\n")
    (src / "b.txt").write_text("new in the last push\n")
    run_cli("push", cwd=src)
    away = {n: b[n].rename(b[n].with_name(n + "-away")) for n in ("b1", "b2")}

    # A plain clone says, in one line, that recover exists.
    refused = run_cli(*TIMEOUT, "clone", f"dir:{b['b3']}", str(tmp_path / "plain"), check=False)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "metasync recover" in refused.stderr, refused.stderr
    assert not (tmp_path / "plain").exists()

    # Without --yes and no terminal, nothing is written anywhere.
    before = snapshot(b["b3"])
    unconfirmed = run_cli("recover", "--backend", f"dir:{b['b3']}", str(tmp_path / "rec"),
                          check=False)
    assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr, unconfirmed.stderr
    assert snapshot(b["b3"]) == before and not (tmp_path / "rec").exists()

    rec = tmp_path / "rec"
    done = run_cli(*TIMEOUT, "recover", "--backend", f"dir:{b['b3']}",
                   "--add-backend", f"dir:{b['b4']}", "--yes", str(rec))
    assert "must not go on using them" in done.stderr, done.stderr
    assert "R = 2" in done.stdout, done.stdout
    assert snapshot(rec) == snapshot(src), "the last pushed tree, byte for byte"

    (rec / "c.txt").write_text("pushed after the recovery\n")
    run_cli(*TIMEOUT, "push", cwd=rec)
    for entry in ("b3", "b4"):
        # The recovered repository is the same repository: same id, same fingerprint.
        fresh = tmp_path / f"fresh-{entry}"
        run_cli(*TIMEOUT, "clone", f"dir:{b[entry]}", str(fresh), "--fingerprint", fingerprint)
        assert snapshot(fresh) == snapshot(rec)
    run_cli(*TIMEOUT, "fsck", cwd=rec)

    # The old computer can reach the "lost" backends again: it must not use them.
    for n, path in away.items():
        path.rename(b[n])
    (old / "local.txt").write_text("an unpushed change\n")
    kept = snapshot(old)
    for command in ("push", "pull"):
        proc = run_cli(*TIMEOUT, command, cwd=old, check=False)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert "recovered" in proc.stderr and "clone the repository again" in proc.stderr
        assert snapshot(old) == kept, "its local changes stay"
    fresh = tmp_path / "after"
    run_cli(*TIMEOUT, "clone", f"dir:{b['b3']}", str(fresh))
    assert snapshot(fresh) == snapshot(rec), "the refused client changed nothing"


def test_recover_refuses_a_survivor_that_says_unencrypted(tmp_path: Path) -> None:
    """As a clone does: a survivor whose descriptor says the repository is not
    encrypted (a backend can rewrite it so) is refused in one line unless
    --no-encrypt is given; a repository that really is unencrypted recovers with it."""
    import json

    from conftest import one_line_error

    for encrypted in (True, False):
        b = {n: tmp_path / f"{n}-{encrypted}" for n in ("b1", "b2", "b3")}
        for d in b.values():
            d.mkdir()
        src = tmp_path / f"src-{encrypted}"
        src.mkdir()
        (src / "a.txt").write_text("data\n")
        run_cli("init", "--replicas", "3", *([] if encrypted else ["--no-encrypt"]),
                *(f"--backend=dir:{d}" for d in b.values()), cwd=src)
        run_cli("push", cwd=src)
        desc = b["b3"] / "metasync" / "metasync.json"
        if encrypted:  # the survivor lies
            doc = json.loads(desc.read_text())
            doc["encryption"] = "none"
            desc.write_text(json.dumps(doc))
        rec = tmp_path / f"rec-{encrypted}"
        proc = run_cli(*TIMEOUT, "recover", "--backend", f"dir:{b['b3']}", "--yes", str(rec),
                       check=False)
        one_line_error(proc, "not encrypted", "--no-encrypt")
        assert not rec.exists()
        if not encrypted:
            run_cli(*TIMEOUT, "recover", "--backend", f"dir:{b['b3']}", "--yes", "--no-encrypt",
                    str(rec))
            assert (rec / "a.txt").read_text() == "data\n"
