"""A wsgidav filesystem provider whose MOVE onto an existing file is one ``rename``,
and whose GET serves one version of a file.

Loaded by the wsgidav server process that ``tests/servers/webdav.py`` starts (through
wsgidav's ``provider_mapping`` ``{"class": ...}`` option), never by the tests.

Why: stock wsgidav (4.4) answers ``MOVE`` with ``Overwrite: T`` onto an existing file
by *deleting* the destination and then renaming the source (request_server.py,
``_copy_or_move``; Apache mod_dav does the same). For a moment the key does not
exist: a concurrent GET gets 404 and a concurrent PROPFIND misses it, which breaks
the ``webdav:`` backend's atomic ``put`` and the Disk Paxos logs built on it. Servers
whose MOVE is a plain ``rename(2)`` (nginx's dav module, for one) replace the file
atomically; this provider gives wsgidav that behaviour via its documented
``handle_move`` hook.

Likewise stock wsgidav takes a file's size (for Content-Length) from an ``os.stat``
when it looks the resource up, and opens the file by name later: a file replaced in
between is served as the old length of the new bytes. This provider opens the file
first and takes the size from that open file, as Apache and nginx do. Nothing else
changes.
"""

from __future__ import annotations

import os
from typing import Any

from wsgidav.fs_dav_provider import FileResource, FilesystemProvider


class _AtomicMoveFile(FileResource):  # type: ignore[misc]
    def __init__(self, path: str, environ: dict[str, Any], file_path: str) -> None:
        super().__init__(path, environ, file_path)
        self._handle: Any = None
        if environ.get("REQUEST_METHOD") in ("GET", "HEAD"):
            try:
                self._handle = open(file_path, "rb")  # noqa: SIM115 - handed to wsgidav
                self.file_stat = os.fstat(self._handle.fileno())
            except OSError:
                self._handle = None

    def get_content(self) -> Any:
        """The file opened when the size was taken (wsgidav closes it)."""
        if self._handle is None:
            return super().get_content()
        handle, self._handle = self._handle, None
        return handle

    def handle_move(self, dest_path: str) -> bool:
        """Rename over a file (or onto a free name) in one step; leave folders and
        locked or property-carrying resources to wsgidav's generic code."""
        if self.provider.readonly or self.provider.prop_manager:
            return False
        target = self.provider._loc_to_file_path(dest_path, self.environ)
        if os.path.isdir(target) or not os.path.isdir(os.path.dirname(target)):
            return False
        os.replace(self._file_path, target)
        return True


class AtomicMoveProvider(FilesystemProvider):  # type: ignore[misc]
    """``FilesystemProvider`` whose files use :class:`_AtomicMoveFile`."""

    def get_resource_inst(self, path: str, environ: dict[str, Any]) -> Any:
        res = super().get_resource_inst(path, environ)
        if isinstance(res, FileResource):
            return _AtomicMoveFile(path, environ, res._file_path)
        return res
