"""The OpenAI request bodies, checked field by field, and what the server makes of them.

A body is hostile JSON: every field the server reads is type-checked here and a bad one
raises ``BadField`` naming it (the server answers 400 in OpenAI's error shape). A field the
server does not implement is refused the same way, naming it, unless it has its neutral value
(``tools: []``, ``response_format: {"type": "text"}``): a request is never served with part of
it silently ignored. Sampling values are then validated by ``SamplingParams`` itself, so HTTP
and the library refuse the same values."""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, InvalidRequest
from ..model.tokenizer import Tokenizer
from ..sampling import MAX_LOGPROBS, SamplingParams
from ..scheduler.global_scheduler import MAX_SESSION_ID

# Choices one request may ask for (n), and stop strings it may give.
MAX_N = 16
MAX_STOP_STRINGS = 16
# Completions default to 16 new tokens, as OpenAI's API does; chat to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16
# Message roles, and the role each is rendered as (OpenAI's ``developer`` is the system prompt).
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields of OpenAI's API this server does not implement: accepted only at their neutral value.
_UNSUPPORTED = {
    "echo": False,
    "best_of": 1,
    "suffix": "",
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "response_format": {"type": "text"},
}
# Fields the server reads (besides those above). ``user`` only identifies the caller to the
# operator, and ``parallel_tool_calls`` only matters with tools: both change no output.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "min_tokens",
)
_COMMON = {
    "model",
    "n",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "logprobs",
    "logit_bias",
    "user",
    "return_token_ids",
    *_SAMPLING,
}
KNOWN_FIELDS = {
    "completion": _COMMON | {"prompt"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"},
}
# The checkpoint file that may hold a Jinja chat template (HF's ``chat_template`` field).
CHAT_CONFIG = "tokenizer_config.json"
# Llama-2's chat format, used when the checkpoint ships no chat template.
INST, END_INST, SYS, END_SYS = "[INST]", "[/INST]", "<<SYS>>\n", "\n<</SYS>>\n\n"


class BadField(InvalidRequest):
    """A request field with a value the server cannot use; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Parsed:
    """What one completion or chat request asks for."""

    model: str
    prompts: list[list[int]]  # token ids, one per prompt (chat: one)
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    return_token_ids: bool = False  # an extension: the generated ids beside the text
    session_id: str | None = None  # ``user`` (or the X-Session-Id header): session routing


def _get(body: dict, name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` if it is of ``kinds`` (a bool is no number), else ``BadField``."""
    value = body.get(name)
    if value is None:
        return default
    number = kinds in (int, float) or kinds == (int, float)
    if not isinstance(value, kinds) or (number and isinstance(value, bool)):
        want = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        raise BadField(name, f"'{name}' must be {want}, got {type(value).__name__}")
    return value


def _ids(value: Any, name: str) -> list[int] | None:
    """``value`` as a list of token ids, None when it is not a list of integers."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value)
    ):
        return [int(t) for t in value]
    return None


def _prompts(body: dict, tok: Tokenizer) -> list[list[int]]:
    """``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [tok.prompt_ids(p)]
    if (ids := _ids(p, "prompt")) is not None:
        return [ids]
    if isinstance(p, list) and p:
        out = []
        for item in p:
            if isinstance(item, str):
                out.append(tok.prompt_ids(item))
            elif (ids := _ids(item, "prompt")) is not None:
                out.append(ids)
            else:
                raise BadField("prompt", "'prompt' items must be strings or lists of token ids")
        return out
    if p is None:
        raise BadField("prompt", "'prompt' is required")
    raise BadField("prompt", "'prompt' must be a non-empty string, list of strings or token ids")


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in c):
        return "".join(_get(p, "text", str, "") for p in c)
    raise BadField(f"messages[{i}].content", "message content must be a string or text parts")


def _messages(body: dict) -> list[tuple[str, str]]:
    ms = body.get("messages")
    if not isinstance(ms, list) or not ms:
        raise BadField("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(ms):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadField(
                f"messages[{i}].role", f"each message needs a role in {sorted(CHAT_ROLES)}"
            )
        out.append((CHAT_ROLES[role], _content(m, i)))
    return out


def _refuse(message: str):
    """``raise_exception`` of a chat template: the conversation is the problem."""
    raise BadField("messages", f"the chat template refuses the conversation: {message}")


