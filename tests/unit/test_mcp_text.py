"""What ``dispatch mcp`` hands a client that may show it on a terminal
(client/dispatch/_mcp_text.py): nothing a terminal acts on, the rest as it was."""

from __future__ import annotations

import unicodedata

from dispatch._mcp_text import for_client, for_client_all


def test_colour_is_dropped_and_every_other_control_escaped() -> None:
    assert for_client("\x1b[1;31mred\x1b[0m") == "red"
    assert for_client("\x1b]52;c;aGk=\x07") == "\\x1b]52;c;aGk=\\x07"  # a clipboard write
    assert for_client("shown\rhidden") == "shown\\rhidden"
    assert for_client("last\r") == "last\\r"
    assert for_client("\x9b2J \x7f \x00") == "\\u009b2J \\x7f \\x00"  # C1's CSI, DEL, NUL
    assert for_client("\u202eevil\u2066 \u200b\u2028") == "\\u202eevil\\u2066 \\u200b\\u2028"  # bidi, zero-width
    assert for_client("\udc80") == "\\udc80"  # a lone surrogate
    assert for_client("\x1b\x1b[0m[31m") == "\\x1b[31m"  # an ESC made by the colour's removal is escaped too


def test_text_with_nothing_to_act_on_is_left_as_it_was() -> None:
    text = "a\tb\\c\r\nd\ncafé 中文 Ελληνικά 😀\u00a0x"
    assert for_client(text) is text or for_client(text) == text


def test_no_control_or_format_character_is_left() -> None:
    kept = {"\t", "\n"}
    for code in range(0x110000):
        c = chr(code)
        if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") and c not in kept:
            assert for_client(f"a{c}b") != f"a{c}b", hex(code)


def test_every_string_of_the_structured_content_is_escaped_keys_included() -> None:
    assert for_client_all({"changed": ["ok.txt", "\x1b]0;title\x07"], "exit_code": 0, "success": True,
                           "hosts\u202e": ("a",)}) == \
        {"changed": ["ok.txt", "\\x1b]0;title\\x07"], "exit_code": 0, "success": True, "hosts\\u202e": ["a"]}
