"""A wrapper that makes any backend misbehave on purpose, for tests.

``FaultyBackend(inner)`` does every operation of ``inner``, its log operations
included, after consulting the rules of its :class:`Faults`. A rule that matches a
call decides what goes wrong:

``refuse``
    raise (:class:`BackendError` by default, or e.g. :class:`BackendUnavailable`)
    without doing the operation;
``corrupt``
    a read (``get``, ``open``, ``get_range``, ``fetch``) returns altered bytes; a
    write (``put``, ``put_if_absent``, ``replace_if``, ``append``, ``append_at``)
    stores altered bytes. The inner backend's own reads are never altered;
``lose_answer``
    do the operation, then raise as if its reply was lost (a transient
    :class:`BackendError` by default);
``hang``
    block until the rule is released (:meth:`Rule.release`), then do the operation.

A rule matches a call by operation (the method names of ``Backend`` and
``LogStore``: :data:`OPERATIONS`), by key prefix (the key, the listing prefix or
the log name starts with it; ``""`` matches every call) and by backend (the
wrapper's ``label``; ``None`` matches every wrapper sharing the :class:`Faults`).
It fires for its first ``times`` matching calls (``ALWAYS``: every one). Of the
rules matching a call, the first added that is still live fires; calls no rule
fires for are passed through unchanged. Log operations are matched by their own
names with the log as key; the object requests the inner log store makes for them
go straight to the inner backend and are never matched.

Usage::

    faulty = FaultyBackend(MemoryBackend("memory:test-1", "ns"))
    faulty.create()
    faulty.faults.refuse("append", "log/", times=2, error=BackendUnavailable)
    faulty.faults.corrupt("get", "objects/", how="truncate", times=ALWAYS)
    stuck = faulty.faults.hang(LOG_OPERATIONS)
    ...                        # a thread calls faulty.logs.fetch("log/1") and blocks
    stuck.entered.wait(5)      # it is blocked now
    stuck.release()            # it goes on
"""

from __future__ import annotations

import builtins
import io
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, TypeVar

from metasync.backends.base import Backend, TempFile
from metasync.backends.logs import LogStore
from metasync.errors import BackendError

T = TypeVar("T")

#: Operations of the object store (``Backend``) a rule may name.
OBJECT_OPERATIONS: frozenset[str] = frozenset({
    "exists", "probe", "create", "put", "put_if_absent", "replace_if", "get", "open",
    "get_range", "size", "delete", "list", "list_sizes", "poll", "share",
})
#: Operations of the log store (``backend.logs``) a rule may name.
LOG_OPERATIONS: frozenset[str] = frozenset({"append", "append_at", "fetch", "delete_log"})
OPERATIONS: frozenset[str] = OBJECT_OPERATIONS | LOG_OPERATIONS
#: Operations whose answer ``corrupt`` alters.
READS: frozenset[str] = frozenset({"get", "open", "get_range", "fetch"})
#: Operations whose stored bytes ``corrupt`` alters.
WRITES: frozenset[str] = frozenset({"put", "put_if_absent", "replace_if", "append", "append_at"})
#: ``times=ALWAYS``: the rule fires for every matching call.
ALWAYS = None

Kind = Literal["refuse", "corrupt", "lose_answer", "hang"]
Corruption = Literal["flip", "zero", "truncate"]


