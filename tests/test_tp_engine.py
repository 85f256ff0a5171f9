"""`LLM(tensor_parallel_size=2)` on the CPU (gloo): the same greedy tokens as one process, and no process left behind.

Rank 0 is this test process; it spawns rank 1, sends it every step and stops it on close() or on any
failure. The failure tests kill the worker (SIGKILL) or make it raise in the middle of a generation,
then check that the engine raises an error naming the worker and that every child has been reaped.
A hung test must fail rather than hang CI: `no_hang` aborts the run (dumping every thread's stack).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal

import pytest
import torch

import pagedref.distributed.worker as tp_worker
from helpers import model_path
from pagedref import LLM, SamplingParams
from pagedref.distributed.worker import TPWorkerError, Worker

TEST_TIMEOUT_S = 120
PROMPTS = [{"prompt_token_ids": [1, 45, 300, 12, 7, 99, 4, 250, 31, 8, 200, 64, 3, 77, 41, 9, 2]},
           {"prompt_token_ids": [1, 17, 5]},
           {"prompt_token_ids": [1, 45, 300, 12, 7, 99, 4, 250, 31, 8, 200, 64, 3, 77, 41, 9, 5, 6]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_hang(request):
    faulthandler.dump_traceback_later(request.module.TEST_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    assert multiprocessing.active_children() == [], "a worker process outlived its test"


def run(name: str, tp: int, **kw):
    """Greedy tokens and logits of PROMPTS at tensor_parallel_size=tp; the LLM is closed after."""
    llm = LLM(model_path(name), device="cpu", max_model_len=32, record_logits=True, tensor_parallel_size=tp, **kw)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        stats = llm.get_stats()
        assert stats["num_swap_outs"] > 0, "the pool is meant to force preemption by swap"
        return [(c.token_ids, c.logits) for o in outputs for c in o.outputs]
    finally:
        llm.close()


def assert_same_tokens(tp1, tp2) -> None:
    for (ids, logits), (tp_ids, tp_logits) in zip(tp1, tp2):
        assert tp_ids == ids
        # Never NaN (every slot a row reads was written on every rank) and within float32 reassociation
        # of the single-process run (the row-parallel sums are split in two): measured up to 2e-5.
        assert (tp_logits - logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["stories260K", "tiny-llama3-hd64", "tiny-mistral-hd32"])
def test_tp2_greedy_tokens_equal_tp1(name):
    # A pool small enough for preemption by swap, and a token budget that chunks the prompts: the
    # swap-outs, swap-ins and chunked prefills all run on both ranks' pools.
    kw = dict(num_kv_blocks=9, block_size=4, preemption_mode="swap", max_num_batched_tokens=8)
    assert_same_tokens(run(name, 1, **kw), run(name, 2, **kw))


def test_tp2_keeps_the_engine_batch_invariant():
    # The CPU numerics contract at TP=2: a request's logits, batched with preemption by swap and
    # chunked prefill, are bit-identical to the same request run alone.
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=32, record_logits=True, tensor_parallel_size=2,
              num_kv_blocks=9, block_size=4, preemption_mode="swap", max_num_batched_tokens=8)
    try:
        batched = llm.generate(PROMPTS, GREEDY)
        assert llm.get_stats()["num_swap_outs"] > 0
        for prompt, out in zip(PROMPTS, batched):
            [alone] = llm.generate(prompt, GREEDY)
            assert torch.equal(out.outputs[0].logits, alone.outputs[0].logits)
    finally:
        llm.close()


def test_copy_on_write_reaches_every_rank():
    # n=2 forks the prompt's blocks; the first decode of each sample copies the shared, partly filled
    # last block (copy-on-write), on rank 0's pool and the worker's alike.
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, record_logits=True, tensor_parallel_size=tp,
                  num_kv_blocks=32, block_size=4)
        try:
            outs.append([(c.token_ids, c.logits) for c in llm.generate(PROMPTS[1], params)[0].outputs])
        finally:
            llm.close()
    assert_same_tokens(*outs)


def test_kv_heads_that_do_not_divide_fail_before_any_process_starts():
    # tiny-qwen2-hd128: 2 query heads, 1 KV head. pagedref refuses (vLLM would replicate the KV head).
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by tensor_parallel_size=2"):
        LLM(model_path("tiny-qwen2-hd128"), device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), ("2", TypeError)])
def test_tensor_parallel_size_is_checked(value, error):
    with pytest.raises(error, match="tensor_parallel_size"):
        LLM(model_path("stories260K"), device="cpu", tensor_parallel_size=value)


def test_an_error_after_the_workers_started_stops_them():
    # The pool is checked after the workers have loaded their shards: 1 block cannot hold a sequence.
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=1, tensor_parallel_size=2)


def test_close_stops_and_reaps_the_workers():
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    procs = llm.llm_engine.runner.workers.procs
    assert len(procs) == 1 and procs[0].is_alive()
    llm.generate(PROMPTS[1], GREEDY)
    llm.close()
    assert procs[0].exitcode == 0, "a healthy worker leaves when told to, exit code 0"
    llm.close()  # closing twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS[1], GREEDY)


def test_only_one_tensor_parallel_llm_per_process():
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match="close it first"):
            LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    finally:
        llm.close()


def test_a_killed_worker_fails_the_engine_and_nothing_is_left():
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[0], GREEDY)
    engine.step()  # the prefill, on both ranks
    worker = engine.runner.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(TPWorkerError, match="worker rank 1 failed: exited with signal SIGKILL"):
        engine.step()
    with pytest.raises(TPWorkerError, match="stopped after an earlier failure"):
        engine.step()
    llm.close()


def failing_worker_main(*args):
    """worker_main, with a worker whose third step raises (in the spawned process)."""
    real = Worker.execute_model
    calls = []

    def execute_model(self, msg):
        calls.append(1)
        if len(calls) == 3:
            raise FloatingPointError("injected failure in the worker's third step")
        return real(self, msg)

    Worker.execute_model = execute_model
    tp_worker.worker_main(*args)


def test_an_error_in_a_worker_fails_the_engine_with_its_traceback(monkeypatch):
    monkeypatch.setattr(tp_worker, "worker_main", failing_worker_main)  # spawn pickles the target by name
    llm = LLM(model_path("stories260K"), device="cpu", max_model_len=64, num_kv_blocks=16, tensor_parallel_size=2)
    with pytest.raises(TPWorkerError, match="worker rank 1 failed: Traceback") as info:
        llm.generate(PROMPTS, GREEDY)
    assert "FloatingPointError: injected failure in the worker's third step" in str(info.value)
    assert llm.llm_engine.runner.workers.procs[0].exitcode == 1
    llm.close()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message on machines with fewer than 2 GPUs")
def test_cuda_needs_one_gpu_per_rank():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(model_path("stories260K"), device="cuda", tensor_parallel_size=2)
    else:
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            LLM(model_path("stories260K"), device="cuda", tensor_parallel_size=2)


TORCHRUN_SCRIPT = """
import json, sys
import torch.distributed as dist
from pagedref import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", max_model_len=32, num_kv_blocks=16, tensor_parallel_size=2)
# Rank 1 never gets here: its LLM(...) served rank 0 until close(), then ended the process.
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
print("RANK", dist.get_rank(), "OF", dist.get_world_size(), "SPAWNED", len(llm.llm_engine.runner.workers.procs))
llm.close()
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


