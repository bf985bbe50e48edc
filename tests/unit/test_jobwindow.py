"""tools/jobwindow.py: job_output's window over a job's log, with secrets held
back at its end and masked across its start (the log is a bytes buffer here:
the window is pure over what ``read`` returns); the log's writer at its cap."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.redact import Redactor
from dispatchd.tools.jobs import Job
from dispatchd.tools.jobwindow import RedactedLog, read_window

SECRET = "sk_live_0123456789abcdef"
R = Redactor({"KEY": SECRET})


def _reader(log: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, limit: log[offset:offset + limit]


def _polls(log: bytes, cut: int, redactor: Redactor | None = R) -> list[str]:
    """Two polls of a running job whose log has ``log[:cut]`` by the first,
    all of ``log`` by the second; each from the offset the previous gave."""
    first, used = read_window(_reader(log[:cut]), 0, 1 << 20, redactor, more=True)
    second, _ = read_window(_reader(log), used, 1 << 20, redactor, more=False)
    return [first, second]


def test_a_value_written_across_two_polls_is_held_then_redacted() -> None:
    log = f"using key {SECRET}\ndone\n".encode()
    cut = len("using key sk_live_012")
    assert _polls(log, cut) == ["using key ", "[secret KEY]\ndone\n"]


def test_without_secrets_the_poll_is_the_bytes_as_they_are() -> None:
    log = f"using key {SECRET}\ndone\n".encode()
    cut = len("using key sk_live_012")
    assert _polls(log, cut, None) == ["using key sk_live_012", "3456789abcdef\ndone\n"]
    assert read_window(_reader(b"a\xc3\xa9\xffz"), 0, 100, None, more=True) == ("a\u00e9\ufffdz", 5)


def test_what_cannot_begin_a_value_is_not_held() -> None:
    text, used = read_window(_reader(b"plain output\n"), 0, 100, R, more=True)
    assert (text, used) == ("plain output\n", 13)
    text, used = read_window(_reader(b"ends with sk_"), 0, 100, R, more=True)
    assert (text, used) == ("ends with ", 10)
    # The job ended: nothing more can come, nothing waits.
    assert read_window(_reader(b"ends with sk_"), 0, 100, R, more=False) == ("ends with sk_", 13)


def test_an_offset_inside_a_value_masks_its_rest() -> None:
    log = f"x {SECRET} y\n".encode()
    assert read_window(_reader(log), 2, 100, R, more=False)[0] == "[secret KEY] y\n"  # at its start: named
    for offset in range(3, 2 + len(SECRET)):
        text, used = read_window(_reader(log), offset, 100, R, more=False)
        assert text == " y\n" and used == len(log) - offset, offset
    assert read_window(_reader(log), 0, 100, R, more=False)[0] == "x [secret KEY] y\n"


def test_offsets_count_bytes_across_multibyte_characters_and_invalid_ones() -> None:
    log = "é".encode() + b"\xff" + SECRET[:5].encode()
    text, used = read_window(_reader(log), 0, 100, R, more=True)
    assert (text, used) == ("é\ufffd", 3)  # 2 bytes of é, 1 invalid byte; sk_li waits
    whole = log + SECRET[5:].encode() + "ü\n".encode()
    text, used2 = read_window(_reader(whole), used, 100, R, more=False)
    assert (text, used + used2) == ("[secret KEY]ü\n", len(whole))


def test_a_read_stopped_at_its_cap_holds_back_too() -> None:
    log = f"{'.' * 10}{SECRET}".encode()
    text, used = read_window(_reader(log), 0, 16, R, more=False)
    assert (text, used) == ("." * 10, 10)
    assert read_window(_reader(log), used, 100, R, more=False) == ("[secret KEY]", len(SECRET))


def test_overlapping_values_across_polls_leave_no_character() -> None:
    r = Redactor({"SA": "alphaSECRETbeta42", "SB": "SECRETbeta42gamma"})
    log = b"<alphaSECRETbeta42gamma>\n"
    for cut in range(1, len(log)):
        first, used = read_window(_reader(log[:cut]), 0, 100, r, more=True)
        second, _ = read_window(_reader(log), used, 100, r, more=False)
        out = first + second
        assert not any(p in out for p in ("alpha", "SECRET", "beta", "gamma")), (cut, out)
        assert out.startswith("<[secret S") and out.endswith(">\n"), (cut, out)


PASSWORD = "pässwort-1234-geheim"
PW = Redactor({"PW": PASSWORD})
PW_LOG = f"log: {PASSWORD} end\n".encode()


def test_an_offset_inside_a_secret_s_multibyte_character_masks_its_rest() -> None:
    """A caller counting characters where job_output counts bytes lands
    between the two bytes of "ä": the window starts at its first byte, so
    the value is matched whole and its rest masked. Before, the halves were
    decoded apart and the rest of the value shown ("\\ufffdsswort-1234-...")."""
    inside = PW_LOG.index("ä".encode()) + 1
    assert read_window(_reader(PW_LOG), inside, 1 << 20, PW, more=False) == (" end\n", len(PW_LOG) - inside)


def test_an_offset_inside_a_secret_at_a_character_boundary_masks_its_rest() -> None:
    # The twin: one byte further, after the whole "ä".
    after = PW_LOG.index("ä".encode()) + 2
    assert read_window(_reader(PW_LOG), after, 1 << 20, PW, more=False) == (" end\n", len(PW_LOG) - after)


def test_an_offset_inside_a_character_shows_it_whole_with_or_without_secrets() -> None:
    log = "x ä €z".encode()
    a, euro = log.index("ä".encode()), log.index("€".encode())
    for offset, shown in ((a + 1, "ä €z"), (euro + 1, "€z"), (euro + 2, "€z")):
        for redactor in (None, R):
            assert read_window(_reader(log), offset, 100, redactor, more=False) == (shown, len(log) - offset)
    # Stray continuation bytes (not UTF-8) are shown as they always were.
    assert read_window(_reader(b"a\x80\x80b"), 2, 100, None, more=False) == ("\ufffdb", 2)


def test_a_job_s_log_is_written_redacted_across_chunks_cut_anywhere() -> None:
    """``RedactedLog``: the job's pipe read in chunks cut anywhere, inside a
    value and inside one of its characters; what reaches the log is the
    whole output redacted, the same for every cut."""
    value = PASSWORD.encode()
    out = b"a " + value + b" b \xff" + value + b"\xff end\n"
    for cut in range(1, len(out)):
        log = RedactedLog(PW)
        written = log.feed(out[:cut]) + log.feed(out[cut:]) + log.end()
        assert written == b"a [secret PW] b \xff[secret PW]\xff end\n", cut


def test_a_job_s_output_without_a_value_is_written_as_it_comes() -> None:
    # The twin: nothing that could begin a value waits.
    log = RedactedLog(PW)
    assert log.feed(b"plain \xc3") == b"plain "  # a character cut at the chunk's end waits for its rest
    assert log.feed(b"\xa4 output\n") == "ä output\n".encode()
    assert log.end() == b""


@pytest.mark.parametrize("secrets", [False, True], ids=["plain", "with-secrets"])
def test_a_tail_held_back_when_the_log_reaches_its_cap_counts_as_truncated(secrets: bool, tmp_path: Path) -> None:
    """103 bytes for a cap of 100: the last 3 dropped, and said. With secrets
    the writer held back "sk_" (it could begin the value) and the cap was
    reached by what it let through: the end must still tell the cut."""
    fd = os.open(tmp_path / "job.log", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        job = Job("job_1", "x", None, "t", fd, 100, None,
                  redacting=RedactedLog(Redactor({"KEY": "sk_live_0123456789abcdef"})) if secrets else None)
        job._keep(b"y" * 100 + b"sk_")
        job._keep(b"")
        assert (os.pread(fd, 200, 0), job.written, job.truncated) == (b"y" * 100, 100, True)
    finally:
        os.close(fd)


def test_a_log_that_ends_exactly_at_its_cap_is_not_truncated(tmp_path: Path) -> None:
    # The twin: 100 bytes for a cap of 100, with secrets: all of it kept, nothing cut.
    fd = os.open(tmp_path / "job.log", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        job = Job("job_1", "x", None, "t", fd, 100, None,
                  redacting=RedactedLog(Redactor({"KEY": "sk_live_0123456789abcdef"})))
        job._keep(b"y" * 97 + b"sk_")
        job._keep(b"")
        assert (os.pread(fd, 200, 0), job.written, job.truncated) == (b"y" * 97 + b"sk_", 100, False)
    finally:
        os.close(fd)
