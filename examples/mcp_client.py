"""Any MCP client can use dispatchd: here, the official ``mcp`` SDK's own.

    python examples/mcp_client.py [WORKTREE]           # default: $DISPATCH_WORKTREE, else .

It starts ``dispatch mcp --worktree WORKTREE`` as an MCP server on stdio (as
Claude Desktop, Claude Code or an IDE would), lists the tools and calls a
few. No model is involved: an MCP host puts these tools in front of its own.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

# Variables the server needs to find the daemon (the SDK passes few by default).
PASS = ("DISPATCH_SOCKET", "XDG_RUNTIME_DIR", "XDG_STATE_HOME")


async def main(worktree: str) -> int:
    server = StdioServerParameters(
        command=sys.executable,  # this Python, which has dispatch installed; or just "dispatch"
        args=["-P", "-m", "dispatch.cli", "mcp", "--worktree", worktree, "--network", "off"],  # -P: not the cwd's modules
        env={k: os.environ[k] for k in PASS if k in os.environ},
    )
    async with stdio_client(server) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        tools = await mcp.list_tools()
        print("tools:", ", ".join(t.name for t in tools.tools))
        for name, arguments in [
            ("list_files", {"recursive": False}),
            ("shell_exec", {"command": "uname -s; id -un; ls / | head -3"}),
            ("read_file", {"path": "../outside"}),  # refused: the sandbox shows why
        ]:
            result = await mcp.call_tool(name, arguments)
            text = result.content[0].text if result.content else ""
            print(f"{name} -> {'error' if result.is_error else 'ok'}:\n  " + text.replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DISPATCH_WORKTREE", "."))))
