"""The benchmarks' synthetic workloads, generated deterministically and cached.

The paper (section 5.3) uses three workloads; the Linux source tree is
``linux_workload.py``. The other two are not available as files, so they are
generated from a fixed seed (the same bytes on every machine and every run):

``paper``
    The "MetaSync paper" workload: a LaTeX paper being written, about 70 files
    and 1.6 MB in 3 folders. ``paper/``: 24 ``.tex`` sections, a ``.bib``, a
    ``.sty``, a Makefile and notes (text made of words drawn from a fixed
    vocabulary, ~560 kB); ``paper/figs/``: 34 figures (PDF/PNG-like: a short
    header then incompressible bytes, as compressed images are, ~980 kB);
    ``paper/data/``: 10 small CSV files of measurements (~60 kB).
``photos``
    The "photo sharing" workload: 50 incompressible files (a JPEG-like header
    then random bytes), 2.9 to 4.9 MB each, 193 MB in all.
``small-<N>``
    A synthetic tree of ``N`` small files for scale: 100 files per folder, 100
    folders per parent (``d0042/d0017/f00093.txt``), each file 20-1000 bytes
    of text (a line naming the file, then pseudo-random hex words). Used with
    N = 100,000 and N = 1,000,000.

Every workload is built in a temporary folder and renamed into place, with a
marker file recording its counts; a later run reuses it if the counts still
match. ``modify_tree`` makes the "small incremental change" every tool syncs.

    python bench/workloads.py [paper|photos|small-100000 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_WORK = BENCH_DIR / "work"
MARKER_VERSION = 1

_VOCAB = ["the", "of", "a", "to", "and", "in", "is", "that", "for", "we", "on", "with", "as", "are", "by", "this", "it", "each", "be", "from", "an", "storage", "service", "services", "backend", "backends", "client", "clients", "file", "files", "object", "objects", "sync", "synchronization", "consensus", "paxos", "ppaxos", "proposer", "acceptor", "log", "logs", "append", "fetch", "commit", "master", "head", "version", "tree", "blob", "chunk", "hash", "mapping", "replica", "replication", "capacity", "latency", "bandwidth", "throughput", "evaluation", "workload", "dropbox", "google", "box", "onedrive", "baidu", "metasync", "user", "users", "folder", "directory", "reliable", "available", "consistent", "untrusted", "encryption", "integrity", "translator", "deterministic", "stable", "partition", "virtual", "node", "nodes", "failure", "failures", "byzantine", "crash", "round", "trip", "protocol", "design", "implementation", "system", "systems", "performance", "clone", "push", "pull"]


def log(msg: str) -> None:
    print(f"[workload] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Tree:
    """A prepared workload tree."""

    name: str
    path: Path
    files: int
    bytes: int
    note: str

    def describe(self) -> str:
        return f"{self.name}: {self.files} files, {self.bytes / 1e6:.1f} MB ({self.note})"

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "path": str(self.path), "files": self.files,
                "bytes": self.bytes, "note": self.note}


def count(root: Path) -> tuple[int, int]:
    """(regular files, bytes) under ``root``."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            files += 1
            size += os.lstat(os.path.join(dirpath, name)).st_size
    return files, size


def _text(rng: random.Random, size: int) -> bytes:
    words: list[str] = []
    length = 0
    line = 0
    while length < size:
        w = rng.choice(_VOCAB)
        words.append(w)
        length += len(w) + 1
        line += len(w) + 1
        if line > 72:
            words.append("\n")
            line = 0
    return " ".join(words).replace(" \n ", "\n").encode()[:size]


def _binary(rng: random.Random, header: bytes, size: int) -> bytes:
    return header + rng.randbytes(max(0, size - len(header)))


def build_paper(dest: Path) -> str:
    rng = random.Random(2014_10_11)
    text_dir, figs, data = dest / "paper", dest / "paper" / "figs", dest / "paper" / "data"
    for d in (text_dir, figs, data):
        d.mkdir(parents=True)
    sections = ["abstract", "intro", "background", "overview", "design", "ppaxos",
                "mapping", "translators", "sharing", "gc", "implementation", "eval",
                "eval-paxos", "eval-mapping", "eval-e2e", "related", "conclusion", "ack",
                "appendix-a", "appendix-b", "appendix-c", "macros", "main", "response"]
    for name in sections:
        (text_dir / f"{name}.tex").write_bytes(_text(rng, rng.randint(8_000, 36_000)))
    (text_dir / "ref.bib").write_bytes(_text(rng, 48_000))
    (text_dir / "sigplanconf.sty").write_bytes(_text(rng, 30_000))
    (text_dir / "Makefile").write_bytes(b"all:\n\tpdflatex main && bibtex main && pdflatex main\n")
    (text_dir / "NOTES.txt").write_bytes(_text(rng, 4_000))
    for i in range(34):
        ext, header = (".pdf", b"%PDF-1.5\n") if i % 2 == 0 else (".png", b"\x89PNG\r\n\x1a\n")
        (figs / f"fig{i:02d}{ext}").write_bytes(_binary(rng, header, rng.randint(12_000, 46_000)))
    for i in range(10):
        rows = "\n".join(",".join(f"{rng.random() * 100:.3f}" for _ in range(6)) for _ in range(110))
        (data / f"run{i}.csv").write_text("a,b,c,d,e,f\n" + rows + "\n")
    return "generated (seed 20141011): 24 .tex + bib/sty/Makefile/notes, 34 figures, 10 CSV"


