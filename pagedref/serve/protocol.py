"""OpenAI's API shapes: the requests the server accepts (checked strictly) and the errors it answers with.

One idea: a request body is validated in full before anything reaches the engine, against models of
OpenAI's fields (strict types: "5" is not 5, true is not 1) plus the sampling fields vLLM adds
(top_k, min_p, ignore_eos, stop_token_ids, ...), and each problem is an `APIError` that names the
field, answered in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.

Invariant: a field that pagedref cannot honour (penalties, logit_bias, suffix, tools, ...) is refused
with a 400 naming it, never silently ignored; unknown fields are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedref import SamplingParams


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


# ----------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the one model served
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)  # None: 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as vLLM
    # OpenAI fields pagedref's sampler does not implement: refused unless left at their neutral values
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported by pagedref's sampler (leave it out or set it to 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by pagedref's sampler", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for one prompt; a value SamplingParams refuses is a 400 naming the field."""
        fields = dict(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                      top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                      min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, max_tokens=max_tokens,
                      stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                      skip_special_tokens=self.skip_special_tokens)
        try:
            return SamplingParams(**fields)
        except (TypeError, ValueError) as err:
            message = str(err)
            param = next((name for name in fields if message.startswith(name)), None)
            raise bad_request(message, param) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions (OpenAI's legacy completions, as vLLM serves them)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # None: up to max_model_len
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported (pagedref's models are not fill-in-the-middle models)", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (leave it out, or equal to n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which pagedref does not compute", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is an empty list: give at least one prompt", "prompt")
        if isinstance(p[0], int):
            return [p]  # one prompt of token ids
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # a template may read other fields (name, ...)
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the template sees it: text parts joined into one string (vLLM's "string" format)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions: the messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens; both accepted
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True  # vLLM's extra field
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise bad_request("tools are not supported by pagedref's server", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported by pagedref's server", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad_request("response_format other than {\"type\": \"text\"} is not supported (no guided decoding)",
                              "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse(model: type[BaseModel], body: Any) -> Any:
    """The body as `model`, every problem a 400 naming its field (the first one found)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(x) for x in first["loc"]]
        param = loc[0] if loc else None
        if first["type"] == "missing":
            message = f"{'.'.join(loc)} is required"
        elif param == "prompt":
            message = "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
        else:
            got = repr(first.get("input"))
            message = f"{'.'.join(loc)}: {first['msg']} (got {got if len(got) <= 80 else got[:77] + '...'})"
        raise APIError(400, message, param, "invalid_type" if first["type"] != "missing" else "missing") from err
    request.check_unsupported()
    return request
