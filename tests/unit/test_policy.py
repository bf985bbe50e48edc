"""dispatchd.policy: the shipped policies, strict decoding, every refusal, immutability.

Each refusal is checked by its exact message and key; each has an accepted twin
nearby (the shipped policies, or a value just inside the limit) so a pass shows
the rule, not a policy that refuses everything.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from dispatchd.errors import PolicyError
from dispatchd.policy import (
    ALL_TOOLS,
    Env,
    Filesystem,
    Limits,
    Network,
    Policy,
    Sandbox,
    default_policy_dir,
    list_policies,
    load_all,
    load_policy,
    parse_policy,
)

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "policies"
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
POSITIVE = "must be a positive number of seconds"
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def refusal(text: str, name: str = "p") -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse_policy(name, text)
    return info.value


# -- the shipped policies -----------------------------------------------------


def test_list_policies_names_the_shipped_files_sorted():
    assert list_policies(POLICIES) == ["default", "read-only"]


def test_default_policy_dir_is_the_shipped_directory():
    assert os.path.realpath(default_policy_dir()) == str(POLICIES)
    assert list_policies(default_policy_dir()) == ["default", "read-only"]


def test_load_all_loads_every_shipped_policy():
    policies = load_all(POLICIES)
    assert sorted(policies) == ["default", "read-only"]
    assert {name: p.name for name, p in policies.items()} == {"default": "default", "read-only": "read-only"}


def test_shipped_default_policy():
    p = load_policy(POLICIES, "default")
    assert p == Policy(
        name="default",
        description="Read, write, search and run commands in the worktree; network off by default.",
        tools=ALL_TOOLS,
        filesystem=Filesystem(
            read_only=SYSTEM + ("/run/systemd/resolve/resolv.conf", "/run/systemd/resolve/stub-resolv.conf",
                                "/sys/devices/system/cpu"),
            read_write=(),
            devices=DEVICES,
            worktree="read-write",
        ),
        network=Network(default="off"),
        sandbox=Sandbox(user_namespaces="auto", min_landlock_abi=1),
        limits=Limits(),
        env=Env(pass_through=("LANG", "LC_ALL", "LC_CTYPE", "TZ"), set={}),
    )


def test_default_toml_sets_each_key_to_its_built_in_default():
    """One source for the defaults: the structs of dispatchd/policy.py. The
    shipped default.toml spells them out for its readers, and every value it
    sets is the built-in one, but the two it is there to choose: its
    description, and filesystem.read_only, the system paths plus the
    resolver's files and the CPU list."""
    raw = tomllib.loads((POLICIES / "default.toml").read_text())
    loaded = load_policy(POLICIES, "default")
    # env.set is frozen as a mapping proxy once parsed: back to a dict to compare.
    shipped = msgspec.to_builtins(msgspec.structs.replace(
        loaded, env=msgspec.structs.replace(loaded.env, set=dict(loaded.env.set))))
    built_in = msgspec.to_builtins(Policy(name="default"))

    def keys(table: dict[str, object], where: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
        for key, value in table.items():
            if isinstance(value, dict):
                yield from keys(value, (*where, key))
            else:
                yield (*where, key)

    def at(tree: object, path: tuple[str, ...]) -> object:
        for key in path:
            assert isinstance(tree, dict)
            tree = tree[key]
        return tree

    differing = {".".join(path) for path in keys(raw) if at(shipped, path) != at(built_in, path)}
    assert differing == {"description", "filesystem.read_only"}
    read_only = loaded.filesystem.read_only
    assert Filesystem().read_only == SYSTEM == read_only[:len(SYSTEM)]
    assert read_only[len(SYSTEM):] == ("/run/systemd/resolve/resolv.conf", "/run/systemd/resolve/stub-resolv.conf",
                                       "/sys/devices/system/cpu")
    # The job tools it does not list come with shell_exec: the built-in list.
    assert loaded.tools == ALL_TOOLS == Policy().tools


def test_shipped_read_only_policy():
    p = load_policy(POLICIES, "read-only")
    assert p == Policy(
        name="read-only",
        description="Read, list and search the worktree; nothing is written, no command runs.",
        tools=("read_file", "list_files", "search_files"),
        filesystem=Filesystem(read_only=SYSTEM, devices=("/dev/null",), worktree="read-only"),
    )


def test_an_empty_policy_is_the_documented_defaults():
    p = parse_policy("p", "")
    assert p == Policy(name="p")
    assert p.tools == ALL_TOOLS == ("read_file", "write_file", "edit_file", "create_file", "list_files",
                                    "search_files", "shell_exec", "job_output", "job_stop", "job_list")
    assert p.filesystem == Filesystem(read_only=SYSTEM, read_write=(), devices=DEVICES, worktree="read-write")
    assert p.network == Network(default="off", connect_ports=(), bind_ports=())
    assert p.sandbox == Sandbox(user_namespaces="auto", min_landlock_abi=1)
    assert p.env == Env(pass_through=("LANG", "LC_ALL", "LC_CTYPE", "TZ"), set={})
    assert (p.limits.command_timeout_s, p.limits.max_command_timeout_s, p.limits.idle_timeout_s) == (120.0, 3600.0, 3600.0)


def test_name_in_the_file_matching_the_file_name_is_accepted():
    assert parse_policy("p", 'name = "p"').name == "p"


def test_a_valid_policy_with_every_section_set():
    text = """
        description = "x"
        tools = ["read_file", "shell_exec"]
        [filesystem]
        read_only = ["/usr"]
        read_write = ["/home/u/.cache/pip"]
        devices = ["/dev/null"]
        [network]
        default = "ports"
        connect_ports = [443, 1]
        bind_ports = [65535]
        [sandbox]
        user_namespaces = "required"
        min_landlock_abi = 4
        [limits]
        command_timeout_s = 10
        max_command_timeout_s = 10
        fsync = false
        [env]
        pass_through = ["TZ"]
        set = {CI = "1"}
    """
    p = parse_policy("p", text)
    # The job tools come with shell_exec, listed or not.
    assert p.tools == ("read_file", "shell_exec", "job_output", "job_stop", "job_list")
    assert p.filesystem.read_write == ("/home/u/.cache/pip",)
    assert p.network == Network(default="ports", connect_ports=(443, 1), bind_ports=(65535,))
    assert p.sandbox == Sandbox(user_namespaces="required", min_landlock_abi=4)
    assert (p.limits.command_timeout_s, p.limits.max_command_timeout_s, p.limits.fsync) == (10.0, 10.0, False)
    assert p.env == Env(pass_through=("TZ",), set={"CI": "1"})


# -- unknown keys, wrong types: each refused with the key's place named ---------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1", "<policy>: Object contains unknown field `colour`"),
        ("[limits]\ntimeout = 1", "<policy>: Object contains unknown field `timeout` - at `$.limits`"),
        ("[filesystem]\nread_wirte = []", "<policy>: Object contains unknown field `read_wirte` - at `$.filesystem`"),
        ("[network]\nports = [1]", "<policy>: Object contains unknown field `ports` - at `$.network`"),
        ("[sandbox]\nseccomp = false", "<policy>: Object contains unknown field `seccomp` - at `$.sandbox`"),
        ("[env]\nunset = []", "<policy>: Object contains unknown field `unset` - at `$.env`"),
        ('tools = "read_file"', "<policy>: Expected `array`, got `str` - at `$.tools`"),
        ('[limits]\ncommand_timeout_s = "10"', "<policy>: Expected `float`, got `str` - at `$.limits.command_timeout_s`"),
        ("[limits]\nfsync = 1", "<policy>: Expected `bool`, got `int` - at `$.limits.fsync`"),
        ("[limits]\noutput_cap_bytes = 1.5", "<policy>: Expected `int`, got `float` - at `$.limits.output_cap_bytes`"),
        ("[env]\nset = {A = 1}", "<policy>: Expected `str`, got `int` - at `$.env.set[...]`"),
        ('[network]\ndefault = "maybe"', "<policy>: Invalid enum value 'maybe' - at `$.network.default`"),
        ('[sandbox]\nuser_namespaces = "always"', "<policy>: Invalid enum value 'always' - at `$.sandbox.user_namespaces`"),
        ('[filesystem]\nworktree = "rw"', "<policy>: Invalid enum value 'rw' - at `$.filesystem.worktree`"),
        ("filesystem = 1", "<policy>: Expected `object`, got `int` - at `$.filesystem`"),
    ],
)
def test_unknown_key_or_wrong_type_is_refused_naming_it(text: str, message: str):
    assert refusal(text).message == message