def build_photos(dest: Path) -> str:
    rng = random.Random(193)
    album = dest / "photos"
    album.mkdir(parents=True)
    sizes = [rng.randint(2_900_000, 4_900_000) for _ in range(50)]
    scale = 193_000_000 / sum(sizes)
    for i, size in enumerate(sizes):
        header = b"\xff\xd8\xff\xe1" + f"Exif IMG_{i:04d}".encode()
        with open(album / f"IMG_{1000 + i:04d}.jpg", "wb") as fh:
            left = int(size * scale)
            fh.write(header)
            left -= len(header)
            while left > 0:
                piece = min(left, 1 << 20)
                fh.write(rng.randbytes(piece))
                left -= piece
    return "generated (seed 193): 50 JPEG-like files of random bytes"


def build_small(files: int) -> Callable[[Path], str]:
    def build(dest: Path) -> str:
        rng = random.Random(files)
        for i in range(files):
            top, mid, leaf = i // 10_000, (i // 100) % 100, i % 100
            folder = dest / f"d{top:04d}" / f"d{mid:04d}"
            if leaf == 0:
                folder.mkdir(parents=True)
            size = rng.randint(20, 1000)
            head = f"file {i}\n".encode()
            body = rng.randbytes((size - len(head)) // 2 + 1).hex().encode()
            with open(folder / f"f{leaf:05d}.txt", "wb") as fh:
                fh.write((head + body)[:size])
            if i and i % 100_000 == 0:
                log(f"  {i} files")
        return f"generated (seed {files}): 100 files per folder, 20-1000 bytes of text each"

    return build


def builders() -> dict[str, Callable[[Path], str]]:
    return {"paper": build_paper, "photos": build_photos}


def prepare(name: str, work: Path = DEFAULT_WORK) -> Tree:
    """Build (or reuse) workload ``name`` (``paper``, ``photos``, ``small-N``)."""
    if name.startswith("small-"):
        build = build_small(int(name.removeprefix("small-")))
    else:
        build = builders()[name]
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tree = work / f"{name}-tree"
    marker = work / f"{name}-tree.json"
    if marker.is_file() and tree.is_dir():
        try:
            data = json.loads(marker.read_text())
            if data.get("marker_version") == MARKER_VERSION and (
                data["files"], data["bytes"]) == count(tree):
                log(f"reusing {tree}")
                return Tree(name, tree, data["files"], data["bytes"], data["note"])
        except (OSError, ValueError, KeyError):
            pass
    log(f"generating {name} in {tree}")
    start = time.monotonic()
    marker.unlink(missing_ok=True)
    if tree.exists():
        shutil.rmtree(tree)
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=work) as tmp:
        staged = Path(tmp) / "tree"
        staged.mkdir()
        note = build(staged)
        staged.rename(tree)
    files, size = count(tree)
    marker.write_text(json.dumps({"marker_version": MARKER_VERSION, "files": files,
                                  "bytes": size, "note": note}) + "\n")
    log(f"generated {name}: {files} files, {size} bytes in {time.monotonic() - start:.0f} s")
    return Tree(name, tree, files, size, note)


def modify_tree(root: Path, seed: int = 6) -> dict[str, int]:
    """The "small incremental change": edit 5 files, add 2, delete 1 (deterministic
    for a given tree). Edits write a new file and rename it over the old one, so a
    tree of hard links to a shared original changes only its own copy."""
    files = sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, dirs, names in os.walk(root)
        for n in names
        if not (d == str(root) and n.startswith("."))
        and ".metasync" not in os.path.relpath(d, root).split(os.sep)
    )
    rng = random.Random(seed)
    picks = rng.sample(files, min(6, len(files)))
    edited, deleted = picks[:5], picks[5:]
    for rel in edited:
        path = root / rel
        data = path.read_bytes()
        tmp = path.with_name(path.name + ".bench-edit")
        tmp.write_bytes(data + b"\n% edited by the benchmark\n")
        tmp.replace(path)
    for rel in deleted:
        (root / rel).unlink()
    parent = (root / picks[0]).parent
    for i in range(2):
        (parent / f"bench-added-{i}.txt").write_bytes(_text(rng, 5_000))
    return {"edited": len(edited), "added": 2, "deleted": len(deleted)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=["paper", "photos"])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    args = parser.parse_args(argv)
    for name in args.names:
        print(prepare(name, args.work).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
