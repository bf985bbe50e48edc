"""The tool catalogue: what each tool is, without running it (parameter
structs, JSON Schemas, descriptions, risks).

It stands at the bottom of the package (it imports msgspec and nothing of
dispatchd), so the policy, the protocol, the daemon, the worker's tools and
the client all read it without pulling one another in.

Guarantees:
- ``SPECS`` is the one list of the tools, in the order a session offers them
  (``dispatchd.policy.ALL_TOOLS`` is its keys). Each has a frozen msgspec
  struct for its parameters (unknown fields rejected) and a hand-written JSON
  Schema that describes every property, lists the required ones and forbids
  others. A unit test keeps the two in step.
- Each tool's ``risk`` ("read", "write" or "execute") is spelled here only:
  the policy, the worker and the client (through ``schemas_for``, which the
  daemon sends) all read it from here.
- ``schemas_for`` hands out copies, in the order asked for, so a caller can
  change what it gets without touching the table.
- No implementation is imported: the daemon imports this module and no tool
  code (the worker binds each spec to its function in ``dispatchd/tools/table.py``).

The schemas are written by hand, not generated, because their descriptions
are what a model reads to decide how to call a tool.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

__all__ = [
    "SPECS", "Risk", "ToolSpec", "schemas_for", "CreateFileParams", "Edit", "EditFileParams", "JobListParams",
    "JobOutputParams", "JobStopParams", "ListFilesParams", "ReadFileParams", "SearchFilesParams",
    "ShellExecParams", "WriteFileParams",
]

# What a tool may do: "read" only looks at the worktree (or a job's output);
# "write" changes files; "execute" runs or stops commands. A client asks for
# approval before "write" and "execute", and MCP marks only "read" read-only.
Risk = Literal["read", "write", "execute"]


class _Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class ReadFileParams(_Params, frozen=True):
    path: str
    start_line: int = 0
    end_line: int = -1


class WriteFileParams(_Params, frozen=True):
    path: str
    content: str


class Edit(_Params, frozen=True):
    old_text: str
    new_text: str


class EditFileParams(_Params, frozen=True):
    path: str
    edits: list[Edit]


class CreateFileParams(_Params, frozen=True):
    path: str
    content: str


class ListFilesParams(_Params, frozen=True):
    path: str = "."
    pattern: str | None = None
    recursive: bool = True


class SearchFilesParams(_Params, frozen=True):
    query: str
    path: str = "."
    pattern: str | None = None
    is_regex: bool = False


class ShellExecParams(_Params, frozen=True):
    command: str
    timeout: float | None = None
    cwd: str | None = None
    background: bool = False
    env: dict[str, str] | None = None


class JobOutputParams(_Params, frozen=True):
    job: str
    offset: int = 0
    wait: float = 0


class JobStopParams(_Params, frozen=True):
    job: str


class JobListParams(_Params, frozen=True):
    pass


def _object(properties: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_PATH = (
    "Path relative to the worktree root, e.g. 'src/main.py'. Absolute paths and '..' out of the worktree are refused."
)
_DIR = "Directory to look in, relative to the worktree root. Default '.', the root."
_GLOB = (
    "Optional glob such as '*.py'. Without a '/', it is matched against file names; with one, "
    "against paths relative to the worktree root ('src/*.py'). '*' also matches '/'."
)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str  # what a model reads to decide how to call it
    parameters: dict[str, Any]  # JSON Schema advertised to models
    params_type: type[msgspec.Struct]  # what the worker decodes the arguments into
    risk: Risk
    # Long-running tools get a thread of their own in the worker (other calls
    # on the same channel are not held up behind them), and only their calls
    # can be cancelled.
    slow: bool = False


def _tool(
    name: str,
    risk: Risk,
    struct: type[_Params],
    description: str,
    properties: dict[str, dict[str, Any]],
    required: list[str],
    slow: bool = False,
) -> ToolSpec:
    return ToolSpec(name, description, _object(properties, required), struct, risk, slow)


def _whole_file(name: str, struct: type[_Params], description: str, content: str) -> ToolSpec:
    """A tool that writes a file whole: its path and its content, both required."""
    return _tool(name, "write", struct, description, {
        "path": {"type": "string", "description": _PATH},
        "content": {"type": "string", "description": content},
    }, ["path", "content"])


_ALL = [
    _tool(
        "read_file",
        "read",
        ReadFileParams,
        "Read a text file of the worktree. Each line comes back prefixed with its 0-based line number "
        "and ': ' (e.g. '12: def main():'); the number is not part of the file. Pass start_line and "
        "end_line to read part of a long file; the numbers you see are the ones to pass. Binary files "
        "and files over the size cap (16 MiB by default) are refused.",
        {
            "path": {"type": "string", "description": _PATH},
            "start_line": {
                "type": "integer",
                "minimum": 0,
                "default": 0,
                "description": "First line to return, 0-based. Default 0.",
            },
            "end_line": {
                "type": "integer",
                "minimum": -1,
                "default": -1,
                "description": "Last line to return, 0-based and inclusive; -1 (the default) means the end.",
            },
        },
        ["path"],
    ),
    _whole_file(
        "write_file",
        WriteFileParams,
        "Write a file with the given content, replacing it whole if it exists (atomically: the file is "
        "never left half written) and creating missing parent folders. To change part of a file, "
        "prefer edit_file; to make sure you do not overwrite anything, use create_file.",
        "The complete new content of the file (UTF-8 text).",
    ),
    _tool(
        "edit_file",
        "write",
        EditFileParams,
        "Change a text file by replacing exact snippets. Edits apply in order, each to the text left by "
        "the ones before. Each old_text must occur exactly once in the file, whitespace and indentation "
        "included (copy it from read_file without the line-number prefixes); add surrounding lines if it "
        "occurs more than once. If any edit fails, nothing is changed.",
        {
            "path": {"type": "string", "description": _PATH},
            "edits": {
                "type": "array",
                "minItems": 1,
                "description": "The replacements, applied in order.",
                "items": _object(
                    {
                        "old_text": {
                            "type": "string",
                            "minLength": 1,
                            "description": "Exact text to find; it must occur exactly once.",
                        },
                        "new_text": {
                            "type": "string",
                            "description": "Text to put in its place (may be empty to delete).",
                        },
                    },
                    ["old_text", "new_text"],
                ),
            },
        },
        ["path", "edits"],
    ),
    _whole_file(
        "create_file",
        CreateFileParams,
        "Create a new file with the given content, creating missing parent folders. Fails if "
        "anything already exists at the path (use write_file to replace a file).",
        "The content of the new file (UTF-8 text).",
    ),
    _tool(
        "list_files",
        "read",
        ListFilesParams,
        "List files under a directory, one path per line, relative to the worktree root and sorted. "
        "Recursive by default (files only; symlinks are listed, not followed). With recursive=false, "
        "lists the directory's own entries, directories ending in '/'. Nothing inside .git is listed. "
        "Long listings are cut at a limit (10000 entries by default).",
        {
            "path": {"type": "string", "default": ".", "description": _DIR},
            "pattern": {"type": "string", "description": _GLOB},
            "recursive": {
                "type": "boolean",
                "default": True,
                "description": "Descend into subdirectories (default true).",
            },
        },
        [],
    ),
    _tool(
        "search_files",
        "read",
        SearchFilesParams,
        "Search the text files under a directory for a string or a regular expression. Each matching "
        "line comes back once as 'path:line: text', with the path relative to the worktree root and the "
        "line number 0-based, as read_file numbers lines. Binary files, files over the size cap and .git "
        "are skipped. At most 100 matching lines are returned by default; narrow the search if it says "
        "it stopped.",
        {
            "query": {
                "type": "string",
                "minLength": 1,
                "description": "Text to find, taken literally unless is_regex is true.",
            },
            "path": {
                "type": "string",
                "default": ".",
                "description": "Directory (or single file) to search, relative to the worktree root. Default '.'.",
            },
            "pattern": {"type": "string", "description": _GLOB + " Only matching files are searched."},
            "is_regex": {
                "type": "boolean",
                "default": False,
                "description": "Treat query as a Python regular expression, matched per line with '^' and '$' "
                "at line ends ('\\w', '\\b' and '(?i)' know ASCII only). Default false.",
            },
        },
        ["query"],
        slow=True,
    ),
    _tool(
        "shell_exec",
        "execute",
        ShellExecParams,
        "Run a command with bash (bash -c) in the sandbox, in the worktree root unless cwd says "
        "otherwise, and return its output: stdout, then stderr after a '[stderr]' line. stdin is empty; "
        "the network may be off. Each stream is cut at a cap (1 MiB by default). A non-zero exit status "
        "or a timeout is reported as an error that still carries the output; at the timeout the command "
        "and everything it started are killed. To keep something running (a dev server, a watcher, a "
        "long build), pass background=true: the call returns at once with a job id; read the job's "
        "output with job_output, end it with job_stop. A plain 'cmd &' does not outlive the call: what "
        "the command leaves running is ended when the call returns (metadata ended_processes).",
        {
            "command": {"type": "string", "minLength": 1, "description": "The command line, run by bash -c."},
            "timeout": {
                "type": "number",
                "exclusiveMinimum": 0,
                "description": "Seconds before the command is killed. Default: the policy's (120 unless it "
                "says otherwise), which also sets a maximum (3600 unless it says otherwise).",
            },
            "cwd": {
                "type": "string",
                "description": "Directory to run in, relative to the worktree root. Default: the root.",
            },
            "background": {
                "type": "boolean",
                "default": False,
                "description": "Run as a background job and return at once with its id (metadata 'job'). "
                "Default false. A timeout, if given, still ends the job; otherwise it runs until job_stop "
                "or the end of the session.",
            },
            "env": {
                "type": "object",
                "additionalProperties": {"type": "string"},
                "description": "Environment variables for this command only, e.g. {\"RUST_LOG\": \"debug\"}. "
                "LD_*, DISPATCH_*, HOME, TMPDIR and the proxy variables are refused.",
            },
        },
        ["command"],
        slow=True,
    ),
    _tool(
        "job_output",
        "read",
        JobOutputParams,
        "Read what a background job (started by shell_exec with background=true) wrote to stdout and "
        "stderr, from a byte offset on. The result says whether the job still runs and, once it ended, its "
        "exit code; pass the returned next_offset (in the metadata, also shown at the end) to read only "
        "what came after. With wait > 0, waits up to that many seconds for new output or for the job to end.",
        {
            "job": {"type": "string", "minLength": 1, "description": "The job id shell_exec returned, e.g. 'job_1'."},
            "offset": {
                "type": "integer",
                "minimum": 0,
                "default": 0,
                "description": "Byte offset to read from: 0 (the default) for the start, or the next_offset of "
                "the previous read.",
            },
            "wait": {
                "type": "number",
                "minimum": 0,
                "default": 0,
                "description": "Seconds to wait for new output (or the job's end) when there is none yet. Default 0.",
            },
        },
        ["job"],
        slow=True,
    ),
    _tool(
        "job_stop",
        "execute",
        JobStopParams,
        "Stop a background job: it and every process it started are killed. Its output stays readable "
        "with job_output.",
        {"job": {"type": "string", "minLength": 1, "description": "The job id, e.g. 'job_1'."}},
        ["job"],
        slow=True,
    ),
    _tool(
        "job_list",
        "read",
        JobListParams,
        "List this session's background jobs, one a line: id, state (running, exited N, stopped, ...) "
        "and command.",
        {},
        [],
    ),
]

SPECS: dict[str, ToolSpec] = {spec.name: spec for spec in _ALL}


def schemas_for(names: Sequence[str]) -> list[dict[str, Any]]:
    """``{"name", "description", "parameters", "risk", "slow"}`` for each named tool, in order.

    Raises ``KeyError`` naming the first unknown tool.
    """
    out = []
    for name in names:
        try:
            spec = SPECS[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r} (known: {', '.join(SPECS)})") from None
        out.append({"name": spec.name, "description": spec.description, "parameters": copy.deepcopy(spec.parameters),
                    "risk": spec.risk, "slow": spec.slow})
    return out


def warm_conversions() -> None:
    """Build msgspec's conversion tables for every tool's parameter struct now.

    msgspec builds them at a type's first conversion, in the process that
    converts: without this, each session's tool server paid it at the first
    call of each tool (0.3-0.4 ms a tool, measured), and copied the pages.
    The fork server calls it once, before it forks any session. A conversion
    that fails (no arguments) builds them as well as one that succeeds."""
    for spec in SPECS.values():
        try:
            msgspec.convert({}, spec.params_type)
        except msgspec.ValidationError:
            pass
