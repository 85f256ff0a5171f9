"""The HTTP API: OpenAI's completions and chat completions, streamed or not, on the async engine (FastAPI).

One idea: a handler checks everything first (the API key, the body's size and JSON, every field, the
model's name, each prompt's length against max_model_len), so a bad request is answered with an
OpenAI-style error and never reaches the engine; then it submits one engine request per prompt and
turns their outputs into OpenAI's response, or into server-sent events (`data: {chunk}` ... `data:
[DONE]`) as the engine makes tokens. A watcher per request aborts its engine requests the moment the
client disconnects, so their blocks are freed before the next step.

Streamed text is decoded incrementally (vLLM's window over the last few tokens: a step costs the same
however long the completion is); a completion's last chunk completes the text to the engine's own
final text, so streamed and unstreamed completions are `LLM.generate`'s text exactly. With stop
strings, the last (longest stop string - 1) characters are held back until the engine has checked
them, so no part of a stop string is ever sent.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /version.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedref
from pagedref import SamplingParams
from pagedref.engine.sequence import CompletionOutput, RequestOutput
from pagedref.serve.async_engine import Aborted, AsyncLLM, Disconnected, EngineDead, EngineShuttingDown, RequestStream
from pagedref.serve.chat import ChatTemplate, NoChatTemplate
from pagedref.serve.metrics import ServerMetrics
from pagedref.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, parse

log = logging.getLogger("pagedref.serve")

MiB = 1 << 20
DRAIN_LIMIT = 64 * MiB  # an oversized body is read (and dropped) up to this much, so the client sees the 413
DETOKENIZE_CONTEXT = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded before the first new one
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: vLLM's floor


class ClientGone(Exception):
    """The client of a non-streamed request disconnected before its answer was ready."""


@dataclass
class ServerConfig:
    served_model_name: str
    model_dir: Path  # where the chat template is read from (and nothing else)
    api_key: str | None = None  # bearer token the /v1 endpoints require, when set
    max_request_bytes: int = 10 * MiB


# ------------------------------------------------------------------------------------------------- app


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine` (its process started and ready; the app observes its latencies into
    `engine.metrics`). Its lifespan attaches the engine to the loop and, at shutdown, aborts what is left and
    stops the engine's process (`engine.final_stats`: the engine's stats then; the pool should be free)."""
    metrics = engine.metrics = engine.metrics or ServerMetrics()
    try:
        chat_template: ChatTemplate | NoChatTemplate = ChatTemplate.from_model_dir(config.model_dir)
    except NoChatTemplate as err:
        chat_template = err

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        stats = await engine.stop()
        if stats is None:
            log.warning("engine stopped on an error earlier: %s", engine.error)
            return
        log.info("engine stopped: %d requests left, %d of %d KV blocks in use", stats["running"] + stats["waiting"]
                 + stats["swapped"], stats["num_used_blocks"], stats["num_blocks"])

    app = FastAPI(title="pagedref", version=pagedref.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    api = _Handlers(engine, config, metrics, chat_template)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, err: ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):  # unknown route, wrong method
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return JSONResponse(APIError(err.status_code, message).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, err: Exception):
        log.exception("error serving %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    return app


# ------------------------------------------------------------------------------------------- handlers


@dataclass
class _Prompt:
    text: str | None  # as given (None for token ids: decoded only when echoed)
    token_ids: list[int]
    params: SamplingParams


class _Handlers:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, metrics: ServerMetrics,
                 chat_template: ChatTemplate | NoChatTemplate) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())

    # --- GET ---------------------------------------------------------------------------------------
    async def models(self, request: Request):
        self._check_auth(request)
        card = {"id": self.config.served_model_name, "object": "model", "created": self.created, "owned_by": "pagedref",
                "max_model_len": self.engine.facts.max_model_len}
        return {"object": "list", "data": [card]}

    async def health(self):
        if self.engine.error is not None:
            raise APIError(503, f"the engine stopped: {type(self.engine.error).__name__}: {self.engine.error}")
        if not self.engine.accepting or not self.engine.is_running:
            raise APIError(503, "the server is shutting down" if not self.engine.accepting else "the engine is starting")
        return Response(status_code=200)

    async def metrics_text(self):
        return Response(self.metrics.render(await self.engine.get_stats()), media_type=CONTENT_TYPE_LATEST)

    async def version(self):
        return {"version": pagedref.__version__}

    # --- POST /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request):
        arrival = time.monotonic()
        body = await self._read_request(request)
        req: CompletionRequest = parse(CompletionRequest, body)
        self._check_model(req.model)
        prompts = []
        for given in req.prompts():
            text, ids = self._process(given)
            max_tokens = self._max_tokens(req.max_tokens, len(ids), "max_tokens")
            prompts.append(_Prompt(text, ids, self._check_params(req.sampling_params(max_tokens, req.logprobs), "logprobs")))
        sub = self._submit("cmpl", prompts, arrival)
        if req.stream:
            return self._sse(request, sub, _CompletionChunks(self, req, prompts, sub.id))
        finals = await self._wait(request, sub)
        choices, completion_tokens = [], 0
        for i, (rid, p) in enumerate(zip(sub.request_ids, prompts)):
            prefix = self._prompt_text(p, req.skip_special_tokens) if req.echo else ""  # the same for each of the n choices
            for c in finals[rid].outputs:
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                choices.append({"index": i * req.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                completion_tokens += len(c.token_ids)
        return {"id": sub.id, "object": "text_completion", "created": int(time.time()),
                "model": self.config.served_model_name, "choices": choices,
                "usage": _usage(sum(len(p.token_ids) for p in prompts), completion_tokens)}

    # --- POST /v1/chat/completions -----------------------------------------------------------------
    async def chat_completions(self, request: Request):
        arrival = time.monotonic()
        body = await self._read_request(request)
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        self._check_model(req.model)
        if isinstance(self.chat_template, NoChatTemplate):
            raise bad_request(str(self.chat_template), "messages")
        try:
            text = self.chat_template.render([m.for_template() for m in req.messages], req.add_generation_prompt)
        except ValueError as err:
            raise bad_request(str(err), "messages") from err
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        _, ids = self._process({"prompt": text, "prompt_token_ids": ids})
        requested = req.requested_max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(requested, len(ids), param)
        prompts = [_Prompt(text, ids, self._check_params(req.sampling_params(max_tokens, req.num_logprobs), "top_logprobs"))]
        sub = self._submit("chatcmpl", prompts, arrival)
        if req.stream:
            return self._sse(request, sub, _ChatChunks(self, req, prompts, sub.id))
        finals = await self._wait(request, sub)
        out = finals[sub.request_ids[0]]
        choices = []
        for c in out.outputs:
            logprobs = {"content": self._chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0)} if req.logprobs else None
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": sub.id, "object": "chat.completion", "created": int(time.time()),
                "model": self.config.served_model_name, "choices": choices,
                "usage": _usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}

    # --- checks --------------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key: send it as the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _read_request(self, request: Request) -> Any:
        """Auth, admission, then the body as JSON: 401, 503, 413 and 400 in that order."""
        self._check_auth(request)
        if not self.engine.accepting:
            raise APIError(503, "the server is shutting down", code="service_unavailable")
        limit = self.config.max_request_bytes
        too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _drain(request, min(int(declared), DRAIN_LIMIT))
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await _drain(request, DRAIN_LIMIT - size)
                raise too_large
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise bad_request(f"the request body is not valid JSON: {err}") from err

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.config.served_model_name}`).", "model", "model_not_found")

    def _process(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        """The engine's own prompt checks (empty, longer than max_model_len, ids outside the vocabulary)."""
        try:
            return self.engine.checks.process_prompt(prompt if not isinstance(prompt, list) else {"prompt_token_ids": prompt})
        except (TypeError, ValueError) as err:
            raise bad_request(str(err), "prompt" if not isinstance(prompt, dict) else "messages") from err

    def _check_params(self, params: SamplingParams, logprobs_param: str) -> SamplingParams:
        """The engine's own checks of the parameters (the logprobs cap, n on a pool that cannot share blocks)."""
        try:
            self.engine.checks.check_params(params)
        except (TypeError, ValueError) as err:
            raise bad_request(str(err), logprobs_param if "logprobs" in str(err) else "n") from err
        return params

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        """OpenAI's (and vLLM's) rule: prompt + completion must fit max_model_len; None asks for all the room."""
        max_len = self.engine.facts.max_model_len
        room = max_len - prompt_len
        want = room if requested is None else requested
        if room < 1 or want > room:
            raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                              f"{prompt_len + max(want, 1)} tokens ({prompt_len} in the prompt, {max(want, 1)} in the "
                              f"completion). Please reduce the length of the prompt or of {param}.", param)
        return want

    # --- running ---------------------------------------------------------------------------------------
    def _submit(self, kind: str, prompts: list[_Prompt], arrival: float) -> "_Submitted":
        request_id = f"{kind}-{uuid.uuid4().hex}"
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        try:
            stream = self.engine.submit([(rid, {"prompt": p.text, "prompt_token_ids": p.token_ids}, p.params)
                                         for rid, p in zip(ids, prompts)], arrival)
        except EngineShuttingDown as err:
            raise APIError(503, str(err), code="service_unavailable") from err
        except EngineDead as err:
            raise APIError(500, str(err)) from err
        return _Submitted(request_id, ids, stream)

    async def _wait(self, request: Request, submitted: "_Submitted") -> dict[str, RequestOutput]:
        """The final output of each engine request (non-streamed responses)."""
        watcher = asyncio.create_task(_watch_disconnect(request, submitted.stream))
        finals: dict[str, RequestOutput] = {}
        try:
            async for rid, out in submitted.stream:
                if out.finished:
                    finals[rid] = out
        except Aborted as err:
            raise APIError(503, f"{err}: the request was aborted before it finished", code="service_unavailable") from err
        except EngineDead as err:
            raise APIError(500, str(err)) from err
        except Disconnected as err:
            raise ClientGone() from err  # the engine requests are aborted already
        finally:
            submitted.stream.close()
            watcher.cancel()
        return finals

    def _sse(self, request: Request, submitted: "_Submitted", chunks: "_Chunks") -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            prompt_index = {rid: i for i, rid in enumerate(submitted.request_ids)}  # not a list search per output
            watcher = asyncio.create_task(_watch_disconnect(request, submitted.stream))
            try:
                lines = chunks.start()
                async for rid, out in submitted.stream:
                    lines += chunks.on_output(prompt_index[rid], out)
                    if lines:
                        yield _sse_bytes(lines)
                        lines = []
                yield _sse_bytes(lines + chunks.end() + ["[DONE]"])
            except Aborted:  # shutdown: the unfinished choices end with finish_reason "abort"
                yield _sse_bytes(chunks.abort() + chunks.end() + ["[DONE]"])
            except EngineDead as err:
                yield _sse_bytes([json.dumps(APIError(500, str(err)).body()), "[DONE]"])
            except Disconnected:
                return
            finally:
                submitted.stream.close()
                watcher.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- text ------------------------------------------------------------------------------------------
    def _prompt_text(self, p: _Prompt, skip_special_tokens: bool) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids, skip_special_tokens=skip_special_tokens)

    def _completion_logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int) -> dict[str, Any]:
        """OpenAI's legacy completions logprobs of tokens [start, end): tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR))
            top.append({lp.decoded_token: max(lp.logprob, LOGPROB_FLOOR) for lp in entry.values()})
            offsets.append(text_offset)
            text_offset += len(chosen.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput, start: int, end: int, top_k: int) -> list[dict[str, Any]]:
        """Chat's logprobs.content entries of tokens [start, end), each with its top_k most likely tokens."""
        content = []
        for token_id, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
            chosen = entry[token_id]
            best = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)
            content.append({**_token_logprob(chosen), "top_logprobs": [_token_logprob(lp) for lp in best]})
        return content


@dataclass
class _Submitted:
    id: str  # the response's id
    request_ids: list[str]  # the engine requests, one per prompt, in prompt order
    stream: RequestStream


async def _drain(request: Request, limit: int) -> None:
    """Read and drop up to `limit` more bytes of the body, so the client reads the error instead of a reset."""
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size >= limit:
                return
    except Exception:  # the client gave up sending: nothing to drain
        return


async def _watch_disconnect(request: Request, stream: RequestStream) -> None:
    """Abort the request's engine requests the moment its client disconnects (the body is read by now, so the
    next ASGI message is the disconnect: uvicorn also sends it once the response is complete, when it does nothing)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stream.disconnect()
            return


def _sse_bytes(lines: list[str]) -> bytes:
    return "".join(f"data: {line}\n\n" for line in lines).encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_logprob(lp) -> dict[str, Any]:
    token = lp.decoded_token
    return {"token": token, "logprob": max(lp.logprob, LOGPROB_FLOOR), "bytes": list(token.encode("utf-8"))}


# --------------------------------------------------------------------------------------------- streaming


class IncrementalDetokenizer:
    """Text of new tokens, decoded in a window of a few tokens before them (vLLM's detokenize_incrementally,
    on the tokenizer's public decode): a token's leading space and a character split over several byte
    tokens come out as in a full decode, and nothing is emitted while the window ends in a partial character."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.tokens)  # tokens before this are emitted already

    def add(self, new_ids: list[int]) -> str:
        if not new_ids:
            return ""
        self.tokens.extend(new_ids)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        text = self.tokenizer.decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):  # nothing new yet, or a character still incomplete
            return ""
        del self.tokens[:self.read_offset]  # the new window starts where this one's new tokens began
        self.prefix_offset, self.read_offset = 0, len(self.tokens)
        return text[len(prefix):]


@dataclass
class _Choice:
    """One choice's streamed state."""

    index: int
    detokenizer: IncrementalDetokenizer
    holdback: int  # characters kept back while a stop string could still be forming
    num_tokens: int = 0  # tokens sent
    text: str = ""  # text decoded so far
    sent: int = 0  # characters of text sent
    finished: bool = False

    def advance(self, c: CompletionOutput) -> tuple[str, int]:
        """(text to send now, index of the first token not sent before) for the choice's newest output."""
        start, self.num_tokens = self.num_tokens, len(c.token_ids)
        if c.finish_reason is not None:  # the engine's text is final: complete the sent text to it
            self.finished = True
            final, sent = c.text, self.text[:self.sent]
            if not final.startswith(sent):
                log.warning("streamed text %r is not a prefix of the final text %r (incremental decoding)", sent, final)
                return "", start
            self.text, self.sent = final, len(final)
            return final[len(sent):], start
        self.text += self.detokenizer.add(c.token_ids[start:])
        upto = max(len(self.text) - self.holdback, self.sent)
        delta, self.sent = self.text[self.sent:upto], upto
        return delta, start


class _Chunks(ABC):
    """Builds one response's stream chunks (JSON strings) from its engine requests' outputs."""

    object_name = ""

    def __init__(self, h: _Handlers, req, prompts: list[_Prompt], response_id: str) -> None:
        self.h = h
        self.req = req
        self.prompts = prompts
        self.id = response_id
        self.created = int(time.time())
        self.model = h.config.served_model_name
        stops = [] if req.include_stop_str_in_output else (prompts[0].params.stop or [])
        holdback = max((len(s) for s in stops), default=1) - 1
        self.choices = [[_Choice(i * req.n + j, IncrementalDetokenizer(h.tokenizer, p.token_ids, req.skip_special_tokens),
                                 holdback) for j in range(req.n)] for i, p in enumerate(prompts)]
        self.completion_tokens = 0

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        doc = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        return json.dumps(doc, ensure_ascii=False)

    def start(self) -> list[str]:
        return []

    def on_output(self, prompt_index: int, out: RequestOutput) -> list[str]:
        lines = []
        for c in out.outputs:
            choice = self.choices[prompt_index][c.index]
            if choice.finished:
                continue
            delta, start = choice.advance(c)
            if choice.finished:
                self.completion_tokens += len(c.token_ids)
            if delta or choice.finished or (c.logprobs is not None and start < choice.num_tokens):
                lines.append(self.chunk([self.choice_chunk(choice, c, delta, start)]))
        return lines

    def abort(self) -> list[str]:
        return [self.chunk([self.abort_chunk(ch)]) for row in self.choices for ch in row if not ch.finished]

    def end(self) -> list[str]:
        if not self.req.include_usage:
            return []
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion = self.completion_tokens + sum(ch.num_tokens for row in self.choices for ch in row if not ch.finished)
        return [self.chunk([], _usage(prompt_tokens, completion))]

    @abstractmethod
    def choice_chunk(self, choice: _Choice, c: CompletionOutput, delta: str, start: int) -> dict[str, Any]:
        """One choice's entry of a chunk: its new text (and logprobs), and its finish reason once finished."""

    @abstractmethod
    def abort_chunk(self, choice: _Choice) -> dict[str, Any]:
        """One choice's last entry when the server aborts it (finish_reason "abort")."""


class _CompletionChunks(_Chunks):
    object_name = "text_completion"

    def start(self) -> list[str]:
        if not self.req.echo:  # echo: the prompt is each choice's first text
            return []
        return [self.chunk([{"index": ch.index, "text": self.h._prompt_text(p, self.req.skip_special_tokens),
                             "logprobs": None, "finish_reason": None}])
                for p, row in zip(self.prompts, self.choices) for ch in row]

    def choice_chunk(self, choice: _Choice, c: CompletionOutput, delta: str, start: int) -> dict[str, Any]:
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self.h._completion_logprobs(c, start, choice.num_tokens, choice.sent - len(delta))
        return {"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def abort_chunk(self, choice: _Choice) -> dict[str, Any]:
        return {"index": choice.index, "text": "", "logprobs": None, "finish_reason": "abort"}


class _ChatChunks(_Chunks):
    object_name = "chat.completion.chunk"

    def start(self) -> list[str]:  # OpenAI's first chunk of each choice names the role
        return [self.chunk([{"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for row in self.choices for ch in row]

    def choice_chunk(self, choice: _Choice, c: CompletionOutput, delta: str, start: int) -> dict[str, Any]:
        logprobs = None
        if self.req.logprobs:
            logprobs = {"content": self.h._chat_logprobs(c, start, choice.num_tokens, self.req.top_logprobs or 0)}
        return {"index": choice.index, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def abort_chunk(self, choice: _Choice) -> dict[str, Any]:
        return {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": "abort"}
