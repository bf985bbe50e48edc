"""Fixtures of the integration suite beyond the root conftest's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import dispatch
from tests.conftest import Daemon


@pytest.fixture(scope="module", params=["full", "degraded"])
def mode_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dispatch.Client]]:
    """A client of a daemon with user namespaces ("full") and of one started with
    --no-user-namespaces ("degraded"): tests taking it run in both modes."""
    extra = ("--no-user-namespaces",) if request.param == "degraded" else ()
    d = Daemon(tmp_path_factory.mktemp(f"daemon-{request.param}"), *extra)
    try:
        with d.connect() as c:
            yield request.param, c
    finally:
        assert d.stop() == 0, d.log()