def test_invalid_toml_is_refused():
    err = refusal("x = = 1")
    assert err.message == "<policy>: not valid TOML: Invalid value (at line 1, column 5)"
    assert isinstance(err.__cause__, Exception)


def test_where_prefixes_the_message():
    with pytest.raises(PolicyError) as info:
        parse_policy("p", "colour = 1", "/etc/dispatchd/p.toml")
    assert info.value.message == "/etc/dispatchd/p.toml: Object contains unknown field `colour`"
    assert isinstance(info.value.__cause__, msgspec.ValidationError)


def test_policy_error_code():
    assert refusal("colour = 1").code == "bad_policy"


# -- bad values ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("[limits]\ncommand_timeout_s = -1", "limits.command_timeout_s", POSITIVE),
        ("[limits]\ncommand_timeout_s = 0", "limits.command_timeout_s", POSITIVE),
        ("[limits]\nmax_command_timeout_s = -5", "limits.max_command_timeout_s", POSITIVE),
        ("[limits]\nidle_timeout_s = 0", "limits.idle_timeout_s", POSITIVE),
        ("[limits]\nidle_timeout_s = -0.001", "limits.idle_timeout_s", POSITIVE),
        ("[limits]\nsleep_after_s = -1", "limits.sleep_after_s", "must be a number of seconds, 0 (never sleep) or more"),
        ("[limits]\nsleep_after_s = nan", "limits.sleep_after_s", "must be a number of seconds, 0 (never sleep) or more"),
        ("[limits]\ncommand_timeout_s = 3601", "limits.command_timeout_s", "exceeds limits.max_command_timeout_s"),
        ("[limits]\ncommand_timeout_s = 10\nmax_command_timeout_s = 9.5", "limits.command_timeout_s",
         "exceeds limits.max_command_timeout_s"),
        ("[limits]\noutput_cap_bytes = 0", "limits.output_cap_bytes", "must be at least 1"),
        ("[limits]\nfile_size_cap_bytes = -1", "limits.file_size_cap_bytes", "must be at least 1"),
        ("[limits]\nsearch_max_results = 0", "limits.search_max_results", "must be at least 1"),
        ("[limits]\nlist_max_entries = 0", "limits.list_max_entries", "must be at least 1"),
        ("[limits]\nmodel_output_bytes = 0", "limits.model_output_bytes", "must be at least 1"),
        ("[limits]\nsession_memory_bytes = 0", "limits.session_memory_bytes", "must be at least 1"),
        ("[limits]\ncpu_weight = 0", "limits.cpu_weight", "must be between 1 and 10000 (cgroup v2 cpu.weight)"),
        ("[limits]\ncpu_weight = 10001", "limits.cpu_weight", "must be between 1 and 10000 (cgroup v2 cpu.weight)"),
        ("[network]\nconnect_ports = [0]", "network.connect_ports", "0 is not a TCP port (1-65535)"),
        ("[network]\nbind_ports = [65536]", "network.bind_ports", "65536 is not a TCP port (1-65535)"),
        ("[network]\ndomains = [\"*.org\"]", "network.domains",
         "'*.org': a wildcard over a whole top-level domain is too broad"),
        # A digit to str.isdigit(), not to int(): a ValueError out of the policy's parse, before.
        ("[network]\ndomains = [\"registry.test:\u00b9\"]", "network.domains",
         "'registry.test:\u00b9': '\u00b9' is not a TCP port (1-65535)"),
        ("[network]\ndomains = [\"127.0.0.1\"]", "network.domains",
         "'127.0.0.1': the host's loopback, link-local, cloud metadata and unspecified addresses are never relayed "
         "(a session reaches the host's own services with network 'on' or 'ports')"),
        ("[sandbox]\nmin_landlock_abi = 0", "sandbox.min_landlock_abi", "must be between 1 and 64"),
        ("[sandbox]\nmin_landlock_abi = 65", "sandbox.min_landlock_abi", "must be between 1 and 64"),
    ],
)
def test_bad_limits_ports_and_abi(text: str, key: str, why: str):
    err = refusal(text)
    assert err.message == f"<policy>: {key}: {why}"
    assert err.key == key


