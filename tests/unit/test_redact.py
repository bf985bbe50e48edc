"""dispatchd/redact.py: secrets replaced in replies and in streamed chunks."""

from __future__ import annotations

from dispatchd.redact import Redactor, Stream


def test_values_are_replaced_everywhere() -> None:
    r = Redactor({"A": "abcd", "LONG": "abcdef"})
    assert r.text("x abcdef y abcd z") == "x [secret LONG] y [secret A] z"
    assert r.value({"k": ["abcd", 1, {"n": "-abcd-"}]}) == {"k": ["[secret A]", 1, {"n": "-[secret A]-"}]}


def test_overlapping_values_are_masked_whole_named_after_the_first() -> None:
    r = Redactor({"SA": "alphaSECRETbeta42", "SB": "SECRETbeta42gamma"})
    assert r.text("<alphaSECRETbeta42gamma>") == "<[secret SA]>"
    assert r.text("<SECRETbeta42gamma>") == "<[secret SB]>"
    short = Redactor({"SA": "xxxxSEC1", "SB": "SEC1-long-value-here"})
    assert short.text("xxxxSEC1-long-value-here!") == "[secret SA]!"


def test_a_value_repeated_over_itself_is_masked_whole() -> None:
    r = Redactor({"T": "abab"})
    assert r.text("xababab.") == "x[secret T]."
    assert r.text("xabab abab") == "x[secret T] [secret T]"


def test_without_secrets_text_is_unchanged() -> None:
    r = Redactor({})
    assert r.text("alphaSECRETbeta42gamma") == "alphaSECRETbeta42gamma"
    assert r.held("abc") == 0


def test_a_value_is_found_in_any_ascii_case() -> None:
    r = Redactor({"T": "TokEN99"})
    assert r.text("tokn TokEN9 token99.attacker.test TOKEN99") == "tokn TokEN9 [secret T].attacker.test [secret T]"
    assert r.held("x toke") == 4
    # Beyond ASCII nothing is folded: lengths stay (the held tail counts characters).
    assert Redactor({"T": "Ünïcode-1"}).text("ünïcode-1 Ünïcode-1") == "ünïcode-1 [secret T]"


def test_one_name_for_two_values() -> None:
    r = Redactor([("T", "first-value"), ("T", "second-value")])
    assert r.text("first-value second-value") == "[secret T] [secret T]"


def test_a_value_cut_across_chunks_is_held_then_redacted() -> None:
    sent: list[tuple[str, str]] = []
    s = Stream(Redactor({"T": "secret"}), lambda stream, text: sent.append((stream, text)))
    s("stdout", "one sec")
    s("stderr", "se")
    s("stdout", "ret two")
    s("stderr", "x")
    assert sent == [("stdout", "one "), ("stdout", "[secret T] two"), ("stderr", "sex")]


def test_a_whole_match_at_the_end_is_not_held_back() -> None:
    r = Redactor({"T": "abcd"})
    assert r.window("xabcd", 0, final=False) == ("x[secret T]", 5)
    # A value that repeats over itself: "ab" could begin another; it waits,
    # its run already shown as the label, and is not named twice.
    sent: list[str] = []
    s = Stream(Redactor({"T": "abab"}), lambda _s, t: sent.append(t))
    s("stdout", "xabab")
    s("stdout", "\n")
    s.flush()
    assert sent == ["x[secret T]", "\n"]


def test_overlapping_values_split_across_chunks_leave_no_byte() -> None:
    sent: list[str] = []
    s = Stream(Redactor({"SA": "alphaSECRETbeta42", "SB": "beta42gammaXYZ"}), lambda _s, t: sent.append(t))
    s("stdout", "<alphaSECRETbeta42gam")
    s("stdout", "\n")  # SB never completes: SA's end, held with SB's start, is still masked
    s.flush()
    out = "".join(sent)
    assert "beta42" not in out and "SECRET" not in out and out.startswith("<[secret SA]")
    assert out.endswith("gam\n")
    sent.clear()
    s = Stream(Redactor({"SA": "alphaSECRETbeta42", "SB": "SECRETbeta42gamma"}), lambda _s, t: sent.append(t))
    for chunk in ("alphaSECRETbe", "ta42gam", "ma done"):
        s("stdout", chunk)
    s.flush()
    out = "".join(sent)
    assert not any(part in out for part in ("alpha", "SECRET", "beta", "gamma")), out
    assert out.startswith("[secret SA]") and out.endswith(" done")


def test_what_waits_is_flushed_at_the_end() -> None:
    sent: list[str] = []
    s = Stream(Redactor({"T": "secret"}), lambda _s, t: sent.append(t))
    s("stdout", "ends with sec")
    s.flush()
    assert sent == ["ends with ", "sec"]


def test_a_window_starting_inside_a_value_drops_its_rest() -> None:
    r = Redactor({"T": "alphaSECRETbeta42"})
    text = "..alphaSECRETbeta42 tail"
    assert r.window(text, 3, final=True) == (" tail", len(text))
    assert r.window(text, 19, final=True) == (" tail", len(text))



def test_a_value_s_lines_are_masked_one_label_a_line_keeping_their_numbers() -> None:
    """``mask_lines``, what read_file and search_files show: each line a run
    covers is its label; the run's first and last lines keep the text beside
    it, and the newlines are all kept (a line wholly newline in the value is
    a labelled line too)."""
    key = "-----BEGIN-----\nQUJD\n\nR0hJ\n-----END-----\n"
    r = Redactor({"KEY": key, "TOKEN": "ghp_Token99"})
    data = f"key: {key}after GHP_TOKEN99 end\n".encode()
    assert r.mask_lines(data) == (b"key: [secret KEY]\n[secret KEY]\n[secret KEY]\n[secret KEY]\n[secret KEY]\n"
                                  b"after [secret TOKEN] end\n")
    assert r.mask_lines(data).count(b"\n") == data.count(b"\n")
    # Bytes that are not UTF-8 beside a value are kept as they are.
    assert r.mask_lines(b"\xff ghp_token99 \xfe") == b"\xff [secret TOKEN] \xfe"


def test_bytes_without_a_value_are_given_back_as_they_are() -> None:
    # The twin: the same object, so a tool goes on as it would without secrets.
    data = b"QUJD and ghp_Token9 are no values\n"
    r = Redactor({"TOKEN": "ghp_Token99"})
    assert r.mask_lines(data) is data
    assert Redactor({}).mask_lines(data) is data


def test_a_value_with_surrounding_whitespace_is_found_without_it_too() -> None:
    """A token read from a file keeps its newline; a tool that shows a line
    without it, or a command's ``$(cat token)``, drops it."""
    r = Redactor({"TOKEN": "ghp_Token99\n"})
    assert r.text("[ghp_Token99]") == "[[secret TOKEN]]"
    assert r.text("ghp_Token99\nnext") == "[secret TOKEN]next"  # the whole value first: its newline too
    assert r.mask_lines(b"x=ghp_Token99;") == b"x=[secret TOKEN];"


def test_a_stripped_value_too_short_to_find_is_not_redacted() -> None:
    # The twin: what is left without the whitespace is under MIN_SECRET_CHARS.
    r = Redactor({"PIN": "123\n\n"})
    assert r.text("pin 123\n\n, then 123") == "pin [secret PIN], then 123"