def _chat_template(path: Path):
    """The compiled chat template of a ``tokenizer_config.json`` (HF's named list: its
    ``default``); None when the file is absent or has none. A file that is not a JSON object,
    or a template that does not compile, is a ``CheckpointError`` naming the file."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(config).__name__}")
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise CheckpointError(f"{path}: none of its chat templates is named 'default'")
        source = named["default"]
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(f"{path}: chat_template must be text, not {type(source).__name__}")
    from jinja2 import TemplateError  # lazy: optional extra
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: optional extra

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _refuse
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise CheckpointError(f"{path}: the chat template does not compile: {e}") from None


class ChatFormat:
    """Renders messages to prompt ids: the checkpoint's Jinja chat template (sandboxed) when its
    ``tokenizer_config.json`` has one, else Llama-2's ``[INST]`` / ``<<SYS>>`` format. A broken
    ``tokenizer_config.json`` or template is a ``CheckpointError`` naming the file."""

    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.template = _chat_template(Path(model_dir) / CHAT_CONFIG)

    def render(self, messages: list[tuple[str, str]]) -> list[int]:
        """Prompt token ids of a conversation, ready for the assistant's next message."""
        if self.template is not None:
            try:
                text = self.template.render(
                    messages=[{"role": r, "content": c} for r, c in messages],
                    add_generation_prompt=True,
                    bos_token=self.tok.id_to_piece(self.tok.bos_id or 0),
                    eos_token=self.tok.id_to_piece(self.tok.eos_id or 0),
                )
            except BadField:  # raise_exception: the template refuses the conversation
                raise
            except Exception as e:  # the template's own failure on this conversation
                raise BadField(
                    "messages",
                    f"the chat template failed to render the messages: {type(e).__name__}: {e}",
                ) from None
            return self.tok.prompt_ids(text)
        return self._llama2(messages)

    def _llama2(self, messages: list[tuple[str, str]]) -> list[int]:
        system = "".join(c for r, c in messages[:1] if r == "system")
        turns = messages[1:] if system else messages
        ids: list[int] = []
        bos = [self.tok.bos_id] if self.tok.bos_id is not None else []
        eos = [self.tok.eos_id] if self.tok.eos_id is not None else []
        for i, (role, content) in enumerate(turns):
            if role == "user":
                if i == 0 and system:
                    content = SYS + system + END_SYS + content
                ids += bos + self.tok.encode(f"{INST} {content.strip()} {END_INST}", add_bos=False)
            elif role == "assistant":
                ids += self.tok.encode(f" {content.strip()} ", add_bos=False) + eos
            else:
                raise BadField("messages", "a system message may only come first")
        return ids


def parse(body: Any, tok: Tokenizer, chat: ChatFormat | None, max_model_len: int) -> Parsed:
    """Check a completion (``chat`` None) or chat request body; ``BadField`` on a bad field."""
    if not isinstance(body, dict):
        raise BadField("body", "the request body must be a JSON object")
    model = _get(body, "model", str)
    if model is None:
        raise BadField("model", "'model' is required")
    where = "messages" if chat else "prompt"
    try:
        prompts = [chat.render(_messages(body))] if chat else _prompts(body, tok)
    except BadField:
        raise
    except InvalidRequest as e:  # empty, not integers: the prompt is the problem
        raise BadField(where, str(e)) from None
    if (longest := max(map(len, prompts))) >= max_model_len:
        what = "the rendered conversation" if chat else "the prompt"
        raise BadField(
            where,
            f"'{where}': {what} is {longest} tokens but the context holds {max_model_len} "
            "(the prompt and at least one generated token)",
        )
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadField("n", f"'n' must be in [1, {MAX_N}], got {n}")
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise BadField("stop", f"'stop' must be up to {MAX_STOP_STRINGS} non-empty strings")
    stream_options = _get(body, "stream_options", dict, {})
    _refuse_unsupported(body, KNOWN_FIELDS["chat" if chat else "completion"])
    return Parsed(
        model=model,
        prompts=prompts,
        params=_sampling(body, chat is not None, max_model_len - max(map(len, prompts))),
        n=n,
        stream=_get(body, "stream", bool, False),
        include_usage=_get(stream_options, "include_usage", bool, False),
        stop=stop,
        return_token_ids=_get(body, "return_token_ids", bool, False),
        session_id=session_id(_get(body, "user", str), "user"),
    )


