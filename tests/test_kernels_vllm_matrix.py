"""vLLM's paged-attention kernel test matrix, run on pagedref's kernels (GPU; skips without one).

One idea: the shapes, pools and tolerances vLLM tests its own kernels with are a public bar, so the
matrix of vLLM's tests/kernels/test_attention.py (decode, `test_paged_attention`) and
tests/kernels/test_prefix_prefill.py (query rows after a cached context, `test_contexted_kv_attention`)
is ported here: 7 sequences; (query, KV) heads (40, 40) and (64, 8); head sizes 64, 80, 96, 112, 120,
128, 192 and 256; block sizes 16 and 32; float16, bfloat16 and float32; a pool of vLLM's 4321 blocks
with every block-table entry drawn at random from the whole pool, so blocks repeat within a sequence
and across sequences; data drawn as vLLM draws it (decode: uniform in +-1/sqrt(head_size); prefix
prefill: uniform in +-1e-3). Every (heads, head size, block size, dtype) case runs; the context
lengths are sampled per case (seeded by the case), one sequence always at MAX_SEQ_LEN (over 16k
tokens, 17 of decode v3's partitions, the last one partial).

Each output is held to vLLM's elementwise tolerance (decode atol 1e-3, rtol 1e-5; prefix prefill
atol 1e-4, rtol 0) against a float64 oracle computed on the GPU from the pool through the block
tables, and to this project's norm-relative bound (fp32 1e-5, fp16/bf16 1e-2); every element of a
NaN-poisoned output is written; blocks no table references hold NaN and are never read; and each
sequence run alone gives the bits it got in the batch. `configs()` lists the kernel configurations
the matrix compiles, for `pagedref.kernels.build.precompile`.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from pagedref import kernels
from pagedref.kernels import build, gpu_available, validate
from pagedref.kernels import testing as T
from pagedref.kernels.launch import _decode_kernel, _prefill_version
from pagedref.kernels.splitk import heads_per_cta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]

NUM_SEQS = 7
NUM_HEADS = [(40, 40), (64, 8)]
HEAD_SIZES = [64, 80, 96, 112, 120, 128, 192, 256]
BLOCK_SIZES = [16, 32]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
NUM_BLOCKS = 4321  # vLLM's pool size for these tests
MAX_SEQ_LEN = 16 * 1024 + 37  # vLLM sizes it from shared memory (57,600 on an H200); over 16k is the bar here
MAX_QUERY_LEN = 1024  # test_prefix_prefill's MAX_SEQ_LEN (query rows per sequence)
DECODE_TOL = dict(atol=1e-3, rtol=1e-5)  # test_paged_attention
PREFILL_TOL = dict(atol=1e-4, rtol=0.0)  # test_contexted_kv_attention
NORM_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
CASES = [(h, d, b, t) for h in NUM_HEADS for d in HEAD_SIZES for b in BLOCK_SIZES for t in DTYPES]


@pytest.fixture(autouse=True)
def release_the_pool():
    """A case's pool is up to 11 GB (fp32, head size 256): give it back to the device after each case,
    so test processes running side by side do not hold several."""
    yield
    torch.cuda.empty_cache()


def case_id(num_heads, head_size, block_size, dtype) -> str:
    return f"{num_heads[0]}x{num_heads[1]}-d{head_size}-b{block_size}-{str(dtype).split('.')[-1]}"


def configs() -> list[build.KernelConfig]:
    """Every kernel configuration the matrix launches (decode's default version, prefill's)."""
    out = []
    for (num_heads, num_kv_heads), head_size, block_size, dtype in CASES:
        name, elem = validate.DTYPE_NAMES[dtype], torch.tensor([], dtype=dtype).element_size()
        version, tuning = _decode_kernel(3, None, elem, head_size)
        out.append(build.decode_config(name, head_size, block_size, heads_per_cta(num_heads, num_kv_heads), tuning))
        for version in (2, 3):  # test_prefix_prefill_matrix's default (v3 on this device where it applies) and v2
            out.append(build.prefill_config(name, head_size, block_size,
                                            _prefill_version(version, elem, head_size, _capability())))
    return list(dict.fromkeys(out))


class Pool:
    """vLLM's test pool: NUM_BLOCKS blocks of uniform data, random block tables (repeats allowed),
    and NaN in every block that no table references."""

    def __init__(self, num_heads, head_size, block_size, dtype, context_lens, data_range, seed):
        self.num_heads, self.num_kv_heads = num_heads
        self.head_size, self.block_size, self.dtype = head_size, block_size, dtype
        gen = torch.Generator(device="cuda").manual_seed(seed)
        shape = (NUM_BLOCKS, block_size, self.num_kv_heads, head_size)
        self.k_cache = torch.empty(shape, dtype=dtype, device="cuda").uniform_(-data_range, data_range, generator=gen)
        self.v_cache = torch.empty(shape, dtype=dtype, device="cuda").uniform_(-data_range, data_range, generator=gen)
        max_blocks = -(-max(context_lens) // block_size)
        self.block_tables = torch.randint(0, NUM_BLOCKS, (len(context_lens), max_blocks), generator=gen,
                                          device="cuda", dtype=torch.int32)
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
        self.used = [self.block_tables[s, : -(-c // block_size)] for s, c in enumerate(context_lens)]
        unused = torch.ones(NUM_BLOCKS, dtype=torch.bool, device="cuda")
        unused[torch.cat(self.used).long()] = False
        self.k_cache[unused] = float("nan")
        self.v_cache[unused] = float("nan")
        self.scale = head_size**-0.5

    def repeats(self) -> tuple[bool, bool]:
        """(some sequence uses a block twice, two sequences share a block): what the matrix claims to test."""
        within = any(len(torch.unique(u)) < len(u) for u in self.used)
        sets = [set(u.tolist()) for u in self.used]
        across = any(sets[a] & sets[b] for a in range(len(sets)) for b in range(a + 1, len(sets)))
        return within, across

    def sequence_kv(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence s's K and V in token order, float64: [context_len, num_kv_heads, head_size]."""
        n = int(self.context_lens[s])
        idx = self.used[s].long()
        k = self.k_cache[idx].reshape(-1, self.num_kv_heads, self.head_size)[:n]
        v = self.v_cache[idx].reshape(-1, self.num_kv_heads, self.head_size)[:n]
        return k.double(), v.double()

    def oracle(self, q: torch.Tensor, s: int) -> torch.Tensor:
        """Float64 causal attention of sequence s's query rows q [rows, num_heads, head_size] (the
        context's last rows) over its context, on the GPU -> [rows, num_heads, head_size]."""
        k, v = self.sequence_kv(s)
        n, rows, d = k.shape[0], q.shape[0], self.head_size
        group = self.num_heads // self.num_kv_heads
        out = torch.empty(rows, self.num_heads, d, dtype=torch.float64, device="cuda")
        step = max(1, (1 << 27) // (self.num_heads * n))  # rows per chunk: scores of at most 1 GB
        for r0 in range(0, rows, step):
            qc = q[r0 : r0 + step].double().view(-1, self.num_kv_heads, group, d)  # [r, Hkv, G, d]
            scores = torch.einsum("rhgd,khd->hgrk", qc, k) * self.scale  # [Hkv, G, r, n]
            pos = n - rows + r0 + torch.arange(qc.shape[0], device="cuda")
            scores.masked_fill_(torch.arange(n, device="cuda")[None, :] > pos[:, None], float("-inf"))
            out[r0 : r0 + step] = torch.einsum("hgrk,khd->rhgd", scores.softmax(-1), v).reshape(-1, self.num_heads, d)
        return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: dict, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: a NaN or an unwritten element"
    got = out.double()
    err = (got - ref).abs()
    bad = err > tol["atol"] + tol["rtol"] * ref.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements outside vLLM's {tol}, max abs error {err.max():.2e}"
    rel = (got - ref).norm() / ref.norm()
    assert rel <= NORM_TOL[dtype], f"{what}: norm-relative error {rel:.2e} > {NORM_TOL[dtype]}"


def case_rng(*case) -> random.Random:
    return random.Random(zlib.crc32(case_id(*case).encode()))


@pytest.mark.parametrize("num_heads,head_size,block_size,dtype", CASES, ids=[case_id(*c) for c in CASES])
def test_decode_matrix(num_heads, head_size, block_size, dtype):
    rng = case_rng(num_heads, head_size, block_size, dtype)
    context_lens = [rng.randint(1, MAX_SEQ_LEN) for _ in range(NUM_SEQS)]
    context_lens[-1] = MAX_SEQ_LEN  # as vLLM: the last sequence at the longest context
    seed = rng.randrange(2**31)
    pool = Pool(num_heads, head_size, block_size, dtype, context_lens, head_size**-0.5, seed)
    assert pool.repeats() == (True, True)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.empty(NUM_SEQS, num_heads[0], head_size, dtype=dtype, device="cuda")
    q.uniform_(-pool.scale, pool.scale, generator=gen)

    def run(rows: slice) -> torch.Tensor:  # (a slice is copied: the kernels take 16-byte aligned tensors)
        return kernels.paged_attention_decode(q[rows].clone(), pool.k_cache, pool.v_cache, pool.block_tables[rows].clone(),
                                              pool.context_lens[rows].clone(), pool.scale,
                                              out=torch.full_like(q[rows], float("nan")))
    out = run(slice(None))
    ref = torch.cat([pool.oracle(q[s : s + 1], s) for s in range(NUM_SEQS)])
    check(out, ref, dtype, DECODE_TOL, f"decode, context lengths {context_lens}")
    for s in range(NUM_SEQS):  # alone, each sequence gets the bits it got in the batch
        assert T.same_bits(run(slice(s, s + 1)), out[s : s + 1]), f"sequence {s} alone differs from the batch"


# Prefix prefill runs the default kernel (v3 on an sm_90 device where it applies); the cases v3 takes
# also run v2, which serves them on other devices.
PREFILL_CASES = [(*c, None) for c in CASES] + [
    (*c, 2) for c in CASES if build.prefill_v3_supported(torch.tensor([], dtype=c[3]).element_size(), c[1], (9, 0))]


def _capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.parametrize("num_heads,head_size,block_size,dtype,version", PREFILL_CASES,
                         ids=[case_id(*c[:4]) + ("" if c[4] is None else f"-v{c[4]}") for c in PREFILL_CASES])
def test_prefix_prefill_matrix(num_heads, head_size, block_size, dtype, version):
    rng = case_rng(num_heads, head_size, block_size, dtype)
    query_lens = [rng.randint(16, MAX_QUERY_LEN) for _ in range(NUM_SEQS)]
    query_lens[-1] = 1  # as vLLM: one sequence of the batch is a decode
    # Cached tokens before the query rows: none (a plain prompt), vLLM's 16..1024, then one sequence
    # reaching MAX_SEQ_LEN and the decode row after a random context of up to MAX_SEQ_LEN.
    cached = [0] + [rng.randint(16, 1024) for _ in range(NUM_SEQS - 3)]
    cached += [MAX_SEQ_LEN - query_lens[-2], rng.randint(16, MAX_SEQ_LEN - 1)]
    context_lens = [c + q for c, q in zip(cached, query_lens)]
    seed = rng.randrange(2**31)
    pool = Pool(num_heads, head_size, block_size, dtype, context_lens, 1e-3, seed)
    assert pool.repeats() == (True, True)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.empty(sum(query_lens), num_heads[0], head_size, dtype=dtype, device="cuda").uniform_(-1e-3, 1e-3, generator=gen)
    starts = [sum(query_lens[:s]) for s in range(NUM_SEQS + 1)]

    def run(seqs: slice) -> torch.Tensor:
        lens = query_lens[seqs]
        qsl = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
        rows = q[starts[seqs.start or 0] : starts[seqs.stop if seqs.stop is not None else NUM_SEQS]].clone()
        return kernels.paged_prefill(rows, pool.k_cache, pool.v_cache, pool.block_tables[seqs].clone(),
                                     pool.context_lens[seqs].clone(), qsl, pool.scale, out=torch.full_like(rows, float("nan")),
                                     version=version)
    out = run(slice(None))
    ref = torch.cat([pool.oracle(q[starts[s] : starts[s + 1]], s) for s in range(NUM_SEQS)])
    check(out, ref, dtype, PREFILL_TOL, f"prefix prefill, query lengths {query_lens}, context lengths {context_lens}")
    for s in range(NUM_SEQS):
        assert T.same_bits(run(slice(s, s + 1)), out[starts[s] : starts[s + 1]]), f"sequence {s} alone differs"
