"""dispatchd/envnames.py: which variables a caller may give, and the messages."""

from __future__ import annotations

import pytest

from dispatchd.envnames import EnvError, check_env, check_secrets, refused_name


@pytest.mark.parametrize("name", ["PATH", "RUST_LOG", "_x", "GH_TOKEN", "http_proxy_extra", "LDX"])
def test_allowed_names(name: str) -> None:
    assert refused_name(name) is None


@pytest.mark.parametrize(("name", "why"), [
    ("LD_PRELOAD", "LD_PRELOAD is refused: LD_* variables are the loader's and the sandbox relies on them"),
    ("ld_library_path", "ld_library_path is refused: LD_* variables are the loader's and the sandbox relies on them"),
    ("DISPATCH_CALL_ID", "DISPATCH_CALL_ID is refused: DISPATCH_* variables are dispatchd's own and the sandbox "
                         "relies on them"),
    ("HOME", "HOME is refused: the sandbox sets it itself (its scratch directories, its network proxy)"),
    ("no_proxy", "no_proxy is refused: the sandbox sets it itself (its scratch directories, its network proxy)"),
    ("A-B", "'A-B' is not a variable name (letters, digits and '_', not starting with a digit)"),
    ("", "'' is not a variable name (letters, digits and '_', not starting with a digit)"),
])
def test_refused_names_say_why(name: str, why: str) -> None:
    assert refused_name(name) == why


def test_values_are_strings_without_nul_and_never_shown() -> None:
    assert check_env({"A": "1"}) == {"A": "1"} and check_env(None) == {}
    with pytest.raises(EnvError, match="^env: the value of A must be a string without NUL$"):
        check_env({"A": "x\0hidden"})
    with pytest.raises(EnvError) as err:
        check_secrets({"T": "abc"})
    assert "abc" not in str(err.value)
    with pytest.raises(EnvError, match="^secrets: T is given in env too; give it once$"):
        check_secrets({"T": "abcd"}, {"T": "x"})
    assert check_secrets({"T": "abcd"}) == {"T": "abcd"}
