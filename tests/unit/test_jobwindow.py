"""tools/jobwindow.py: job_output's window over a job's log, with secrets held
back at its end and masked across its start (the log is a bytes buffer here:
the window is pure over what ``read`` returns)."""

from __future__ import annotations

from collections.abc import Callable

from dispatchd.redact import Redactor
from dispatchd.tools.jobwindow import read_window

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