@pytest.mark.parametrize("value", ["nan", "-nan", "inf", "-inf"])
@pytest.mark.parametrize("key", ["command_timeout_s", "max_command_timeout_s", "idle_timeout_s"])
def test_nan_or_infinite_timeout_is_refused(key: str, value: str):
    # TOML has ``nan`` and ``inf``; ``nan <= 0`` is False, so a plain "<= 0"
    # test lets NaN through, and a NaN timeout never fires.
    text = f"[limits]\n{key} = {value}"
    if key == "command_timeout_s":
        text += "\nmax_command_timeout_s = inf" if value == "inf" else ""
    err = refusal(text)
    assert err.key == f"limits.{key}"
    assert err.message == f"<policy>: limits.{key}: {POSITIVE}"


def test_timeouts_at_the_limit_are_accepted():
    p = parse_policy("p", "[limits]\ncommand_timeout_s = 3600\nmax_command_timeout_s = 3600\nidle_timeout_s = 0.5")
    assert (p.limits.command_timeout_s, p.limits.idle_timeout_s) == (3600.0, 0.5)


@pytest.mark.parametrize("key", ["read_only", "read_write", "devices"])
@pytest.mark.parametrize("path", ["usr", "./usr", "/usr/", "/usr/../etc", "/usr//lib", "/usr/./lib", ""])
def test_relative_or_unnormalised_path_is_refused(key: str, path: str):
    err = refusal(f"[filesystem]\n{key} = [{path!r}]".replace("'", '"'))
    assert err.key == f"filesystem.{key}"
    assert err.message == f"<policy>: filesystem.{key}: {path!r} must be an absolute, normalised path"


