"""A plan decoded with its seccomp part left encoded (``plan.leave_seccomp_encoded``,
as the fork server and its workers decode plans) is the same plan: the same
other fields, the same ``pool_key`` bytes, the same rules once decoded
(``seccomp_of``) and so the same compiled program; a bad part fails loudly."""

from __future__ import annotations

import msgspec
import pytest

from dispatchd.confine import plan as plan_mod
from dispatchd.confine.plan import decode_plan, encode_plan, leave_seccomp_encoded, pool_key, seccomp_of
from dispatchd.confine.seccomp import compile_seccomp, plan_seccomp
from tests.unit.test_pool_plan import plan


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    # This process's decoder is put back after the test.
    monkeypatch.setattr(plan_mod, "_plan_decoder", plan_mod._plan_decoder)
    leave_seccomp_encoded()


def test_the_seccomp_part_stays_bytes_and_every_other_field_is_decoded(encoded: None) -> None:
    full = plan(network="on")
    got = decode_plan(encode_plan(full))
    assert isinstance(got.seccomp, msgspec.Raw)
    assert bytes(got.seccomp) == msgspec.msgpack.encode(full.seccomp)
    for field in msgspec.structs.fields(full):
        if field.name != "seccomp":
            assert getattr(got, field.name) == getattr(full, field.name), field.name


@pytest.mark.parametrize("network", ["off", "on"])
def test_a_plan_decoded_so_encodes_to_the_daemons_bytes(encoded: None, network: str) -> None:
    """Nothing of a plan is lost or reordered in the fork server's decode:
    its copy encodes to the daemon's bytes (a sandbox made ahead compares an
    AdoptSession's bytes with those of the plan it was made with)."""
    sent = encode_plan(plan(network=network))
    assert encode_plan(decode_plan(sent)) == sent
    # The twin: any other plan's bytes differ, and are decoded and checked.
    assert encode_plan(decode_plan(encode_plan(plan(network="off" if network != "off" else "on")))) != sent


@pytest.mark.process  # compiles the filter in a child (libseccomp)
def test_the_rules_decoded_are_the_plans_and_compile_to_the_same_program(encoded: None) -> None:
    full = plan(network="on")
    got = decode_plan(encode_plan(full))
    assert seccomp_of(got) == full.seccomp
    assert compile_seccomp(seccomp_of(got)) == compile_seccomp(full.seccomp)
    assert seccomp_of(full) is full.seccomp  # a plan decoded whole is read as it is


def test_the_pool_key_is_the_same_bytes_and_still_tells_seccomp_apart(encoded: None) -> None:
    usual = plan()
    other = msgspec.structs.replace(usual, seccomp=plan_seccomp(allow_inet=False))
    assert other.seccomp != usual.seccomp
    usual_left, other_left = decode_plan(encode_plan(usual)), decode_plan(encode_plan(other))
    assert pool_key(usual_left) == pool_key(usual) and pool_key(other_left) == pool_key(other)
    # A sandbox made for one filter refuses a plan of another (session_init compares keys).
    assert pool_key(other_left) != pool_key(usual_left)


def test_a_bad_seccomp_part_is_refused_when_it_is_read(encoded: None) -> None:
    full = plan()
    raw = msgspec.msgpack.decode(encode_plan(full))
    raw["seccomp"] = {"rules": "not rules"}
    got = decode_plan(msgspec.msgpack.encode(raw))
    with pytest.raises(msgspec.ValidationError):
        seccomp_of(got)


def test_without_it_plans_decode_whole() -> None:
    full = plan()
    assert decode_plan(encode_plan(full)) == full
