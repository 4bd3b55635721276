"""metasync: one folder kept in sync across several untrusted storage services.

The public API is :class:`Repository`; see README.md for the command line.
"""

from metasync.errors import MetasyncError
from metasync.repository import Repository

__all__ = ["MetasyncError", "Repository"]
#: The package version (pyproject.toml reads it from here; `metasync --version` shows it).
__version__ = "0.1.0"