@pytest.mark.parametrize("key", ["read_only", "read_write", "extra_read_only"])
def test_granting_root_is_refused(key: str):
    err = refusal(f'[filesystem]\n{key} = ["/"]')
    assert err.key == f"filesystem.{key}"
    assert err.message == f"<policy>: filesystem.{key}: granting the whole filesystem defeats the sandbox"


@pytest.mark.parametrize("key", ["read_only", "read_write"])
@pytest.mark.parametrize("path", ["//", "//usr"])
def test_double_slash_root_is_refused(key: str, path: str):
    # POSIX normpath keeps a leading "//", so "//" passes the "normalised"
    # test and is not == "/": yet open("//") is the root directory, so
    # read_write = ["//"] would grant the whole filesystem read-write.
    err = refusal(f'[filesystem]\n{key} = ["{path}"]')
    assert err.key == f"filesystem.{key}"
    assert err.message == f"<policy>: filesystem.{key}: {path!r} must be an absolute, normalised path"


def test_root_device_is_refused_as_outside_dev():
    err = refusal('[filesystem]\ndevices = ["/"]')
    assert err.message == "<policy>: filesystem.devices: '/' is not under /dev"


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev", "/devices/x", "/home/u/dev/null"])
def test_device_outside_dev_is_refused(path: str):
    err = refusal(f'[filesystem]\ndevices = ["{path}"]')
    assert err.key == "filesystem.devices"
    assert err.message == f"<policy>: filesystem.devices: {path!r} is not under /dev"


def test_device_under_dev_is_accepted():
    assert parse_policy("p", '[filesystem]\ndevices = ["/dev/tty", "/dev/pts/0"]').filesystem.devices == (
        "/dev/tty", "/dev/pts/0")


def test_unknown_tool_is_refused():
    err = refusal('tools = ["read_file", "rm_rf"]')
    assert err.key == "tools"
    assert err.message == (
        "<policy>: tools: unknown tool 'rm_rf' (known: read_file, write_file, edit_file, create_file, "
        "list_files, search_files, shell_exec, job_output, job_stop, job_list)"
    )


def test_job_tools_come_with_shell_exec_only():
    err = refusal('tools = ["read_file", "job_list"]')
    assert err.key == "tools"
    assert err.message == "<policy>: tools: job_list come with shell_exec, which this policy does not offer"
    assert parse_policy("p", 'tools = ["shell_exec", "job_list"]').tools == (
        "shell_exec", "job_list", "job_output", "job_stop")
    assert parse_policy("p", 'tools = ["read_file"]').tools == ("read_file",)


def test_duplicate_tool_is_refused():
    err = refusal('tools = ["read_file", "list_files", "read_file"]')
    assert err.key == "tools"
    assert err.message == "<policy>: tools: a tool is listed twice"


def test_writing_tools_under_a_read_only_worktree_are_refused():
    err = refusal('tools = ["shell_exec", "read_file", "edit_file"]\n[filesystem]\nworktree = "read-only"')
    assert err.key == "tools"
    assert err.message == "<policy>: tools: a read-only worktree cannot offer edit_file, shell_exec"


