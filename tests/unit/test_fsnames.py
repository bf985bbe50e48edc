"""Names that are not UTF-8, as people read them (dispatchd/fsnames.py) and
as the daemon's records keep them (dispatchd/recordjson.py), and a domain's
reports bounded without a silent cut (daemon/gitguard/reportlog.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from dispatchd import recordjson
from dispatchd.daemon.checkpoints import journal
from dispatchd.daemon.gitguard import history, parts, reportlog
from dispatchd.daemon.gitguard.parts import Protected, Record
from dispatchd.fsnames import shown

BAD = "bad\udcff"  # the name b"bad\xff", as os.listdir and scandir give it


# --- shown -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    (BAD, "bad\\xff"),
    ("/w/a\udcc3\udca9/\udcfe.envrc", "/w/a\u00e9/\\xfe.envrc"),  # bytes that are UTF-8 together: the character
    ("caf\u00e9/\u202e", "caf\u00e9/\u202e"),  # valid UTF-8 stays as it is (escapes are the client's to show)
    ("plain", "plain"),
    ("\ud800x", "\\ud800x"),  # a surrogate no file name makes: its code point
])
def test_a_name_is_shown_whole_and_encodable(name: str, expected: str) -> None:
    assert shown(name) == expected
    assert shown(name).encode("utf-8")  # never raises
    assert shown(shown(name)) == shown(name)


# --- records ----------------------------------------------------------------------------------


def _record(name: str) -> Record:
    kept = history.History(common=f"/w/{name}/.git", refs={f"refs/heads/{name}": "a" * 40, "refs/heads/main": "b" * 40},
                           own=[f"refs/heads/{name}"], head=f"ref: refs/heads/{name}\n")
    return Record(id="d1", created=1.5, sessions=["s1"], histories=[kept], reach=[f"/w/{name}"])


def test_a_record_naming_a_ref_that_is_not_utf8_reads_back_the_same() -> None:
    record = _record(BAD)
    with pytest.raises(UnicodeEncodeError):
        msgspec.json.encode(record)  # what made every open of the worktree fail
    data = recordjson.encode(record)
    assert b"\\udcff" in data and data.isascii()
    back = recordjson.decode(data, Record)
    assert back == record and next(iter(back.histories[0].refs)) == f"refs/heads/{BAD}"
    assert json.loads(data)["sessions"] == ["s1"]  # still JSON


def test_a_record_of_utf8_names_is_written_as_before_and_an_old_one_reads() -> None:
    record = _record("caf\u00e9")
    assert recordjson.encode(record) == msgspec.json.encode(record)  # byte for byte: what older daemons read
    assert recordjson.decode(msgspec.json.encode(record), Record) == record


@pytest.mark.parametrize("data", [b'{"id": "d1", "created": 1.0, "sessions": ["\\udcff"', b"\xff\\udcff"])
def test_a_broken_record_is_still_refused(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        recordjson.decode(data, Record)


def test_a_record_of_the_wrong_shape_is_refused_either_way() -> None:
    with pytest.raises(msgspec.ValidationError):
        recordjson.decode(b'{"id": "d\\udcff", "created": "then"}', Record)


def test_a_restore_record_keeps_a_ref_that_is_not_utf8() -> None:
    record = journal.Record(session="s1", checkpoint="c0001", worktree="/w", dev=1, ino=2, started_ns=3,
                            max_files=10, max_depth=10, refs={f"refs/heads/{BAD}": "a" * 40})
    assert journal.decode(journal.encode(record)) == record


# --- reports ----------------------------------------------------------------------------------


def _files(n: int, start: int = 0) -> list[Protected]:
    return [Protected(path=f"/w/n{i}/.envrc", why="a repository or a file your tools run, changed or new",
                      time=1.0, bulk=True) for i in range(start, start + n)]


def test_readable_reports_name_their_bytes() -> None:
    [item] = reportlog.readable([Protected(path=f"/w/{BAD}/.envrc", why=f"moved to refs/heads/{BAD}")])
    assert item.path == "/w/bad\\xff/.envrc" and item.why == "moved to refs/heads/bad\\xff"


def test_a_long_report_keeps_refs_and_git_first_and_counts_the_rest() -> None:
    ref = Protected(path="refs/heads/feature", why="moved to 1234 by a session; put back at 5678", time=1.0)
    hook = Protected(path="/w/.git/hooks/pre-commit", why="git configuration, hooks or state changed or new")
    found = _files(150) + [hook] + _files(100, 150) + [ref]
    out = reportlog.bounded(found, "/w", 2.0, kept=200)
    assert len(out) == 201 and out[:2] == [hook, ref]  # never the first ones cut
    assert out[2:200] == found[:150] + found[151:199]  # then the files, in the order found
    assert out[200] == Protected(path="/w", time=2.0, why=(
        "and 52 more moved aside or put back, not listed here (52 a repository or a file your tools run, "
        "changed or new): the daemon's log names each"))


def test_a_report_within_the_bound_is_whole_refs_first() -> None:
    ref = Protected(path="refs/heads/feature", why="deleted by a session; put back at 5678", time=1.0)
    found = _files(199) + [ref]
    assert reportlog.bounded(found, "/w", 2.0, kept=200) == [ref] + found[:199]


def test_a_check_not_whole_is_first_and_never_cut_however_many_other_reports() -> None:
    """A session that makes 250 reports of git's own kind (new git
    directories, bad packs) before a plant that cannot be moved: the
    failure is still in the close's reply, first, so ``dispatch exec``
    exits 3 and the Python client logs it at ERROR. The twin: a check
    that finished lists its reports as before, no failure made up."""
    git_kind = [Protected(path=f"/w/.git/modules/m{i}/HEAD", why="git configuration, hooks or state changed or new")
                for i in range(250)]
    failed = parts.unchecked("/w", ["/w/.envrc: No space left on device"], 2.0)
    out = reportlog.bounded(git_kind + [failed], "/w", 2.0, kept=200)
    assert out[0] == failed and out[0].why.startswith("NOT checked whole: /w/.envrc: No space left on device. ")
    assert out[1:201] == git_kind[:200] and out[201].why.startswith("and 50 more moved aside or put back")
    assert len(out) == 202
    finished = reportlog.bounded(git_kind, "/w", 2.0, kept=200)
    assert finished[:200] == git_kind[:200] and not any(p.why.startswith("NOT checked") for p in finished)


def test_the_failures_of_a_check_are_said_within_a_bound() -> None:
    """20,000 plants none of which could move made one report, one status
    line and one log line of megabytes: the first 20 are named, each cut at
    1,000 characters, and the rest counted. The twin: a few are named whole."""
    many = [f"/w/d{i}/.envrc: No space left on device" for i in range(20_000)]
    said = parts.failures_said(many)
    assert said == "; ".join(many[:20]) + "; and 19980 more that could not be done either"
    long = "/w/" + "x" * 5000 + ": No space left on device"
    assert parts.failures_said([long]) == long[:1000] + f"... ({len(long) - 1000} more characters)"
    assert parts.failures_said(many[:3]) == "; ".join(many[:3])
    item = parts.unchecked("/w", many, 2.0)
    assert len(item.why) < 2_000 + 300


def test_a_sessions_reports_say_how_many_were_let_go() -> None:
    reports = reportlog.Reports(kept=10)
    joined = reports.end
    reports.add(_files(4))
    later = reports.end
    reports.add(_files(8, 4))  # 12 in all: the first 2 let go
    since = reports.since(joined, "/w")
    assert len(since) == 11 and since[1:] == _files(10, 2)
    assert since[0].path == "/w" and since[0].why.startswith("and 2 earlier ones moved aside or put back, no longer "
                                                             "listed here")
    assert reports.since(later, "/w") == _files(8, 4)  # none of its own let go: no count


def test_a_merged_domains_reports_keep_their_sessions_places() -> None:
    into, other = reportlog.Reports(kept=20), reportlog.Reports(kept=10)
    into.add(_files(3))
    first = other.end
    other.add(_files(12, 100))  # 2 let go
    moved = into.take(other, "/o")
    since = into.since(moved(first), "/o")
    assert since[0].path == "/o" and since[0].why.startswith("and 2 earlier ones")
    assert since[1:] == _files(10, 102)  # nothing of into's own before it