def corrupted(data: bytes, how: Corruption) -> bytes:
    """``data`` altered: ``flip`` inverts the lowest bit of the middle byte, ``zero``
    makes every byte 0 (same length), ``truncate`` keeps the first half
    (``len(data) // 2`` bytes). Empty data has nothing to flip or zero."""
    if how == "truncate":
        return data[: len(data) // 2]
    if how == "zero":
        return bytes(len(data))
    if not data:
        return data
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def answer_lost(message: str) -> BackendError:
    """The default error of ``lose_answer``: transient, as a timed-out request is."""
    return BackendError(message, transient=True)


@dataclass(eq=False)
class Rule:
    """One fault, made by a :class:`Faults` method; its fields say which calls it
    matches and what it does to them (module docstring)."""

    kind: Kind
    operations: frozenset[str]
    prefix: str
    #: Matching calls it fires for; None (``ALWAYS``) for every one.
    times: int | None
    #: The label of the only wrapper it applies to; None for every wrapper.
    backend: str | None
    #: Makes the exception of ``refuse`` and ``lose_answer`` from a message.
    error: Callable[[str], BaseException] = BackendError
    #: The exception's message; None for one naming the call.
    message: str | None = None
    corruption: Corruption = "flip"
    #: Calls it fired for so far.
    fired: int = 0
    #: Set once a call blocks on this ``hang`` rule.
    entered: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """Retire the rule: it fires for no further call, and every call blocked on
        it (a ``hang``) goes on."""
        self._released.set()

    @property
    def live(self) -> bool:
        """Whether it may still fire (not used up, not released)."""
        return not self._released.is_set() and (self.times is None or self.fired < self.times)

    def matches(self, label: str, operation: str, key: str) -> bool:
        return (operation in self.operations and key.startswith(self.prefix)
                and self.backend in (None, label))

    def failure(self, label: str, operation: str, key: str) -> BaseException:
        """The exception this rule raises for the call."""
        what = "refused" if self.kind == "refuse" else "done, but its answer was lost"
        return self.error(self.message or f"{label}: {operation} {key!r} {what} (injected fault)")

    def altered(self, data: bytes) -> bytes:
        """``data`` as this rule lets it through: corrupted by a ``corrupt`` rule."""
        return corrupted(data, self.corruption) if self.kind == "corrupt" else data

    def hold(self) -> None:
        """Block the calling thread until :meth:`release`."""
        self.entered.set()
        self._released.wait()


class Faults:
    """The fault rules one or more :class:`FaultyBackend` consult, in the order added.

    Each method adds a rule and returns it (to release a hang, or read ``fired``).
    ``operations`` is one name or several (see :data:`OPERATIONS`); an unknown name
    is a :class:`ValueError`. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: builtins.list[Rule] = []

    def refuse(self, operations: str | Iterable[str], prefix: str = "", *,
               times: int | None = 1, backend: str | None = None,
               error: Callable[[str], BaseException] = BackendError,
               message: str | None = None) -> Rule:
        """Matching calls raise ``error(message)`` and do nothing."""
        return self._add(Rule("refuse", _names(operations), prefix, times, backend, error, message))

    def corrupt(self, operations: str | Iterable[str], prefix: str = "", *,
                how: Corruption = "flip", times: int | None = 1,
                backend: str | None = None) -> Rule:
        """Matching reads return, and matching writes store, bytes altered as
        :func:`corrupted` says (``fetch``: every entry's message; ``append``: the
        message). Only :data:`READS` and :data:`WRITES` may be named."""
        names = _names(operations)
        if not names <= READS | WRITES:
            raise ValueError(f"corrupt alters only reads and writes, not {sorted(names - READS - WRITES)}")
        if how not in ("flip", "zero", "truncate"):
            raise ValueError(f"corrupt how= must be flip, zero or truncate, not {how!r}")
        return self._add(Rule("corrupt", names, prefix, times, backend, corruption=how))

    def lose_answer(self, operations: str | Iterable[str], prefix: str = "", *,
                    times: int | None = 1, backend: str | None = None,
                    error: Callable[[str], BaseException] = answer_lost,
                    message: str | None = None) -> Rule:
        """Matching calls are done, then raise ``error(message)``."""
        return self._add(Rule("lose_answer", _names(operations), prefix, times, backend, error,
                              message))

    def hang(self, operations: str | Iterable[str], prefix: str = "", *,
             times: int | None = 1, backend: str | None = None) -> Rule:
        """Matching calls block until the rule is released, then are done."""
        return self._add(Rule("hang", _names(operations), prefix, times, backend))

    def release_all(self) -> None:
        """Release every ``hang`` rule (and so every call blocked on one)."""
        with self._lock:
            rules = builtins.list(self._rules)
        for rule in rules:
            if rule.kind == "hang":
                rule.release()

    def clear(self) -> None:
        """Remove every rule, releasing the hangs first."""
        self.release_all()
        with self._lock:
            self._rules.clear()

    def take(self, label: str, operation: str, key: str) -> Rule | None:
        """The rule that fires for a call of ``operation`` on ``key`` on the backend
        ``label`` (counted in its ``fired``), or None if none does."""
        with self._lock:
            for rule in self._rules:
                if rule.live and rule.matches(label, operation, key):
                    rule.fired += 1
                    return rule
        return None

    def _add(self, rule: Rule) -> Rule:
        if rule.times is not None and rule.times < 1:
            raise ValueError(f"times must be at least 1 (or ALWAYS), not {rule.times}")
        with self._lock:
            self._rules.append(rule)
        return rule


def _names(operations: str | Iterable[str]) -> frozenset[str]:
    names = frozenset([operations] if isinstance(operations, str) else operations)
    unknown = names - OPERATIONS
    if unknown or not names:
        raise ValueError(f"unknown operations {sorted(unknown)}; known: {sorted(OPERATIONS)}")
    return names


def _read_stream(data: bytes | BinaryIO) -> bytes:
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    pieces: builtins.list[bytes] = []
    while piece := data.read(1 << 20):
        pieces.append(piece)
    return b"".join(pieces)


class FaultyBackend(Backend):
    """``inner`` behind the rules of ``faults`` (a new, empty :class:`Faults` if
    None). ``label`` names this wrapper in rules (default: ``inner.name``).

    Declares ``inner``'s capabilities, name, URI and namespace; its log store
    (:class:`FaultyLogs`) is ``inner.logs`` behind the same rules. Without a
    matching rule every call behaves exactly as ``inner``'s. ``close`` is never
    faulted."""

    def __init__(self, inner: Backend, faults: Faults | None = None, *,
                 label: str | None = None) -> None:
        super().__init__(inner.uri, inner.namespace)
        #: The wrapped backend, which does the real work.
        self.inner = inner
        #: The rules this wrapper consults (add rules here).
        self.faults = faults if faults is not None else Faults()
        #: This wrapper's name in rules.
        self.label = inner.name if label is None else label
        self.capabilities = inner.capabilities
        self.scheme = inner.scheme

    @property
    def name(self) -> str:
        return self.inner.name

    # --- applying rules ----------------------------------------------------------------
    def _before(self, operation: str, key: str) -> Rule | None:
        """Consult the rules for a call about to run: a refusal raises, a hang blocks
        until released; a ``corrupt`` or ``lose_answer`` rule is returned for the
        call to apply (:meth:`Rule.altered`, :meth:`_after`); else None."""
        rule = self.faults.take(self.label, operation, key)
        if rule is None:
            return None
        if rule.kind == "refuse":
            raise rule.failure(self.label, operation, key)
        if rule.kind == "hang":
            rule.hold()
            return None
        return rule

    def _after(self, rule: Rule | None, operation: str, key: str) -> None:
        """After the inner operation: a lost answer raises now."""
        if rule is not None and rule.kind == "lose_answer":
            raise rule.failure(self.label, operation, key)

    def _run(self, operation: str, key: str, action: Callable[[], T]) -> T:
        """``action()`` (an operation whose bytes no rule alters) under the rules."""
        rule = self._before(operation, key)
        result = action()
        self._after(rule, operation, key)
        return result

    def _read(self, operation: str, key: str, action: Callable[[], bytes]) -> bytes:
        rule = self._before(operation, key)
        data = action()
        self._after(rule, operation, key)
        return data if rule is None else rule.altered(data)

    # --- lifecycle -----------------------------------------------------------------------
    def exists(self) -> bool:
        return self._run("exists", "", self.inner.exists)

    def probe(self) -> None:
        self._run("probe", "", self.inner.probe)

    def create(self) -> None:
        self._run("create", "", self.inner.create)

    def close(self) -> None:
        self.inner.close()

    def sweep_temp_files(self, older_than: float, *, delete: bool) -> list[TempFile]:
        return self._run("sweep_temp_files", "",
                         lambda: self.inner.sweep_temp_files(older_than, delete=delete))

    # --- objects -------------------------------------------------------------------------
    def put(self, key: str, data: bytes | BinaryIO) -> None:
        rule = self._before("put", key)
        if rule is not None and rule.kind == "corrupt":
            data = rule.altered(_read_stream(data))
        self.inner.put(key, data)
        self._after(rule, "put", key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        rule = self._before("put_if_absent", key)
        created = self.inner.put_if_absent(key, data if rule is None else rule.altered(data))
        self._after(rule, "put_if_absent", key)
        return created

    def replace_if(self, key: str, data: bytes, token: str) -> bool:
        rule = self._before("replace_if", key)
        replaced = self.inner.replace_if(key, data if rule is None else rule.altered(data), token)
        self._after(rule, "replace_if", key)
        return replaced

    def get(self, key: str) -> bytes:
        return self._read("get", key, lambda: self.inner.get(key))

    def open(self, key: str) -> BinaryIO:
        rule = self._before("open", key)
        stream = self.inner.open(key)
        try:
            self._after(rule, "open", key)
        except BaseException:
            stream.close()
            raise
        if rule is None or rule.kind != "corrupt":
            return stream
        with stream:
            return io.BytesIO(rule.altered(_read_stream(stream)))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._read("get_range", key, lambda: self.inner.get_range(key, offset, length))

    def size(self, key: str) -> int:
        return self._run("size", key, lambda: self.inner.size(key))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return self._run("list", prefix, lambda: self.inner.list(prefix))

    def list_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self._run("list_sizes", prefix, lambda: self.inner.list_sizes(prefix))

    def poll(self, key: str) -> str | None:
        return self._run("poll", key, lambda: self.inner.poll(key))

    def share(self, email: str) -> str:
        return self._run("share", "", lambda: self.inner.share(email))

    # --- logs ----------------------------------------------------------------------------
    def specific_logs(self) -> LogStore:
        """``inner.logs`` behind this wrapper's rules (:class:`FaultyLogs`)."""
        return FaultyLogs(self)


class FaultyLogs(LogStore):
    """The log store of a :class:`FaultyBackend`: its inner backend's log store, each
    call first matched against the wrapper's rules (operation ``append``,
    ``append_at``, ``fetch`` or ``delete_log``; key: the log)."""

    def __init__(self, backend: FaultyBackend) -> None:
        #: The wrapper whose rules apply.
        self.backend = backend

    @property
    def primitive(self) -> str:
        """What the inner backend's appends rest on."""
        return self.backend.inner.logs.primitive

    def append(self, log: str, message: bytes) -> int:
        faulty = self.backend
        rule = faulty._before("append", log)
        position = faulty.inner.logs.append(log, message if rule is None else rule.altered(message))
        faulty._after(rule, "append", log)
        return position

    def append_at(self, log: str, position: int, message: bytes) -> bool:
        faulty = self.backend
        rule = faulty._before("append_at", log)
        written = faulty.inner.logs.append_at(
            log, position, message if rule is None else rule.altered(message))
        faulty._after(rule, "append_at", log)
        return written

    def fetch(self, log: str, start: int = 0) -> builtins.list[tuple[int, bytes]]:
        faulty = self.backend
        rule = faulty._before("fetch", log)
        entries = faulty.inner.logs.fetch(log, start)
        faulty._after(rule, "fetch", log)
        return entries if rule is None else [(p, rule.altered(m)) for p, m in entries]

    def delete_log(self, log: str) -> int:
        return self.backend._run("delete_log", log, lambda: self.backend.inner.logs.delete_log(log))