@pytest.mark.parametrize("tool", ["write_file", "edit_file", "create_file", "shell_exec"])
def test_each_mutating_tool_is_refused_under_a_read_only_worktree(tool: str):
    err = refusal(f'tools = ["{tool}"]\n[filesystem]\nworktree = "read-only"')
    assert err.message == f"<policy>: tools: a read-only worktree cannot offer {tool}"


def test_name_mismatch_is_refused():
    err = refusal('name = "other"', name="p")
    assert err.key == "name"
    assert err.message == "<policy>: name: 'other' does not match the file name 'p'"


# -- loading from a directory -------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "-x", "x y", "x" * 65, "/etc/passwd", "é"])
def test_bad_policy_name_is_refused_before_any_file_is_read(tmp_path: Path, name: str):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, name)
    assert info.value.key == "name"
    assert info.value.message == f"{name!r} is not a policy name (letters, digits, '.', '_', '-')"


def test_longest_policy_name_is_accepted(tmp_path: Path):
    name = "a" * 64
    (tmp_path / f"{name}.toml").write_text("")
    assert load_policy(tmp_path, name).name == name


def test_unknown_policy_lists_the_known_ones(tmp_path: Path):
    (tmp_path / "b.toml").write_text("")
    (tmp_path / "a.toml").write_text("")
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, "c")
    assert info.value.key == "name"
    assert info.value.message == f"no policy named 'c' in {tmp_path} (known: a, b)"


def test_unknown_policy_in_an_empty_directory(tmp_path: Path):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, "c")
    assert info.value.message == f"no policy named 'c' in {tmp_path} (known: none)"


def test_unreadable_policy_is_refused(tmp_path: Path):
    (tmp_path / "d.toml").mkdir()
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, "d")
    assert info.value.message == f"{tmp_path / 'd.toml'}: not a regular file (a directory): a policy is a TOML file"
    (tmp_path / "l.toml").symlink_to(tmp_path / "l-target.toml")  # dangling: as absent
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, "l")
    assert info.value.message.startswith("no policy named 'l' in ")


def test_load_policy_names_the_file_in_errors(tmp_path: Path):
    (tmp_path / "p.toml").write_text("[limits]\nx = 1\n")
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path, "p")
    assert info.value.message == f"{tmp_path / 'p.toml'}: Object contains unknown field `x` - at `$.limits`"


def test_load_all_raises_on_the_first_broken_policy(tmp_path: Path):
    (tmp_path / "good.toml").write_text("")
    (tmp_path / "bad.toml").write_text('tools = ["nope"]\n')
    with pytest.raises(PolicyError) as info:
        load_all(tmp_path)
    assert info.value.key == "tools"
    assert info.value.message.startswith(f"{tmp_path / 'bad.toml'}: tools: unknown tool 'nope'")


def test_load_all_of_a_good_directory(tmp_path: Path):
    (tmp_path / "one.toml").write_text('description = "1"')
    (tmp_path / "two.toml").write_text('name = "two"')
    (tmp_path / "notes.txt").write_text("not a policy")
    assert load_all(tmp_path) == {"one": Policy(name="one", description="1"), "two": Policy(name="two")}


def test_list_policies_of_a_missing_directory(tmp_path: Path):
    assert list_policies(tmp_path / "missing") == []


# -- immutability -------------------------------------------------------------


def test_policy_is_frozen():
    p = parse_policy("p", "")
    with pytest.raises(AttributeError):
        p.name = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.limits.command_timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.filesystem.worktree = "read-only"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.sandbox.user_namespaces = "never"  # type: ignore[misc]
    assert p == Policy(name="p")


def test_policy_lists_cannot_be_changed_in_place():
    # The module promises "The Policy is immutable"; a frozen Struct only
    # stops attribute assignment, and one Policy object is shared by every
    # session opened with it, so an in-place change would reach them all.
    p = parse_policy("p", 'tools = ["read_file"]\n[filesystem]\nread_write = ["/srv"]\n[network]\nconnect_ports = [1]')
    for seq in (p.tools, p.filesystem.read_only, p.filesystem.read_write, p.filesystem.devices,
                p.network.connect_ports, p.network.bind_ports, p.env.pass_through):
        assert type(seq) is tuple
    with pytest.raises(AttributeError):
        p.tools.append("shell_exec")  # type: ignore[attr-defined]
    assert p.tools == ("read_file",)


