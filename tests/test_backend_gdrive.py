"""The ``gdrive:`` backend through the official Google API client against the Drive v3
emulator (tests/emulators/gdrive.py): the shared conformance suite (with TCP resets
and injected 429s/403 rate limits/5xx), Drive-specific behaviour (duplicate names,
logs by reserved ids, resumable uploads, the daily upload cap, token refresh and
revocation), `metasync auth gdrive` against the emulator's OAuth endpoints,
`metasync share`, an end-to-end repository, and live tests (``--live``)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from metasync.backends.conformance import BackendConformance, Location
from metasync.backends.gdrive import GDriveBackend
from tests.emulators.gdrive import GDriveService

MiB = 1 << 20
_counter = itertools.count()


def fresh_namespace() -> str:
    return f"ns-{next(_counter)}-{uuid.uuid4().hex[:6]}"


def _location(service: GDriveService, folder: str) -> str:
    service.emulator.make_folder(folder)
    return f"gdrive:{folder}"


class TestGDriveBackend(BackendConformance):
    """The conformance suite through the Google API client against the emulator."""

    backend_class = GDriveBackend
    # Each append is one files.create when uncontended, but six processes racing for
    # every position cost each loser a read per position; 12 per worker keeps the
    # test's contention (6 processes on every position) at half the requests.
    appends_per_worker = 12

    @pytest.fixture
    def backend_location(self, gdrive_service: GDriveService) -> Location:
        return (_location(gdrive_service, "conformance"), fresh_namespace())

    @pytest.fixture
    def unicode_location(self, gdrive_service: GDriveService) -> Location:
        return (_location(gdrive_service, "ünï cødé ☃/with space"), fresh_namespace())

    @pytest.fixture
    def faulty_location(self, gdrive_service: GDriveService) -> Iterator[tuple[str, str, Any]]:
        faults = gdrive_service.faults_via_proxy()
        try:
            uri = _location(gdrive_service, "faulty") + f"?api={faults.base_url}"
            yield (uri, fresh_namespace(), faults)
        finally:
            faults.close()
