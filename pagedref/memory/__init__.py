"""KV-cache memory: the contiguous baseline (stage 1), the block allocator (stage 2), block tables
(stage 3) and sharing — copy-on-write forks and prefix caching (stage 4)."""
