"""`pagedref.serve` against the real `openai` client and httpx, on the embedded default model (CPU): the
server's completions are `LLM.generate`'s, plain and streamed, alone and 10 at once; bad requests get
OpenAI-style errors (400, 401, 404, 413) and disturb nothing; the chat endpoint renders the model's
template (and says so when there is none); /health, /v1/models and /metrics."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra (pip install -e '.[serve]')")
openai = pytest.importorskip("openai", reason="the server tests use the openai client (pip install -e '.[test]')")

from pagedref import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402
from serve_helpers import LiveServer, read_metrics, wait_idle  # noqa: E402

KEY = "test-key"
PROMPTS = ["# Stage 6", "## The tests, step by step", "The block table maps", "# Stage 4", "Continuous batching",
           "A block is", "# Stage 1", "Preemption", "The scheduler", "# Stage 7"]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(DEFAULT_MODEL, device="cpu")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server():
    with LiveServer(DEFAULT_MODEL, name="default", api_key=KEY) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def expected(reference, prompts, **params):
    return reference.generate(prompts, SamplingParams(**params))


def streamed_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text by choice index, finish_reason by choice index, usage) of a completions stream."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


# --- equal to LLM.generate ----------------------------------------------------------------------------


def test_greedy_completions_plain_and_streamed_equal_generate(client, reference):
    want = expected(reference, PROMPTS[:3], temperature=0, max_tokens=40)
    got = client.completions.create(model="default", prompt=PROMPTS[:3], temperature=0, max_tokens=40)
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in want]
    assert [c.finish_reason for c in got.choices] == [o.outputs[0].finish_reason for o in want]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in want)
    for prompt, w in zip(PROMPTS[:3], want):
        stream = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=40, stream=True,
                                           stream_options={"include_usage": True})
        texts, reasons, usage = streamed_text(stream)
        assert texts == {0: w.outputs[0].text}
        assert reasons == {0: w.outputs[0].finish_reason}
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(w.prompt_token_ids), len(w.outputs[0].token_ids))


def test_ten_concurrent_greedy_clients_get_generates_completions(client, reference):
    """Ten requests in flight at once (half streamed), each with its own length: continuous batching
    across HTTP requests changes no token."""
    lengths = [8 + 9 * i for i in range(10)]
    want = reference.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in lengths])

    def ask(i: int) -> str:
        kw = dict(model="default", prompt=PROMPTS[i], temperature=0, max_tokens=lengths[i])
        if i % 2:
            return streamed_text(client.completions.create(**kw, stream=True))[0][0]
        return client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(10) as pool:
        got = list(pool.map(ask, range(10)))
    assert got == [o.outputs[0].text for o in want]


def test_seeded_samples_token_ids_and_logprobs_equal_generate(client, reference):
    """n = 2 seeded samples of a token-id prompt, with logprobs: generate's tokens, texts and logprobs."""
    ids = reference.get_tokenizer().encode("# Stage 5")
    want = reference.generate({"prompt_token_ids": ids},
                              SamplingParams(n=2, temperature=0.9, top_k=20, seed=7, max_tokens=24, logprobs=2))[0]
    got = client.completions.create(model="default", prompt=ids, n=2, temperature=0.9, seed=7, max_tokens=24, logprobs=2,
                                    extra_body={"top_k": 20})
    assert [c.text for c in got.choices] == [c.text for c in want.outputs]
    for g, w in zip(got.choices, want.outputs):
        assert g.logprobs.token_logprobs == [lp[t].logprob for t, lp in zip(w.token_ids, w.logprobs)]
        assert len(g.logprobs.tokens) == len(w.token_ids)
        assert g.logprobs.text_offset[0] == 0
    texts, _, _ = streamed_text(client.completions.create(model="default", prompt=ids, n=2, temperature=0.9, seed=7,
                                                          max_tokens=24, stream=True, extra_body={"top_k": 20}))
    assert texts == {c.index: c.text for c in want.outputs}


def test_stop_strings_are_never_streamed_and_echo_prepends_the_prompt(client, reference):
    prompt = "# Stage 6"
    full = expected(reference, [prompt], temperature=0, max_tokens=60)[0].outputs[0].text
    stop = full[12:16]  # a piece of the greedy text: the completion must stop before it
    want = expected(reference, [prompt], temperature=0, max_tokens=60, stop=[stop])[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    texts, reasons, _ = streamed_text(client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=60,
                                                                stop=[stop], stream=True))
    assert texts == {0: want.text} and reasons == {0: "stop"}
    echoed = client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=60, stop=[stop], echo=True)
    assert echoed.choices[0].text == prompt + want.text
    texts, _, _ = streamed_text(client.completions.create(model="default", prompt=prompt, temperature=0, max_tokens=60,
                                                          stop=[stop], echo=True, stream=True))
    assert texts == {0: prompt + want.text}


