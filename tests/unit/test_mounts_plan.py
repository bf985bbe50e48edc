"""dispatchd.confine.mounts: plan_mounts by equality (apply_mounts runs in the
integration and escape suites, in a real mount namespace)."""

from __future__ import annotations



from dispatchd.confine.mounts import MountPlan, plan_mounts

WT = "/home/u/src/wt"
SCRATCH = "/home/u/.local/state/dispatchd/sessions/s1"
TMP = SCRATCH + "/tmp"
RUNTIME = "/run/user/1000"


def test_plain_plan():
    got = plan_mounts(writable=[WT, SCRATCH], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got == MountPlan(writable=[WT, SCRATCH], visible=[SCRATCH, WT], private_tmp=TMP, hide=[RUNTIME], proc=True)


def test_visible_is_the_sorted_union_without_duplicates():
    got = plan_mounts(writable=["/b", "/a"], visible=["/c", "/a"], private_tmp=TMP, hide=[], proc=False)
    assert got == MountPlan(writable=["/b", "/a"], visible=["/a", "/b", "/c"], private_tmp=TMP, hide=[], proc=False)


def test_writable_keeps_its_order():
    got = plan_mounts(writable=["/z", "/a"], visible=[], private_tmp=TMP, hide=[], proc=True)
    assert got.writable == ["/z", "/a"]


def test_hide_dir_holding_the_worktree_is_dropped():
    wt = RUNTIME + "/projects/wt"
    got = plan_mounts(writable=[wt, SCRATCH], visible=[wt], private_tmp=TMP, hide=[RUNTIME, "/run/user/1000/bus"],
                      proc=True)
    assert got.hide == ["/run/user/1000/bus"]


def test_hide_dir_holding_a_visible_read_only_worktree_is_dropped():
    wt = RUNTIME + "/wt"
    got = plan_mounts(writable=[SCRATCH], visible=[wt], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_equal_to_a_kept_path_is_dropped():
    got = plan_mounts(writable=[RUNTIME], visible=[], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_holding_a_writable_extra_path_is_dropped():
    got = plan_mounts(writable=[WT, "/run/user/1000/cache"], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_holding_the_private_tmp_is_dropped():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=RUNTIME + "/s1/tmp", hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_a_shared_prefix_is_not_containment():
    # /run/user/10 does not hold /run/user/1000/wt: it stays hidden.
    got = plan_mounts(writable=[RUNTIME + "/wt"], visible=[RUNTIME + "/wt"], private_tmp=TMP,
                      hide=["/run/user/10", "/run/user/1000/w"], proc=True)
    assert got.hide == ["/run/user/10", "/run/user/1000/w"]


def test_a_hide_dir_with_a_trailing_slash_still_holds_its_children():
    got = plan_mounts(writable=[RUNTIME + "/wt"], visible=[], private_tmp=TMP, hide=[RUNTIME + "/"], proc=True)
    assert got.hide == []


def test_hide_dirs_keep_their_order():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=["/run/user/1000", "/run/a", "/mnt/x"],
                      proc=True)
    assert got.hide == ["/run/user/1000", "/run/a", "/mnt/x"]


def test_read_only_paths_default_to_none():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=[], proc=True)
    assert got.read_only == []


def test_read_only_paths_are_carried():
    protect = [WT + "/.git/config", WT + "/.git/hooks"]
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True, read_only=protect)
    assert got == MountPlan(writable=[WT], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True,
                            read_only=protect)
    protect.append("/x")
    assert got.read_only == [WT + "/.git/config", WT + "/.git/hooks"]


def test_the_plan_does_not_alias_the_callers_lists():
    writable = [WT]
    got = plan_mounts(writable=writable, visible=[], private_tmp=TMP, hide=[], proc=True)
    writable.append("/x")
    assert got.writable == [WT]
