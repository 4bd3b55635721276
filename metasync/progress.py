"""Progress reporting hooks. The core reports; the CLI decides how to show it."""

from __future__ import annotations

from typing import Protocol


class Reporter(Protocol):
    """Receives progress of one transfer phase at a time (bytes)."""

    def start(self, label: str, total: int) -> None: ...

    def advance(self, amount: int) -> None: ...

    def finish(self) -> None: ...

    def note(self, message: str) -> None:
        """A line worth telling the user (a conflict copy, a skipped file)."""
        ...


class NullReporter:
    """Reports nothing; notes are collected so scripts can read them."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def start(self, label: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)
