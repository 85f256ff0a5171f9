"""Clients that go away: their requests are aborted and the KV pool is free again, and the clients that
stay get `LLM.generate`'s completions exactly. On bench serve's "tiny" random-weight model (a Llama
shape small enough for the CPU, 16,384 positions), so a dropped request asks for thousands of tokens:
it is still running when its client leaves, and only an abort can end it."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install -e '.[test]')")

from pagedref import LLM, SamplingParams  # noqa: E402
from pagedref.bench.serve import random_model_dir  # noqa: E402
from serve_helpers import LiveServer, read_metrics, wait_idle  # noqa: E402

LONG = 10_000  # tokens a dropped request asks for: far more than it can make before its client leaves


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_model_dir("tiny", tmp_path_factory.mktemp("models"), "cpu", log=lambda msg: None)


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, name="tiny") as s:
        yield s


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(3, 512)}" for _ in range(n))  # the word-level tokenizer's tokens


def test_eight_streams_dropped_after_their_first_chunk_leave_the_pool_empty(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    before = read_metrics(server.url)
    rng = random.Random(0)
    streams = [client.completions.create(model="tiny", prompt=words(rng, 20), max_tokens=LONG, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(8)]
    for stream in streams:
        assert next(iter(stream)).choices[0].text
    running = read_metrics(server.url)
    assert running["pagedref:num_requests_running"] + running["pagedref:num_requests_waiting"] == 8
    assert running["pagedref:kv_cache_usage_perc"] > 0
    for stream in streams:
        stream.close()
    m = wait_idle(server.url)
    assert m["pagedref:kv_cache_usage_perc"] == 0
    assert m["pagedref:num_requests_running"] == 0 and m["pagedref:num_requests_waiting"] == 0
    assert m["pagedref:num_aborted_requests_total"] == before["pagedref:num_aborted_requests_total"] + 8


def test_64_concurrent_streams_with_random_disconnects(server, model):
    """Half the clients leave after 1-4 chunks; the other half read to the end and get generate's text."""
    rng = random.Random(64)
    jobs = []
    for i in range(64):
        stays = i % 2 == 0
        jobs.append(dict(prompt=words(rng, rng.randrange(4, 60)), stays=stays, max_tokens=rng.randrange(8, 48) if stays else LONG,
                         leave_after=rng.randrange(1, 5)))
    rng.shuffle(jobs)
    stayers = [j for j in jobs if j["stays"]]
    reference = LLM(model, device="cpu")
    want = reference.generate([j["prompt"] for j in stayers], [SamplingParams(temperature=0, max_tokens=j["max_tokens"])
                                                             for j in stayers])
    reference.close()
    before = read_metrics(server.url)

    async def run(client: httpx.AsyncClient, job: dict) -> str | None:
        body = {"model": "tiny", "prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0,
                "stream": True, "ignore_eos": not job["stays"]}
        text, chunks = "", 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return text
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if not job["stays"] and chunks >= job["leave_after"]:
                    return None  # leaving the block closes the connection mid-stream
        raise AssertionError("the stream ended without [DONE]")

    async def main() -> list[str | None]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(run(client, job) for job in jobs))

    results = asyncio.run(main())
    got = [text for job, text in zip(jobs, results) if job["stays"]]
    assert got == [o.outputs[0].text for o in want]
    m = wait_idle(server.url)
    assert m["pagedref:kv_cache_usage_perc"] == 0
    assert m["pagedref:num_requests_running"] == 0 and m["pagedref:num_requests_waiting"] == 0
    assert m["pagedref:num_aborted_requests_total"] == before["pagedref:num_aborted_requests_total"] + 32
