"""The chat template: a model's own Jinja template turns a list of messages into one prompt text.

One idea: render exactly as transformers' `apply_chat_template(messages, add_generation_prompt=True)`
does (the same sandboxed Jinja environment, `trim_blocks` and `lstrip_blocks`, the `raise_exception`,
`strftime_now` and `tojson` helpers, the tokenizer's special tokens as variables), then tokenize the
text without adding special tokens (the template writes them), so a chat request reaches the engine as
the same token ids a transformers user would feed the model.

Invariant: the template is read only from the model directory the server was started with
(tokenizer_config.json's "chat_template", else chat_template.jinja or chat_template.json beside it);
a model without one has no chat endpoint (`NoChatTemplate`, which the server turns into a 400), and a
request can neither name another template nor make the template read a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class NoChatTemplate(ValueError):
    """The model directory holds no chat template."""


@dataclass
class ChatTemplate:
    source: str  # the Jinja text
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: variables of the template, as transformers passes them
    where: str  # the file it came from, for messages
    _compiled: Any = field(default=None, init=False, repr=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        """The template transformers would use for this directory; NoChatTemplate when there is none."""
        model_dir = Path(model_dir)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source, where = _pick(config.get("chat_template")), config_file.name
        if source is None and (model_dir / "chat_template.jinja").is_file():  # transformers >= 4.50 saves it here
            source, where = (model_dir / "chat_template.jinja").read_text(), "chat_template.jinja"
        if source is None and (model_dir / "chat_template.json").is_file():  # processors' older layout
            source, where = _pick(json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")), "chat_template.json"
        if source is None:
            raise NoChatTemplate("this model has no chat template (no \"chat_template\" in its tokenizer_config.json, "
                                 "no chat_template.jinja): use /v1/completions with a prompt instead")
        special = {}
        for key in SPECIAL_TOKEN_KEYS:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token  # older configs wrap it in a dict
            if isinstance(token, str):
                special[key] = token
        return cls(source, special, where)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text (transformers' `apply_chat_template(..., tokenize=False)`); a template's own
        `raise_exception(...)` or a Jinja error is a ValueError naming the template."""
        import jinja2

        try:
            if self._compiled is None:
                self._compiled = _environment().from_string(self.source)
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template ({self.where}) refused the messages: {err}") from err


def _pick(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {"name", "template"} (the "default" one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


_ENV = None


def _environment():
    """transformers' chat-template environment (`_compile_jinja_template`), built once."""
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks;
        rendering keeps its body as it is (transformers' AssistantTracker does the same when not tracking)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _ENV = env
    return env
