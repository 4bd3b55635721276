"""metasync: one folder kept in sync across several untrusted storage services.

The public API is :class:`Repository`; see README.md for the command line.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's: importing typing costs start-up time
if TYPE_CHECKING:
    from typing import Any

    from metasync.errors import MetasyncError
    from metasync.repository import Repository

__all__ = ["MetasyncError", "Repository"]


def __getattr__(name: str) -> Any:
    """``Repository`` and ``MetasyncError``, imported on first use: a command that
    needs neither (``metasync status`` answered by the daemon) does not pay for
    loading the whole package."""
    if name == "Repository":
        from metasync.repository import Repository

        return Repository
    if name == "MetasyncError":
        from metasync.errors import MetasyncError

        return MetasyncError
    raise AttributeError(f"module 'metasync' has no attribute {name!r}")
#: The package version (pyproject.toml reads it from here; `metasync --version` shows it).
__version__ = "0.1.0"
