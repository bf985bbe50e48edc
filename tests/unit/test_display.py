"""dispatchd.display: what a terminal would act on or hide, escaped visibly
and unambiguously; letters of every script left as they are."""

from __future__ import annotations

import unicodedata

import pytest

from dispatchd.display import one_line, shown


@pytest.mark.parametrize("text, expected", [
    # C0, with the three that have a name of their own
    ("a\x1b[2Kb", "a\\x1b[2Kb"),
    ("line\nforged", "line\\nforged"),
    ("back\rover", "back\\rover"),
    ("tab\there", "tab\\there"),
    ("\x00\x07\x1f", "\\x00\\x07\\x1f"),
    ("osc52\x1b]52;c;ZWNobyBwd25lZA==\x07", "osc52\\x1b]52;c;ZWNobyBwd25lZA==\\x07"),
    ("del\x7f", "del\\x7f"),
    # C1: the 8-bit CSI and OSC a terminal may act on as ESC [ and ESC ]
    ("csi\x9b2K", "csi\\u009b2K"),
    ("\x80\x9d\x9f", "\\u0080\\u009d\\u009f"),
    # line and paragraph separators
    ("a\u2028b\u2029c", "a\\u2028b\\u2029c"),
    # bidi controls: marks, embeddings and overrides, isolates, the Arabic letter mark
    ("evil\u202etxt.exe", "evil\\u202etxt.exe"),
    ("\u200e\u200f\u202a\u202b\u202c\u202d", "\\u200e\\u200f\\u202a\\u202b\\u202c\\u202d"),
    ("\u2066\u2067\u2068\u2069\u061c", "\\u2066\\u2067\\u2068\\u2069\\u061c"),
    # zero-width characters, the byte-order mark, a tag character
    ("zero\u200bwidth\u200c\u200d\u2060\ufeff", "zero\\u200bwidth\\u200c\\u200d\\u2060\\ufeff"),
    ("tag\U000e0041", "tag\\U000e0041"),
    # a byte that was not UTF-8 (os.fsdecode keeps it as a surrogate): the byte;
    # a lone surrogate of any other origin: its code point
    ("bad\udcff", "bad\\xff"),
    ("\ud800", "\\ud800"),
])
def test_each_class_of_character_is_escaped(text: str, expected: str) -> None:
    assert shown(text) == expected
    assert one_line(text) == expected  # no backslash in these: both alike


@pytest.mark.parametrize("text", [
    "plain/path/.envrc", "café/é", "日本語/ファイル", "Ελληνικά", "русский", "عربي", "emoji 🎉", "a b", "nbsp\u00a0x",
    "ideographic\u3000space", "refs/heads/main", "",
])
def test_ordinary_text_of_any_script_is_left_as_it_is(text: str) -> None:
    assert shown(text) == text
    assert one_line(text) == text


def test_a_backslash_is_doubled_so_an_escape_cannot_be_forged() -> None:
    """The four characters ``\\x1b`` in a name are not shown as ESC is."""
    assert shown("a\\b") == "a\\\\b"
    assert shown("\\x1b") == "\\\\x1b"
    assert shown("\x1b") == "\\x1b"
    assert shown("\\x1b") != shown("\x1b")
    assert shown("\\\n") == "\\\\\\n"


def test_one_line_keeps_backslashes() -> None:
    """The log and the job list: one line, nothing a terminal acts on, a
    command's backslashes as written."""
    assert one_line("grep 'a\\.b' | sed 's/\\t/ /'") == "grep 'a\\.b' | sed 's/\\t/ /'"
    assert one_line("x\\\ny") == "x\\\\ny"


def test_nothing_a_terminal_acts_on_is_left_in_any_plane() -> None:
    """Every code point up to the tags' plane, surrogates among them: what
    comes out holds no control, format character, separator or surrogate,
    and can be written as UTF-8 (to a terminal, to the log)."""
    every = "".join(map(chr, range(0xE0080)))
    for out in (shown(every), one_line(every)):
        left = {c for c in out if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")}
        assert left == set()
        out.encode("utf-8")
