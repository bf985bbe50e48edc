"""dispatch.tools.Result: the seed's Result tests, then immutability and copying."""

import dataclasses
from collections.abc import Callable

import pytest

from dispatch.tools import Result

# -- the seed's list


@pytest.mark.parametrize(
    ("factory", "text", "succeeded"),
    [(Result.success, "file contents", True), (Result.failure, "File not found: src/missing.rb", False)],
    ids=["success", "failure"],
)
def test_factory_sets_correct_state(factory: Callable[[str], Result], text: str, succeeded: bool) -> None:
    result = factory(text)
    assert (result.is_success, result.is_failure) == (succeeded, not succeeded)
    # The text is the output of a success and the error of a failure; the other is None.
    assert (result.output, result.error) == ((text, None) if succeeded else (None, text))


def test_metadata_defaults_to_empty():
    assert dict(Result.success("x").metadata) == {}
    assert dict(Result.failure("x").metadata) == {}
    assert dict(Result.success("x", None).metadata) == {}


def test_metadata_can_be_set():
    assert Result.success("Gate passed.", {"stop_loop": True}).metadata["stop_loop"] is True
    assert Result.failure("exit 2", metadata={"exit_code": 2}).metadata == {"exit_code": 2}


def test_str_is_output_on_success_and_error_on_failure_never_metadata():
    assert str(Result.success("out", {"secret": "meta"})) == "out"
    assert str(Result.failure("boom", {"secret": "meta"})) == "boom"
    assert str(Result.success("")) == ""


def test_to_dict_includes_metadata():
    assert Result.success("out", {"n": 1}).to_dict() == {
        "success": True, "output": "out", "error": None, "metadata": {"n": 1},
    }
    assert Result.failure("bad").to_dict() == {
        "success": False, "output": None, "error": "bad", "metadata": {},
    }


# -- immutability


def test_attributes_cannot_be_set_or_deleted():
    result = Result.success("out")
    for field in ("is_success", "output", "error", "metadata"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(result, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        del result.output
    with pytest.raises(AttributeError):
        result.is_failure = True


def test_metadata_view_is_read_only():
    result = Result.success("out", {"a": 1})
    with pytest.raises(TypeError):
        result.metadata["a"] = 2
    with pytest.raises(TypeError):
        del result.metadata["a"]
    assert not hasattr(result.metadata, "update")
    assert result.metadata == {"a": 1}


def test_metadata_is_a_copy_of_the_callers_dict():
    mine = {"a": 1, "nested": {"b": [1, 2]}}
    result = Result.success("out", mine)
    mine["a"] = 99
    mine["nested"]["b"].append(3)
    mine["added"] = True
    assert result.to_dict()["metadata"] == {"a": 1, "nested": {"b": [1, 2]}}


def test_to_dict_hands_out_a_fresh_plain_dict():
    result = Result.failure("bad", {"nested": {"b": [1]}})
    out = result.to_dict()
    assert type(out["metadata"]) is dict
    out["metadata"]["nested"]["b"].append(2)
    out["metadata"]["x"] = 1
    assert result.to_dict()["metadata"] == {"nested": {"b": [1]}}


def test_metadata_tuples_become_lists_so_to_dict_is_json_shaped():
    assert Result.success("x", {"t": (1, 2)}).to_dict()["metadata"] == {"t": [1, 2]}


# -- construction is checked


def test_output_and_error_must_be_str():
    with pytest.raises(TypeError, match="output must be a str"):
        Result.success(42)
    with pytest.raises(TypeError, match="error must be a str"):
        Result.failure(None)


def test_metadata_must_be_a_mapping():
    with pytest.raises(TypeError, match="metadata must be a mapping"):
        Result.success("x", [("a", 1)])


def test_direct_construction_cannot_mix_success_and_failure():
    with pytest.raises(ValueError, match="a success has no error"):
        Result(True, "out", "err")
    with pytest.raises(ValueError):
        Result(False, "out", "err")
    with pytest.raises(TypeError, match="is_success must be a bool"):
        Result(1, "out")
    assert Result(True, "out") == Result.success("out")


# -- value semantics


def test_equality_by_value():
    assert Result.success("x", {"a": [1]}) == Result.success("x", {"a": [1]})
    assert Result.success("x") != Result.success("y")
    assert Result.success("x") != Result.failure("x")
    assert Result.success("x", {"a": 1}) != Result.success("x")


def test_not_hashable_because_metadata_is_a_mapping():
    with pytest.raises(TypeError):
        hash(Result.success("x"))


def test_repr_reads_like_the_factory_call():
    assert repr(Result.success("hi")) == "Result.success('hi')"
    assert repr(Result.failure("no", {"k": 1})) == "Result.failure('no', metadata={'k': 1})"


def test_from_dict_round_trips():
    for result in (Result.success("out", {"exit_code": 0}), Result.failure("bad")):
        assert Result.from_dict(result.to_dict()) == result
    assert Result.from_dict({"success": True, "output": "x"}) == Result.success("x")


def test_from_dict_refuses_a_dict_without_success():
    with pytest.raises(ValueError, match="'success'"):
        Result.from_dict({"output": "x"})
    with pytest.raises(ValueError):
        Result.from_dict({"success": "yes", "output": "x"})