def test_policy_env_set_cannot_be_changed_in_place():
    # The same promise for the one mapping: env.set is handed to every
    # session's environment (plan_session), so an in-place write would leak
    # into every later session of that policy.
    p = parse_policy("p", '[env]\nset = {CI = "1"}')
    with pytest.raises(TypeError):
        p.env.set["LD_PRELOAD"] = "/tmp/evil.so"  # type: ignore[index]
    assert dict(p.env.set) == {"CI": "1"}


def test_the_minimal_root_is_the_default():
    fs = parse_policy("p", "").filesystem
    assert (fs.root, fs.extra_read_only, fs.landlock_grants_root) == ("minimal", (), False)


def test_extra_read_only_paths_are_read():
    fs = parse_policy("p", '[filesystem]\nextra_read_only = ["/opt/rust", "/home/u/.cargo"]').filesystem
    assert fs.extra_read_only == ("/opt/rust", "/home/u/.cargo")


def test_landlock_granting_the_root_is_refused_on_the_hosts_root():
    err = refusal('[filesystem]\nroot = "host"\nlandlock_grants_root = true')
    assert err.key == "filesystem.landlock_grants_root"
    assert err.message == ('<policy>: filesystem.landlock_grants_root: only with root = "minimal": on the host\'s '
                           'root it would grant reading the whole machine')
    assert parse_policy("p", '[filesystem]\nlandlock_grants_root = true').filesystem.landlock_grants_root


def test_an_unknown_root_is_refused():
    err = refusal('[filesystem]\nroot = "chroot"')
    assert err.key == "filesystem.root"


def test_network_domains():
    p = parse_policy("p", '[network]\ndefault = "domains"\ndomains = ["pypi.org", "*.pythonhosted.org"]')
    assert p.network == Network(default="domains", domains=("pypi.org", "*.pythonhosted.org"))
    assert type(p.network.domains) is tuple


# -- read at every load, parsed again only when the bytes changed ----------------


def test_an_edited_policy_is_seen_at_the_next_load_even_with_the_same_size_and_times(tmp_path: Path):
    """The parse is reused by the file's text, never by its metadata: an edit
    that keeps the size and puts the modification time back is still seen."""
    path = tmp_path / "p.toml"
    path.write_text("[limits]\nmax_processes = 100\n")
    before = os.stat(path)
    assert load_policy(tmp_path, "p").limits.max_processes == 100
    path.write_text("[limits]\nmax_processes = 200\n")  # same length
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert load_policy(tmp_path, "p").limits.max_processes == 200


def test_an_unchanged_policy_loads_again_as_the_same_parse(tmp_path: Path):
    """The twin: the same bytes give the same (frozen, shared) Policy."""
    path = tmp_path / "p.toml"
    path.write_text("[limits]\nmax_processes = 100\n")
    first = load_policy(tmp_path, "p")
    os.utime(path, ns=(1, 1))  # new times alone change nothing
    again = load_policy(tmp_path, "p")
    assert again is first and again.limits.max_processes == 100


def test_a_policy_broken_after_a_good_load_is_refused_at_the_next(tmp_path: Path):
    path = tmp_path / "p.toml"
    path.write_text("[limits]\nmax_processes = 100\n")
    load_policy(tmp_path, "p")
    path.write_text("[limits]\nmax_processes = 100\nx = 1\n")
    with pytest.raises(PolicyError):
        load_policy(tmp_path, "p")


def test_checkpoints_section_defaults_and_bounds():
    from dispatchd.policy import Checkpoints

    assert parse_policy("p", "").checkpoints == Checkpoints(before_writes=False, keep=20, max_files=200_000,
                                                            max_bytes=4 * 1024**3, max_depth=256)
    assert load_policy(POLICIES, "default").checkpoints == Checkpoints()
    assert parse_policy("p", "[checkpoints]\nbefore_writes = true\nkeep = 3").checkpoints == Checkpoints(
        before_writes=True, keep=3)
    with pytest.raises(PolicyError) as err:
        parse_policy("p", "[checkpoints]\nkeep = 0")
    assert err.value.key == "checkpoints.keep"
    assert "checkpoints.keep: must be at least 1" in err.value.message
