"""dispatchd.daemon.capacity and the tool server's channel cap: pure plans, by equality."""

from __future__ import annotations

import resource

import pytest

from dispatchd.daemon.capacity import DEFAULT_MAX_CONNECTIONS, connection_cap, plan_open_files
from dispatchd.worker.tool_server import MAX_CHANNELS, max_channels


@pytest.mark.parametrize(("soft", "hard", "nr_open", "want"), [
    (1024, 524288, 1048576, 524288),  # a login's default: raised to the hard limit
    (1024, 1024, 1048576, 1024),  # nothing to raise (status says so)
    (20000, 20000, 1048576, 20000),
    (1024, resource.RLIM_INFINITY, 1048576, 1048576),  # unlimited means the kernel's nr_open
    (4096, 1024, 1048576, 4096),  # never lower than what we have
])
def test_plan_open_files(soft: int, hard: int, nr_open: int, want: int):
    assert plan_open_files(soft, hard, nr_open) == want


@pytest.mark.parametrize(("open_files", "requested", "want"), [
    (524288, None, DEFAULT_MAX_CONNECTIONS),
    (20000, None, 4096),
    (4096, None, 2016),  # half of what is left after the reserve
    (1024, None, 480),
    (60, None, 16),  # never fewer than 16
    (1024, 5, 5),  # --max-connections wins
    (1024, 0, 1),
])
def test_connection_cap(open_files: int, requested: int | None, want: int):
    assert connection_cap(open_files, requested) == want


@pytest.mark.parametrize(("max_processes", "max_open_files", "want"), [
    (1024, 4096, MAX_CHANNELS),  # the default policy: 256
    (1024, 256, 128),  # half the descriptors
    (40, 4096, 10),  # a quarter of the process budget
    (4, 4, 4),  # never fewer than 4
])
def test_max_channels(max_processes: int, max_open_files: int, want: int):
    assert max_channels(max_processes, max_open_files) == want
