"""`pagedref SUBCOMMAND [flags]`: the console script (installed with the package), one word per command.

One idea: each sub-command is a module's own `main(argv)`, so `pagedref serve ...` is exactly
`python -m pagedref.serve ...` and `pagedref generate ...` exactly `python -m pagedref.generate ...`.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("pagedref.serve.__main__", "the OpenAI-compatible HTTP server (python -m pagedref.serve)"),
    "generate": ("pagedref.generate", "offline batched generation (python -m pagedref.generate)"),
    "bench": ("pagedref.bench.__main__", "the benchmarks (python -m pagedref.bench NAME)"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<9} {about}" for name, (_, about) in COMMANDS.items())
    return f"usage: pagedref {{{','.join(COMMANDS)}}} [flags]\n\n{rows}\n\n`pagedref COMMAND --help` lists a command's flags."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"pagedref: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
