"""dispatchd.fdwait: a descriptor above 1,023 waits as any other (select
refused those: a daemon holding a thousand sessions failed its closes with
``ValueError: filedescriptor out of range in select()``)."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator

import pytest

from dispatchd.fdwait import readable

HIGH = 2048


@pytest.fixture
def high_pipe() -> Iterator[tuple[int, int]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH:
        pytest.fail(f"the test needs a descriptor limit above {HIGH} (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 1), hard))
    r, w = os.pipe()
    os.dup2(r, HIGH)
    os.close(r)
    try:
        yield HIGH, w
    finally:
        os.close(HIGH)
        os.close(w)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_high_descriptor_is_waited_for(high_pipe: tuple[int, int]) -> None:
    r, w = high_pipe
    assert readable(r, 0) is False
    assert readable(r, 0.01) is False
    os.write(w, b"x")
    assert readable(r, 0) is True


def test_the_same_on_a_low_descriptor() -> None:
    r, w = os.pipe()
    try:
        assert readable(r, 0) is False
        os.close(w)
        w = -1
        assert readable(r, 1.0) is True  # EOF: readable
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
