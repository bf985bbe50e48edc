"""Compact outputs (seed 003): a result over the budget reaches the model as
head and tail with a marker; the whole stays retrievable by id through the
``retrieve_output`` tool; ``call`` always returns the whole result."""

import re
import itertools
import threading

import pytest

from dispatch.tools import RETRIEVE_OUTPUT, Definition, OutputStore, Registry, Result, compact

MARKER = re.compile(r'\[\.\.\. (\d+) bytes omitted; call retrieve_output with id "(out_\d+)" for the whole output \.\.\.\]')


def numbered(n):
    return "".join(f"line {i}\n" for i in range(n))


def echo(params, context):
    text = params["text"]
    return Result.success(text) if not params.get("fail") else Result.failure(text)


ECHO = Definition("echo", "Echo", {"type": "object", "properties": {"text": {"type": "string"},
                                                                      "fail": {"type": "boolean"}}}, echo)


def registry(budget=200, **kw):
    return Registry([ECHO], output_budget=budget, **kw)


def anthropic(name, input, id="t1"):
    return {"type": "tool_use", "id": id, "name": name, "input": input}


def openai(name, arguments, id="c1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- compact


def test_a_text_that_fits_is_unchanged():
    assert compact("abc", 3, "out_1") == "abc"
    assert compact("", 1, "out_1") == ""


def test_a_long_text_is_head_marker_tail_within_the_budget():
    text = numbered(1000)
    short = compact(text, 500, "out_7")
    assert len(short.encode()) <= 500
    head, tail = MARKER.split(short)[0], MARKER.split(short)[-1]
    omitted, output_id = MARKER.search(short).groups()
    assert output_id == "out_7"
    assert text.startswith(head) and text.endswith(tail.lstrip("\n"))
    # Both sides end on whole lines, and the count is exact.
    assert head.endswith("\n") and tail.startswith("\n") and tail[1:].startswith("line ")
    assert int(omitted) == len(text) - len(head) - len(tail[1:])
    assert short.startswith("line 0\nline 1\n") and short.endswith("line 999\n")


def test_without_line_breaks_the_cut_falls_anywhere():
    text = "x" * 10_000
    short = compact(text, 300, "out_1")
    omitted = int(MARKER.search(short).group(1))
    kept = short.replace(MARKER.search(short).group(0), "").replace("\n", "")
    assert len(kept) + omitted == 10_000
    assert len(short) <= 300


def test_multibyte_characters_are_never_split():
    text = "é€😀" * 3000  # 2, 3 and 4 bytes
    for budget in range(150, 170):
        short = compact(text, budget, "out_1")
        assert len(short.encode()) <= budget
        head, tail = short.split("\n[")[0], short.split("]\n")[-1]
        assert text.startswith(head) and text.endswith(tail)
        omitted = int(MARKER.search(short).group(1))
        assert len(head.encode()) + len(tail.encode()) + omitted == len(text.encode())


def test_a_budget_smaller_than_the_marker_leaves_the_marker_alone():
    short = compact("y" * 1000, 10, "out_3")
    assert MARKER.fullmatch(short.strip())
    assert MARKER.search(short).group(1) == "1000"


# -- OutputStore


def test_store_keeps_texts_by_id():
    store = OutputStore()
    a, b = store.put("first"), store.put("second")
    assert (a, b) == ("out_1", "out_2")
    assert (store.get(a), store.get(b), store.get("out_9"), store.get(None)) == ("first", "second", None, None)
    assert a in store and len(store) == 2 and store.total_bytes == 11


def test_store_forgets_the_oldest_past_its_count():
    store = OutputStore(max_outputs=3)
    ids = [store.put(str(i)) for i in range(5)]
    assert [i in store for i in ids] == [False, False, True, True, True]


def test_store_forgets_the_oldest_past_its_bytes_but_keeps_one_huge_text():
    store = OutputStore(max_bytes=10)
    a, b = store.put("12345"), store.put("678")
    assert a in store and b in store
    c = store.put("abcdefghijkl")  # larger than the store on its own
    assert (a in store, b in store, store.get(c)) == (False, False, "abcdefghijkl")
    d = store.put("z")
    assert (c in store, d in store, store.total_bytes) == (False, True, 1)


def test_store_counts_utf8_bytes():
    store = OutputStore()
    store.put("é")
    assert store.total_bytes == 2


def test_store_is_safe_from_many_threads():
    store = OutputStore(max_outputs=10_000)
    ids: list[str] = []
    lock = threading.Lock()

    seq = itertools.count()

    def work():
        me = next(seq)  # distinct texts: the same text twice is kept once
        mine = [store.put(f"{me:06d}{i:04d}") for i in range(200)]
        with lock:
            ids.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1600 and len(store) == 1600 and store.total_bytes == 16_000


def test_store_refuses_nonsense_bounds():
    with pytest.raises(ValueError):
        OutputStore(max_outputs=0)


# -- the registry


def test_a_budget_brings_retrieve_output_along():
    reg = registry()
    assert reg.tool_names == ["echo", RETRIEVE_OUTPUT]
    retrieve = reg.get(RETRIEVE_OUTPUT)
    assert (retrieve.risk, retrieve.advertised) == ("read", True)
    assert [s["name"] for s in reg.schemas("anthropic")] == ["echo", RETRIEVE_OUTPUT]
    assert reg.output_budget == 200 and isinstance(reg.outputs, OutputStore)


def test_without_a_budget_nothing_changes():
    reg = Registry([ECHO])
    assert reg.tool_names == ["echo"] and reg.outputs is None and reg.output_budget is None
    text = numbered(1000)
    assert reg.dispatch(anthropic("echo", {"text": text}))["content"] == text


def test_dispatch_compacts_and_keeps_the_whole():
    reg = registry()
    text = numbered(100)
    outcome = reg.run_call(anthropic("echo", {"text": text}))
    assert outcome.output_id == "out_1"
    assert outcome.result.output == text  # the whole result, for the program
    content = outcome.reply["content"]
    assert len(content.encode()) <= 200 and MARKER.search(content).group(2) == "out_1"
    assert reg.outputs.get("out_1") == text
    assert reg.call("echo", {"text": text}).output == text  # call() never compacts
    assert len(reg.outputs) == 1


def test_a_short_result_is_not_stored():
    reg = registry()
    outcome = reg.run_call(anthropic("echo", {"text": "short"}))
    assert (outcome.reply["content"], outcome.output_id, len(reg.outputs)) == ("short", None, 0)


def test_a_long_failure_is_compacted_too():
    reg = registry()
    reply = reg.dispatch(openai("echo", {"text": numbered(100), "fail": True}))
    assert reply["content"].startswith("Error: line 0\n") and MARKER.search(reply["content"])


def test_the_budget_is_in_bytes():
    reg = registry(budget=100)
    text = "é" * 60  # 60 characters, 120 bytes
    assert MARKER.search(reg.dispatch(anthropic("echo", {"text": text}))["content"])


@pytest.mark.parametrize("budget", [0, -1, True, 1.5, "10"])
def test_a_budget_must_be_a_positive_int(budget):
    with pytest.raises(ValueError, match="output_budget"):
        Registry(output_budget=budget)


def test_outputs_need_a_budget():
    with pytest.raises(ValueError, match="output_budget"):
        Registry(outputs=OutputStore())


def test_a_store_can_be_shared():
    store = OutputStore()
    a, b = registry(outputs=store), registry(outputs=store)
    a.dispatch(anthropic("echo", {"text": numbered(100)}))
    b.dispatch(anthropic("echo", {"text": numbered(101)}))
    assert store.get("out_2") is not None
    assert b.call(RETRIEVE_OUTPUT, {"id": "out_1", "end_line": 0}).output.startswith("line 0\n")


def test_subset_and_with_approval_keep_the_budget_store_and_retrieval():
    reg = registry()
    reg.dispatch(anthropic("echo", {"text": numbered(100)}))
    sub = reg.subset("echo")
    assert sub.tool_names == ["echo", RETRIEVE_OUTPUT]
    assert sub.outputs is reg.outputs and sub.output_budget == 200
    assert sub.call(RETRIEVE_OUTPUT, {"id": "out_1", "end_line": 1}).output.startswith("line 0\nline 1\n")
    gated = reg.with_approval(lambda d, p, c: False)
    assert gated.outputs is reg.outputs and gated.tool_names == reg.tool_names
    assert reg.subset(RETRIEVE_OUTPUT, "echo").tool_names == [RETRIEVE_OUTPUT, "echo"]


# -- retrieve_output


def stored(text, budget=200):
    reg = registry(budget)
    outcome = reg.run_call(anthropic("echo", {"text": text}))
    return reg, outcome.output_id


def retrieve(reg, **params):
    return reg.call(RETRIEVE_OUTPUT, params)


def test_retrieve_by_lines_pages_through_the_whole():
    text = numbered(100)
    reg, oid = stored(text)
    pieces, start = [], 0
    while True:
        r = retrieve(reg, id=oid, start_line=start)
        assert r.is_success and len(r.output.encode()) <= 200 + 80  # the budget, plus the footer
        body, _, footer = r.output.rpartition("[output out_1: ")
        pieces.append(body)
        m = re.search(r"more from start_line=(\d+)\]$", r.output)
        if not m:
            assert footer.endswith("of 100]")
            break
        start = int(m.group(1))
    assert "".join(pieces) == text
    assert r.metadata["total_lines"] == 100 and r.metadata["end_line"] == 99


def test_retrieve_a_line_range():
    reg, oid = stored(numbered(100))
    r = retrieve(reg, id=oid, start_line=10, end_line=12)
    assert r.output == "line 10\nline 11\nline 12\n[output out_1: lines 10-12 of 100]"
    assert r.metadata == {"id": "out_1", "total_lines": 100, "total_bytes": 790, "start_line": 10, "end_line": 12}


def test_retrieve_the_whole_when_it_fits_has_no_footer():
    reg = registry(budget=200)
    text = numbered(30)  # 230 bytes: compacted at 200...
    oid = reg.run_call(anthropic("echo", {"text": text})).output_id
    reg2 = Registry([ECHO], output_budget=1000, outputs=reg.outputs)  # ...read whole with a larger one
    assert retrieve(reg2, id=oid).output == text


def test_retrieve_past_the_end():
    reg, oid = stored(numbered(100))
    r = retrieve(reg, id=oid, start_line=500)
    assert r.is_success and r.output == "[output out_1: no lines 500-end; it has 100]"


def test_retrieve_by_bytes_pages_through_the_whole_without_splitting_characters():
    text = "naïve café 😀 " * 100
    reg, oid = stored(text, budget=100)
    pieces, offset = [], 0
    while True:
        r = retrieve(reg, id=oid, offset=offset, length=37)
        body, _, _ = r.output.rpartition("\n[output out_1: ")
        pieces.append(body)
        m = re.search(r"more from offset=(\d+)\]$", r.output)
        if not m:
            break
        offset = int(m.group(1))
    assert "".join(pieces) == text


def test_retrieve_bytes_are_capped_at_the_budget():
    reg, oid = stored("z" * 1000, budget=100)
    r = retrieve(reg, id=oid, offset=0, length=500)
    assert r.output == "z" * 100 + "\n[output out_1: bytes 0-100 of 1000; more from offset=100]"


def test_a_line_longer_than_the_budget_continues_by_bytes():
    reg, oid = stored("short\n" + "w" * 1000 + "\nend\n", budget=100)
    r = retrieve(reg, id=oid, start_line=1)
    assert r.output == "w" * 100 + "\n[output out_1: line 1 is longer than 100 bytes; the rest of it from offset=106]"
    assert retrieve(reg, id=oid, offset=106, length=3).output.startswith("www\n[output out_1: bytes 106-109")


def test_retrieve_an_unknown_or_forgotten_id():
    reg = registry(outputs=OutputStore(max_outputs=1))
    reg.dispatch(anthropic("echo", {"text": numbered(100)}))
    reg.dispatch(anthropic("echo", {"text": numbered(101)}))
    assert retrieve(reg, id="out_1").error == (
        "retrieve_output: no output with id 'out_1' (only the last 1 compacted outputs are kept)")
    assert retrieve(reg, id="out_2").is_success


def test_retrieve_lines_or_bytes_not_both():
    reg, oid = stored(numbered(100))
    assert retrieve(reg, id=oid, start_line=1, offset=3).error == (
        "retrieve_output: give lines (start_line, end_line) or bytes (offset, length), not both")


def test_retrieve_arguments_are_checked():
    reg, oid = stored(numbered(100))
    assert retrieve(reg, id=oid, start_line=-1).error.startswith("retrieve_output: invalid arguments:")
    assert retrieve(reg, id=oid, colour="red").error.startswith("retrieve_output: invalid arguments:")


def test_retrieve_output_pieces_are_not_compacted_again():
    reg, oid = stored(numbered(100))
    outcome = reg.run_call(anthropic(RETRIEVE_OUTPUT, {"id": oid}))
    assert outcome.output_id is None and not MARKER.search(outcome.reply["content"])
    assert len(reg.outputs) == 1