# --- bad requests ---------------------------------------------------------------------------------------


def post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body, param, words", [
    (b'{"prompt": "x", ', None, "not valid JSON"),
    ([1, 2], None, "JSON object"),
    ({"max_tokens": 4}, "prompt", "required"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"prompt": "x", "top_k": 0}, "top_k", "top_k"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": [[]]}, "prompt", "no tokens"),
    ({"prompt": [5000]}, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "word " * 300}, "prompt", "max_model_len=256"),
    ({"prompt": "x", "max_tokens": 1000}, "max_tokens", "maximum context length is 256"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "max_logprobs"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
])
def test_invalid_completions_get_400_naming_the_field(server, body, param, words):
    error = error_of(post(server, "/v1/completions", body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_unknown_model_404_missing_key_401_large_body_413(server, client):
    error = error_of(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    error_of(post(server, "/v1/nothing", {"prompt": "x"}), 404)
    for key in (None, "wrong"):
        assert error_of(post(server, "/v1/completions", {"prompt": "x"}, key=key), 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(f"{server.url}/v1/models", timeout=10), 401)["type"] == "authentication_error"
    big = json.dumps({"prompt": "x" * (10 * 1024 * 1024)})
    assert error_of(post(server, "/v1/completions", big), 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the server counts what it reads
        yield b'{"prompt": "'
        for _ in range(11):
            yield b"x" * (1024 * 1024)
        yield b'"}'
    assert error_of(post(server, "/v1/completions", chunked()), 413)["code"] == "request_too_large"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).completions.create(model="default", prompt="x")
    # none of it disturbed the server: a good request still gets generate's answer, and nothing is left running
    assert client.completions.create(model="default", prompt="# Stage 6", temperature=0, max_tokens=4).choices[0].text
    m = wait_idle(server.url)
    assert m["pagedref:kv_cache_usage_perc"] == 0 and m["pagedref:num_requests_running"] == 0


def test_chat_without_a_template_is_a_clear_400(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])
    assert "no chat template" in err.value.body["message"] and err.value.body["param"] == "messages"


# --- chat, on a copy of the model given a template ----------------------------------------------------------

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}# {{ m['content'] }}\n\n"
            "{% else %}## {{ m['role'] }}\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}## assistant\n{% endif %}")


def test_chat_completions_render_the_models_template_and_equal_generate(tmp_path, reference):
    model = tmp_path / "with-template"
    shutil.copytree(DEFAULT_MODEL, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    messages = [{"role": "system", "content": "Stage 6"}, {"role": "user", "content": [{"type": "text", "text": "The idea"}]}]
    text = "<s># Stage 6\n\n## user\nThe idea\n\n## assistant\n"  # the template by hand
    ids = reference.get_tokenizer().encode(text, add_special_tokens=False)
    want = reference.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    with LiveServer(model, name="chat") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="chat", messages=messages, temperature=0, max_completion_tokens=30)
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].message.content == want.text
        assert got.usage.prompt_tokens == len(ids)
        chunks = list(client.chat.completions.create(model="chat", messages=messages, temperature=0, max_tokens=30,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
        lp = client.chat.completions.create(model="chat", messages=messages, temperature=0, max_tokens=10, logprobs=True,
                                            top_logprobs=2).choices[0].logprobs.content
        w = reference.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, logprobs=2))[0].outputs[0]
        assert [t.logprob for t in lp] == [d[i].logprob for i, d in zip(w.token_ids, w.logprobs)]
        assert [[x.logprob for x in t.top_logprobs] for t in lp] == \
            [[x.logprob for x in sorted(d.values(), key=lambda x: x.rank)] for d in w.logprobs]
        bad = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, key=None)
        assert error_of(bad, 400)["param"] == "messages"


# --- the other endpoints ------------------------------------------------------------------------------------


def test_health_models_and_metrics(server, client):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list()] == ["default"]
    m = read_metrics(server.url)
    for name in ("pagedref:kv_cache_usage_perc", "pagedref:num_requests_running", "pagedref:num_requests_waiting",
                 "pagedref:num_preemptions_total", "pagedref:prompt_tokens_total", "pagedref:generation_tokens_total",
                 "pagedref:time_to_first_token_seconds_count", "pagedref:inter_token_latency_seconds_count",
                 "pagedref:e2e_request_latency_seconds_count"):
        assert name in m, name
    before = m["pagedref:generation_tokens_total"]
    client.completions.create(model="default", prompt="# Stage 2", temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    after = read_metrics(server.url)
    assert after["pagedref:generation_tokens_total"] == before + 5
    assert after["pagedref:e2e_request_latency_seconds_count"] == m["pagedref:e2e_request_latency_seconds_count"] + 1
