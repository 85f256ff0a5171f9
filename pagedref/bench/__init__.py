"""Benchmarks as commands: `python -m pagedref.bench {kernel,memory,serve,latency} [options]`.

One idea: every number in docs/benchmarks.md comes from one of these commands, printed as a table
(and as JSON with --json), with the command line, device and date beside it. Benchmarks measure;
they never assert.
"""
