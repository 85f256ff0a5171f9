"""`python -m pagedref.bench NAME [args]`: run benchmark `pagedref.bench.NAME` (its `main(argv)`)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("kernel", "memory", "serve", "latency", "step", "profile", "online", "spec", "gemm", "gather", "overlap")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m pagedref.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"pagedref.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
