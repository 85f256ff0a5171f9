"""The server's engine process on CUDA: spawned, it owns the GPU (the server's process never initializes
CUDA), and the new tokens it sends each step add up to the greedy tokens of the reference (transformers'),
for requests in flight together, with async scheduling (CUDA's default) and an abort among them.
Run on the device: `pytest tests -m gpu`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, model_path, read_reference
from pagedref.kernels import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and cupy")]
pytest.importorskip("prometheus_client", reason="the server needs the serve extra (pip install -e '.[serve]')")

MODEL = "tiny-llama3-hd64"

SCRIPT = """
import asyncio, json, sys, time
import torch
from pagedref import SamplingParams
from pagedref.serve.async_engine import AsyncLLM

cases = json.loads(sys.stdin.read())

async def main():
    engine = AsyncLLM({"model": sys.argv[1], "device": "cuda", "max_model_len": 512, "gpu_memory_utilization": 0.3})
    try:
        engine.start(asyncio.get_running_loop())
        params = [SamplingParams(temperature=0.0, max_tokens=len(c["greedy_ids"]), ignore_eos=True) for c in cases]
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [engine.submit([(f"r{i}", {"prompt": None, "prompt_token_ids": c["prompt_ids"]}, p)], time.monotonic())
                   for i, (c, p) in enumerate(zip(cases, params))]
        dropped = engine.submit([("long", {"prompt": None, "prompt_token_ids": cases[0]["prompt_ids"]}, long)], time.monotonic())
        async for _, out in dropped:
            break
        dropped.close()  # aborted while the others run
        tokens = []
        for stream in streams:
            async for _, out in stream:
                pass
            tokens.append(out.outputs[0].token_ids)
        stats = await engine.stop()
        return {"tokens": tokens, "used_blocks": stats["num_used_blocks"], "async": stats["async_scheduling"],
                "device": stats["device"], "server_cuda": torch.cuda.is_initialized()}
    finally:
        engine.shutdown()

print(json.dumps(asyncio.run(main())))
"""


def test_the_engine_process_owns_the_gpu_and_its_deltas_add_up_to_the_reference():
    cases = [{k: c[k] for k in ("prompt_ids", "greedy_ids")} for c in read_reference(MODEL, "hf_reference.json")["cases"]]
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(model_path(MODEL))], input=json.dumps(cases), cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["device"], got["async"], got["server_cuda"]) == ("cuda", True, False)
    assert got["tokens"] == [c["greedy_ids"] for c in cases]
    assert got["used_blocks"] == 0
