"""``metasync.Repository``: the Python API the CLI is a thin layer over.

A repository is a working folder with a ``.metasync`` folder inside, bound to
a namespace on several backends. The flow of a change (paper Figure 3):
``commit`` turns changed files into objects packed into the outbox; ``push``
uploads the outbox to the mapped backends (data before anything refers to it),
then runs pPaxos to make the new commit master; ``pull`` learns master and
brings it into the folder without losing a local change.

:class:`Repository` is a facade: each method is a line or two calling the part
that does the work (docs/design.md, "Layers"). Creating a repository and
cloning one are :mod:`metasync.lifecycle`'s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metasync.backends import Backend
from metasync.checkout import Checkout, PullResult
from metasync.committer import Change, CommitResult, Committer, Status
from metasync.context import RepoContext, open_context
from metasync.errors import NotARepository, UsageError
from metasync.graph import ObjectGraph
from metasync.layout import DEFAULT_NAMESPACE
from metasync.localdb import OUTSIDE
from metasync.objects import Commit, Config, TreeEntry, Version
from metasync.outbox import Outbox
from metasync.ownership import find_root, set_trusted
from metasync.progress import Reporter
from metasync.replicator import Replicator
from metasync.repo_admin import RepositoryAdmin
from metasync.scanner import Scanner
from metasync.store import RemoteStore
from metasync.timeouts import wait_bound
from metasync.versions import Versions

# The parts `status` and `commit` never use load on first use (start-up time):
# sync, history, fsck, lifecycle and maintenance.
if TYPE_CHECKING:
    from metasync.consensus import Consensus
    from metasync.fsck import FsckProblem, FsckReport
    from metasync.history import History, LogEntry, RestoreResult
    from metasync.maintenance.recover import RecoverResult
    from metasync.reader import VersionReader
    from metasync.sparse import Sparse
    from metasync.sync import PushResult, Sync

PassphraseSource = Callable[[], str]

#: Result types re-exported here, loaded with their modules on first use.
_LAZY = {"FsckProblem": "metasync.fsck", "FsckReport": "metasync.fsck",
         "LogEntry": "metasync.history", "RestoreResult": "metasync.history",
         "PushResult": "metasync.sync"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DEFAULT_NAMESPACE",
    "Change",
    "CommitResult",
    "FsckProblem",
    "FsckReport",
    "LogEntry",
    "PullResult",
    "PushResult",
    "Repository",
    "RestoreResult",
    "Status",
]


class Repository(RepositoryAdmin):
    """A metasync working folder. Open with :meth:`open`, :meth:`init` or :meth:`clone`."""

    def __init__(self, ctx: RepoContext) -> None:
        self._ctx = ctx
        self.versions = Versions(ctx)
        self.graph = ObjectGraph(ctx)
        self.replicator = Replicator(ctx.codec, ctx.store, ctx.db, ctx.reporter)
        self.outbox = Outbox(ctx, self.graph, self.replicator)
        self.scanner = Scanner(ctx)
        self.checkout = Checkout(ctx, self.graph, self.scanner)
        self.committer = Committer(ctx, self.graph, self.scanner, self.outbox, self.checkout)

    @cached_property
    def sync(self) -> Sync:
        from metasync.sync import Sync

        return Sync(self._ctx, self.versions, self.graph, self.scanner, self.outbox,
                    self.replicator, self.checkout, self.committer)

    @cached_property
    def history(self) -> History:
        from metasync.history import History

        return History(self._ctx, self.versions, self.graph, lambda: self.scanner.traits)

    # ============================================================== lifecycle
    @classmethod
    def init(
        cls,
        root: str | Path,
        backend_uris: list[str],
        *,
        replicas: int = 2,
        namespace: str = DEFAULT_NAMESPACE,
        encrypt: bool = True,
        passphrase: PassphraseSource | None = None,
        capacities: list[float] | None = None,
        byzantine: bool = False,
        erasure: tuple[int, int] | None = None,
        reporter: Reporter | None = None,
        mkdir: bool = False,
    ) -> Repository:
        """Create a repository in ``root`` on the given backends (see
        :func:`metasync.lifecycle.create`: everything is validated before anything
        is written; ``mkdir`` creates missing ``dir:`` folders)."""
        from metasync import lifecycle

        path = lifecycle.create(
            root, backend_uris, replicas=replicas, namespace=namespace, encrypt=encrypt,
            passphrase=passphrase, capacities=capacities, byzantine=byzantine, erasure=erasure,
            mkdir=mkdir)
        return cls(open_context(path, reporter))

    @classmethod
    def open(cls, path: str | Path = ".", reporter: Reporter | None = None,
             wait: float | None = None, *, read_only: bool = False) -> Repository:
        """Open the repository containing ``path`` (``~`` expanded; it must exist),
        searching upwards as git does. While another process (the daemon, another
        command) has the folder, wait up to ``wait`` s (default: ``--timeout``, 30) --
        or, ``read_only`` (status, log, backend list), read what it committed so far.
        A ``.metasync`` another user owns or can write to is refused
        (:class:`~metasync.errors.UnsafeRepository`) unless trusted (:meth:`trust`)."""
        path = Path(path).expanduser()
        if not path.exists():
            raise UsageError(f"{path.absolute()} does not exist; give a repository's folder")
        root = find_root(path)
        if root is None:
            raise NotARepository(f"{path.absolute()} is not inside a metasync repository; "
                                 "run `metasync init` or `metasync clone`")
        return cls(open_context(root, reporter, wait_bound() if wait is None else wait,
                                read_only=read_only))

    @staticmethod
    def trust(folder: str | Path, trusted: bool = True) -> Path:
        """Open ``folder``'s repository from now on although another user owns its
        ``.metasync`` (like git's ``safe.directory``; per user, in
        ``<config dir>/trusted-folders``), or with ``trusted=False`` stop. Returns
        the folder's absolute path."""
        return set_trusted(folder, trusted)

    @classmethod
    def clone(
        cls,
        uri: str,
        root: str | Path,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        passphrase: PassphraseSource | None = None,
        reporter: Reporter | None = None,
        allow_unencrypted: bool = False,
        fingerprint: str | None = None, connect: list[str] | None = None,
        sparse: list[str] | None = None,
    ) -> Repository:
        """Rebuild the folder from any one backend of a repository into ``root``: an
        unencrypted one only with ``allow_unencrypted``; ``fingerprint`` pins it (see
        :func:`metasync.lifecycle.prepare_clone`); ``connect``: see :func:`open_context`;
        ``sparse``: check out only what these patterns select (docs/sparse.md).

        Everything that can fail on bad input (not a repository, wrong passphrase,
        ``root`` not empty) is checked before anything is written; a clone that
        fails later removes what it created, and only that
        (:meth:`metasync.lifecycle.CloneStart.undo`). A ``root`` holding an interrupted clone
        of this repository is finished instead (:func:`metasync.lifecycle.clone_folder`)."""
        from metasync import lifecycle
        from metasync.faults import crash_point
        from metasync.selection import check_patterns

        patterns = check_patterns(sparse) if sparse is not None else None
        start = lifecycle.prepare_clone(uri, root, namespace=namespace, passphrase=passphrase,
                                        allow_unencrypted=allow_unencrypted, pinned=fingerprint,
                                        others=connect, sparse=patterns)
        repo = cls(open_context(start.root, reporter, typed=connect))
        if start.resumed:
            repo.reporter.note(f"resuming the interrupted clone in {start.root}")

        def first_pull() -> None:
            state = repo._ctx.state
            if state.head is None and state.checkout_pending is None:  # nothing written yet
                if patterns is not None or not start.resumed:
                    state.sparse_patterns = patterns or []
                if start.entry_id in state.uri_overrides:  # else resumed from another backend
                    repo.versions.start_from_hint(start.entry_id)
                crash_point("clone:hinted")
            repo.pull()

        start.finish(first_pull, repo.close, repo._ctx.written_in_place, repo._ctx.chunker)
        return repo

    @classmethod
    def recover(
        cls,
        uris: list[str],
        root: str | Path,
        *,
        add: list[str] | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        passphrase: PassphraseSource | None = None,
        confirm: Callable[[str], bool],
        reporter: Reporter | None = None,
        allow_unencrypted: bool = False,
    ) -> tuple[Repository, RecoverResult]:
        """Rebuild a repository whose majority of backends is gone for good from the
        backends ``uris`` that survived, into ``root`` (see
        :mod:`metasync.maintenance.recover`): restore the newest version whose whole
        tree they hold, then -- once ``confirm(explanation)`` is true -- make them
        (and ``add``) a new configuration, retire the old ones and copy everything
        back to R copies. Nothing is written to a backend before ``confirm``; a
        failure before it removes what was created locally."""
        from metasync.maintenance import recover as recovery

        plan = recovery.prepare(uris, root, namespace=namespace, passphrase=passphrase,
                                allow_unencrypted=allow_unencrypted)
        repo = cls(open_context(plan.root, reporter))
        try:
            work = recovery.Recovery(repo._ctx, repo.versions, repo.graph, repo.checkout,
                                     repo.replicator, plan)
            result = work.restore_newest()
            if not confirm(recovery.explain(plan, result)):
                raise UsageError("recovery cancelled; nothing was written to any backend")
            work.reform(result, list(add or ()), repo._reconfig)
        except BaseException:
            repo.close()
            plan.undo()
            raise
        return repo, result

    def close(self) -> None:
        self._ctx.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ============================================================== what it is
    @property
    def root(self) -> Path:
        return self._ctx.root

    @property
    def meta(self) -> Path:
        """The ``.metasync`` folder."""
        return self._ctx.meta

    @property
    def fingerprint(self) -> str | None:
        """The repository's fingerprint (``clone --fingerprint``); None if unencrypted."""
        from metasync.keys import fingerprint

        ring = self._ctx.codec.keyring
        return fingerprint(ring) if ring is not None else None


    @property
    def unfinished_clone(self) -> bool:
        """True for a clone stopped before its first pull ended: the folder may hold
        part of the tree; ``pull`` (or the same ``clone`` again) finishes it."""
        return self._ctx.state.unfinished_clone

    @property
    def config(self) -> Config:
        """The configuration of ``prev``: its mapping places new objects."""
        return self.versions.config

    @property
    def config_id(self) -> str:
        return self.versions.config_id

    @property
    def backends(self) -> dict[str, Backend]:
        """The backends of :attr:`config`, by id."""
        return self.versions.backends

    @property
    def store(self) -> RemoteStore:
        """The replicated object store (for tools and tests that measure transfers)."""
        return self._ctx.store

    @property
    def consensus(self) -> Consensus:
        """pPaxos over the acceptors of :attr:`config`."""
        return self.versions.consensus

    @property
    def prev(self) -> Version:
        """The last decided version this client synchronised with."""
        return self._ctx.state.prev

    @property
    def head(self) -> str | None:
        """This client's latest local commit."""
        return self._ctx.state.head

    @property
    def reporter(self) -> Reporter:
        """Where progress and notes go."""
        return self._ctx.reporter

    @reporter.setter
    def reporter(self, reporter: Reporter) -> None:
        self._ctx.reporter = reporter
        self.replicator.reporter = reporter

    @property
    def client_id(self) -> str:
        return self._ctx.client_id

    @property
    def device(self) -> str:
        return self._ctx.device

    # ============================================================== sync
    def status(self) -> Status:
        return self.committer.status()

    def keep_status_answer(self, st: Status, answer: dict[str, Any]) -> None:
        """Keep ``answer`` (what an offline ``status`` printed for ``st``) for the next
        ``status --offline`` to print while nothing changed (:mod:`metasync.quickstatus`)."""
        self.committer.keep_quick_answer(st, answer)

    def commit(self, message: str = "") -> CommitResult | None:
        return self.committer.commit(message)

    def push(self, message: str = "") -> PushResult:
        self._recheck_primitives()
        return self.sync.push(message)

    def pull(self) -> PullResult:
        self._recheck_primitives()
        return self.sync.pull()

    def _recheck_primitives(self) -> None:
        """Check again the primitives of backends whose last check is old (or missing:
        a clone's first pull), at most once per backend per period
        (:mod:`metasync.verification`)."""
        from metasync import verification

        verification.recheck(self._ctx.state, self.versions.backends)

    def learn_latest(self) -> Version:
        """The newest decided version (following configuration changes)."""
        return self.versions.learn_latest()

    def queued(self) -> list[tuple[str, str]]:
        """``(stored id, kind)`` of every object committed here and not uploaded yet."""
        return self._ctx.db.outbox()

    def repair_copies(self) -> int:
        """Bring copies home: those this client's uploads missed and those any
        client spilled to other backends (from verified copies); returns how many
        of this client's missing copies remain."""
        return self.replicator.repair_missing()

    def missing_copies(self) -> list[tuple[str, str]]:
        """``(stored id, backend id)`` of copies a backend refused, not yet rewritten."""
        return self._ctx.db.missing_copies()

    def tracked_files(self) -> int:
        """Files and links the working-tree index knows (what a deletion is measured
        against), but for those outside this machine's sparse selection (not here)."""
        return sum(1 for row in self._ctx.db.iter_index_rows()
                   if row.type != "dir" and row.mtime_ns != OUTSIDE)

    def health(self) -> dict[str, str]:
        """Backend id -> why it failed in this session (unreachable in a transfer,
        or failing in the last agreement) or is full (``full: why``, also from
        earlier sessions while copies wait for room there); backends not listed
        were fine."""
        health = {b: f"unreachable: {why}" for b, why in self._ctx.store.down.items()}
        health.update(self.versions.consensus_errors())
        health.update({b: f"full: {why}" for b, why in self._ctx.note_full_backends().items()})
        return health

    def backend_requests(self) -> dict[str, int]:
        """Backend id -> requests this repository handle made to it (``/metrics``)."""
        return self._ctx.pool.requests()

    def backend_latencies(self) -> dict[str, float]:
        """Backend id -> seconds the last small request of this repository handle to
        it took (``latency_ms``), for the backends that answered one."""
        return self._ctx.pool.latencies()

    def acceptor_uris(self) -> dict[str, str]:
        """The URI this client uses for each acceptor of :attr:`config`, by id."""
        return self.versions.acceptor_uris()

    def backend_name(self, backend_id: str) -> str:
        return self._ctx.pool.name(backend_id)

    # ============================================================== objects and history
    def load_config(self, config_id: str) -> Config:
        return self.versions.load_config(config_id)

    def load_commit(self, commit_id: str) -> Commit:
        return self.graph.load_commit(commit_id)

    def tree_at(self, commit_id: str) -> dict[str, TreeEntry]:
        """Every path of a commit's tree (flattened)."""
        return self.graph.tree_at(commit_id)

    def flatten(self, tree_id: str | None) -> dict[str, TreeEntry]:
        return self.graph.flatten(tree_id)

    def log(self, limit: int | None = None) -> list[LogEntry]:
        return self.history.log(limit)

    def restore(self, path: str, version: str | None = None,
                to: str | Path | None = None) -> RestoreResult:
        return self.history.restore(path, version, to)

    def fsck(self, *, quick: bool = False, repair: bool = False) -> FsckReport:
        from metasync.fsck import Fsck

        return Fsck(self._ctx, self.versions, self.graph, self.replicator).run(
            quick=quick, repair=repair)

    def version_reader(self, **options: Any) -> VersionReader:  # `metasync mount`
        """Every version's trees and files, read by range (:class:`metasync.reader.VersionReader`)."""
        from metasync.reader import VersionReader
        return VersionReader(self._ctx, self.versions, self.graph, **options)

    # ============================================================== sparse selection
    @cached_property
    def sparse(self) -> Sparse:
        """This machine's selection (docs/sparse.md): ``patterns()``, ``set``, ``add``,
        ``off``, ``outside_count()``, ``outside_changes(commit_id)``."""
        from metasync.sparse import Sparse

        return Sparse(self._ctx, self.graph, self.scanner, self.checkout)
