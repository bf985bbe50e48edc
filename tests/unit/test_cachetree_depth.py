"""dispatchd.daemon.gitguard.cachetree: the work of ``agrees`` is linear in
the names' bytes. Each name was sliced anew at every level and every
directory's tree hashed, valid or not: 2,000 names 450 directories deep (a
2 MB index) took ~18 s and ~640 MB under a cache-tree whose only node is the
invalid root. Now only the directories on the way to a valid node are
looked into; the trees hashed are the valid ones' and theirs below."""

from __future__ import annotations

import hashlib

import pytest

from dispatchd.daemon.gitguard import cachetree, indexfile

MODE = 0o100644


def _index(names: list[bytes], tree: bytes) -> tuple[bytes, indexfile.Layout]:
    """A SHA-1 index of regular files named ``names`` (each id the SHA-1 of
    its name) and a ``TREE`` extension of the node bytes ``tree``."""
    out = bytearray(b"DIRC" + (2).to_bytes(4, "big") + len(names).to_bytes(4, "big"))
    for name in names:
        start = len(out)
        stat_part = bytearray(40)
        stat_part[24:28] = MODE.to_bytes(4, "big")
        out += stat_part + hashlib.sha1(name).digest() + min(len(name), 0xFFF).to_bytes(2, "big") + name
        out += b"\0" * (8 - (len(out) - start) % 8)
    out += b"TREE" + len(tree).to_bytes(4, "big") + tree
    data = bytes(out) + hashlib.sha1(bytes(out)).digest()
    found = indexfile.layout(data, 20)
    assert found is not None and found.extensions[0][0] == b"TREE"
    return data, found


def _agrees(names: list[bytes], tree: bytes) -> bool:
    data, found = _index(names, tree)
    _, start, end = found.extensions[0]
    return cachetree.agrees(data, found.entries, 20, start, end)


def _tree_id(names: list[bytes], prefix: bytes = b"") -> bytes:
    """The tree git writes of files ``names`` (paths below ``prefix``),
    hashed here apart from ``cachetree``: ``<mode> <name>\\0<id>``, a
    directory's name ordered as if it ended in "/"."""
    here = {n: hashlib.sha1(prefix + n).digest() for n in names if b"/" not in n}
    below: dict[bytes, list[bytes]] = {}
    for n in names:
        if b"/" in n:
            head, _, rest = n.partition(b"/")
            below.setdefault(head, []).append(rest)
    items = [(n, b"%o" % MODE, oid, n) for n, oid in here.items()]
    items += [(n + b"/", b"40000", _tree_id(rest, prefix + n + b"/"), n) for n, rest in below.items()]
    body = b"".join(mode + b" " + name + b"\0" + oid for _, mode, oid, name in sorted(items))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()


def _node(name: bytes, count: int, subtrees: int, oid: bytes = b"") -> bytes:
    return name + b"\0" + b"%d %d\n" % (count, subtrees) + oid


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each directory ``_tree`` looks into from now on, by its cut."""
    cuts: list[int] = []
    real = cachetree._tree

    def counted(files: list[tuple[bytes, int, bytes]], cut: int, *args: object) -> bytes:
        cuts.append(cut)
        return real(files, cut, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cachetree, "_tree", counted)
    return cuts


DEEP = [b"d%04d/" % i + b"a/" * 450 + b"f" for i in range(200)]


def test_deep_names_under_an_invalid_root_are_not_looked_into(monkeypatch: pytest.MonkeyPatch) -> None:
    cuts = _calls(monkeypatch)
    assert _agrees(DEEP, _node(b"", -1, 0))  # nothing valid: nothing to disagree with
    assert cuts == [0]  # the root's entries split once; none of its 90,000 directories hashed


def test_a_valid_node_deep_down_is_hashed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The twin: a valid node at the end of a chain of invalid ones is reached,
    # hashed as git does, and told from a wrong id or count.
    chain = [b"d0007"] + [b"a"] * 450
    leaf = b"d0007/" + b"a/" * 449 + b"a"
    oid = _tree_id([b"f"], leaf + b"/")

    def tree(count: int, leaf_id: bytes) -> bytes:
        return _node(b"", -1, 1) + b"".join(_node(n, -1, 1) for n in chain[:-1]) + _node(chain[-1], count, 0, leaf_id)

    cuts = _calls(monkeypatch)
    assert _agrees(DEEP, tree(1, oid))
    assert len(cuts) == 452 and cuts[-1] == len(leaf) + 1  # the root, then each step to the leaf: no other directory
    assert not _agrees(DEEP, tree(1, bytes(20))) and not _agrees(DEEP, tree(2, oid))
    assert oid == hashlib.sha1(b"tree 29\0" + b"100644 f\0" + hashlib.sha1(DEEP[7]).digest()).digest()


def test_a_valid_root_is_hashed_as_git_does() -> None:
    names = [b"a.txt", b"a/b", b"a/c/d", b"a/c/e", b"b", b"z/y/x"]
    root = _tree_id(names)
    a_c = _tree_id([b"d", b"e"], b"a/c/")
    tree = _node(b"", 6, 1, root) + _node(b"a", -1, 1) + _node(b"c", 2, 0, a_c)
    assert _agrees(names, tree)
    assert not _agrees(names, _node(b"", 6, 1, root) + _node(b"a", -1, 1) + _node(b"c", 2, 0, root))
    assert not _agrees(names, _node(b"", 5, 0, root))
    assert not _agrees(names, _node(b"", -1, 1) + _node(b"q", 0, 0, root))  # a valid node of no directory


def test_a_file_where_a_directory_is_never_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    cuts = _calls(monkeypatch)
    assert not _agrees([b"a", b"a!", b"a/b"], _node(b"", -1, 0))  # "a!" sorts between "a" and "a/b"
    assert cuts == []
    assert _agrees([b"a.txt", b"a!", b"a/b"], _node(b"", -1, 0))  # the twin: no file in the way


def test_more_levels_than_the_bound_are_refused_before_any_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cachetree, "MAX_LEVELS", 200 * 451)
    cuts = _calls(monkeypatch)
    assert _agrees(DEEP, _node(b"", -1, 0))  # at the bound: walked
    assert cuts == [0]
    assert not _agrees(DEEP + [b"x/y"], _node(b"", -1, 0))  # one past it
    assert cuts == [0]


def test_the_nodes_paths_are_bounded_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    # A chain of nodes, each its parent's path grown by two bytes: 1,000 of
    # them spell 1,000,000 bytes of paths (a 7 KB extension; 300,000: 90 GB).
    chain = _node(b"", -1, 1) + _node(b"a", -1, 1) * 999 + _node(b"a", -1, 0)
    nodes = cachetree._nodes(chain, 20)
    assert nodes is not None and len(nodes) == 1001 and nodes[-1] == (b"a/" * 999 + b"a", -1, b"")
    total = sum(len(path) for path, _, _ in nodes)
    monkeypatch.setattr(cachetree, "_MAX_PATHS", total)
    assert cachetree._nodes(chain, 20) == nodes
    monkeypatch.setattr(cachetree, "_MAX_PATHS", total - 1)
    assert cachetree._nodes(chain, 20) is None