def test_under_torchrun_rank0_drives_and_rank1_serves(tmp_path):
    import json
    import subprocess
    import sys

    from pagedref.distributed.parallel import free_port

    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    name = model_path("tiny-llama3-hd64")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(name), json.dumps(PROMPTS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANK 0 OF 2 SPAWNED 0" in proc.stdout.splitlines()  # torchrun's rank 1 served: none spawned
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    llm = LLM(name, device="cpu", max_model_len=32, num_kv_blocks=16)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.close()
    assert json.loads(line.removeprefix("TOKENS ")) == want


# --- the CLI: python -m pagedref.generate --tensor-parallel-size 2 --------------------------------------
def run_cli(*args: str) -> tuple:
    """Run the CLI in its own process; returns (the completed process, the pids it left running)."""
    import subprocess
    import sys
    import uuid

    from helpers import REPO_ROOT

    mark = uuid.uuid4().hex  # inherited by the CLI and by every process it starts
    env = {**os.environ, "PAGEDREF_TP_TEST_MARK": mark}
    res = subprocess.run([sys.executable, "-m", "pagedref.generate", *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=TEST_TIMEOUT_S, env=env)
    return res, processes_marked(mark)


def processes_marked(mark: str) -> list[int]:
    """Pids of the live processes whose environment holds PAGEDREF_TP_TEST_MARK=mark."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if f"PAGEDREF_TP_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours
                pass
    return found


def test_cli_tensor_parallel_gives_the_single_process_tokens_and_leaves_nothing():
    import json

    name = model_path("stories260K")
    res, left = run_cli("--model", str(name), "--device", "cpu", "--prompt", "Once upon a time", "--temperature", "0",
                        "--max-tokens", "24", "--tensor-parallel-size", "2", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert left == [], "the CLI exited but left processes running"
    tokens = json.loads(res.stdout)["requests"][0]["completions"][0]["token_ids"]
    llm = LLM(name, device="cpu")
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=24))
    llm.close()
    assert tokens == out.outputs[0].token_ids


def test_cli_error_after_the_workers_started_leaves_nothing():
    # The prompt is longer than --max-model-len: refused by generate(), after the worker has started.
    res, left = run_cli("--model", str(model_path("stories260K")), "--device", "cpu", "--max-model-len", "4",
                        "--prompt", "Once upon a time there was", "--tensor-parallel-size", "2")
    assert res.returncode == 2 and "more than max_model_len=4" in res.stderr
    assert left == [], "the CLI exited but left processes running"
