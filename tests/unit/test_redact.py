"""worker/redact.py: secrets replaced in replies and in streamed chunks."""

from __future__ import annotations

from dispatchd.worker.redact import Redactor, Stream


def test_values_are_replaced_everywhere() -> None:
    r = Redactor({"A": "abcd", "LONG": "abcdef"})
    assert r.text("x abcdef y abcd z") == "x [secret LONG] y [secret A] z"
    assert r.value({"k": ["abcd", 1, {"n": "-abcd-"}]}) == {"k": ["[secret A]", 1, {"n": "-[secret A]-"}]}


def test_a_value_cut_across_chunks_is_held_then_redacted() -> None:
    sent: list[tuple[str, str]] = []
    s = Stream(Redactor({"T": "secret"}), lambda stream, text: sent.append((stream, text)))
    s("stdout", "one sec")
    s("stderr", "se")
    s("stdout", "ret two")
    s("stderr", "x")
    assert sent == [("stdout", "one "), ("stdout", "[secret T] two"), ("stderr", "sex")]


def test_a_whole_match_at_the_end_is_not_held_back() -> None:
    r = Redactor({"T": "abab"})
    assert r.split("xabab") == ("x[secret T]", "")
    assert r.split("xababab") == ("x[secret T]", "ab")


def test_what_waits_is_flushed_at_the_end() -> None:
    sent: list[str] = []
    s = Stream(Redactor({"T": "secret"}), lambda _s, t: sent.append(t))
    s("stdout", "ends with sec")
    s.flush()
    assert sent == ["ends with ", "sec"]