def _refuse_unsupported(body: dict, known: set[str]) -> None:
    """``BadField`` for the first field this server does not implement (at a value other than
    its neutral one), or does not know at all."""
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name not in _UNSUPPORTED:
            raise BadField(name, f"'{name}' is not a field this server implements")
        if value != _UNSUPPORTED[name]:
            neutral = json.dumps(_UNSUPPORTED[name])
            raise BadField(name, f"'{name}' is not supported by this server (only {neutral})")


def _logit_bias(body: dict) -> dict[int, Any]:
    """``logit_bias``: JSON object keys are text; each must be a token id in decimal."""
    bias = _get(body, "logit_bias", dict, {})
    if not all(isinstance(k, str) and k.isascii() and k.isdigit() for k in bias):
        raise BadField("logit_bias", "'logit_bias' keys must be token ids (decimal digits)")
    return {int(k): v for k, v in bias.items()}


def session_id(value: str | None, name: str) -> str | None:
    """A request's session id (``user`` or the X-Session-Id header), at most
    ``MAX_SESSION_ID`` characters; None when absent or empty."""
    if value and len(value) > MAX_SESSION_ID:
        raise BadField(name, f"'{name}' must be at most {MAX_SESSION_ID} characters")
    return value or None


def _sampling(body: dict, chat: bool, room: int) -> SamplingParams:
    """``SamplingParams`` of the body's values (it validates them, naming the field)."""
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = max(room, 1) if chat else DEFAULT_COMPLETION_TOKENS
    elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > room:
        raise BadField(
            param,
            f"'{param}' is {max_tokens} but the context leaves room for "
            f"{max(room, 0)} tokens after the prompt",
        )
    if chat:
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool) else None
    else:
        logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        param = "top_logprobs" if chat else "logprobs"
        raise BadField(param, f"'{param}' must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    kw = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    return SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs, logit_bias=_logit_bias(body), **kw
    )


class Detokenizer:
    """Text deltas of one choice from its growing token ids: never half a multi-byte character,
    never part of a stop string (stop strings count once ``min_tokens`` tokens were generated,
    as vLLM counts them). Each call decodes only a window of recent tokens (the text of
    ``tokens[prefix:]`` less that of ``tokens[prefix:read]``: a piece's leading space depends
    on the piece before it), so a long answer costs linear time, not quadratic."""

    def __init__(self, tok: Tokenizer, stop: Sequence[str], min_tokens: int = 0) -> None:
        self.tok = tok
        self.stop = list(stop)
        self.min_tokens = min_tokens  # stop strings count only from this many tokens on
        self.floor = 0  # where a stop string may start (the text sent before min_tokens)
        self.tokens = []
        self.text = ""  # the text of tokens[:read]
        self.prefix = self.read = 0
        self.sent = ""  # text handed out so far
        self.hold = max(map(len, self.stop), default=1) - 1  # chars that may start a stop string
        self.stopped = False  # a stop string was seen: nothing more to send

    def _decode_new(self, final: bool) -> None:
        head = self.tok.decode(self.tokens[self.prefix : self.read])
        full = self.tok.decode(self.tokens[self.prefix :])
        if full.endswith("\ufffd") and not final:
            return  # half a character: wait for the rest of its bytes
        self.text += full[len(head) :]
        self.prefix, self.read = self.read, len(self.tokens)

    def feed(self, tokens: Sequence[int], final: bool = False) -> str:
        """Add ``tokens``; return the text that can be sent now (all of it when ``final``)."""
        if self.stopped:
            return ""
        self.tokens += tokens
        self._decode_new(final)
        text, start = self.text, max(len(self.sent) - self.hold, self.floor)
        stops = self.stop if len(self.tokens) >= self.min_tokens else []
        hits = [i for s in stops if (i := text.find(s, start)) >= 0]
        if hits:
            text, self.stopped, final = text[: min(hits)], True, True
        if not final and stops:
            text = text[: max(len(text) - self.hold, len(self.sent))]
        delta, self.sent = text[len(self.sent) :], text
        if not stops:  # before min_tokens: all sent, and no stop string may start in it
            self.floor = len(self.sent)
        return delta

    def piece(self, token_id: int) -> str:
        """The text of one token as logprobs show it."""
        return self.tok.id_to_piece(token_id).replace("\u2581", " ")
