"""The OpenAI request shapes the embedded server accepts, validated at the edge.

``parse_completion`` and ``parse_chat`` turn a request body into one :class:`ParsedRequest` per choice (prompts x
``n``) or raise :class:`BadRequest`, naming the field, for anything the engine cannot honour (logprobs,
penalties, tools, a prompt longer than the context): a 400 with OpenAI's error JSON, never a silently different
experiment. The fields and defaults follow vLLM's implementation of the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class BadRequest(Exception):
    """A request the server refuses: becomes HTTP 400 (or ``status``) with OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class ServedModel(Protocol):
    """What parsing reads of the server: the names it answers to and the model's limits and tokenizer."""

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


@dataclass
class ParsedRequest:
    """One choice of a request: what the engine runs and how the server streams and counts it."""

    prompt_ids: list[int]
    params: Any  # engine SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    model: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage in every chunk
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids beside the text
    prompt_index: int = 0  # which prompt of a batch (several choices of one prompt share it: n > 1)


_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    # field: values that mean "off" (anything else would silently change the experiment)
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None,),
    "top_logprobs": (None, 0),
    "use_beam_search": (None, False),
    "tools": (None,),
    "tool_choice": (None, "none", "auto"),  # with no tools, "required" or a named function cannot be honoured
    # vLLM honours these; silently serving without them would return output the client did not ask for
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None,),
    "logits_processors": (None,),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None,),
}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Choices one request may ask for (prompts x n): each is an engine request, so a bound keeps one HTTP request
# from queueing thousands of them.
MAX_CHOICES = 128

def _make_params(body: dict[str, Any], max_tokens: int, sample: int = 0) -> Any:
    from dspark_cli.engines.embedded.sequence import SamplingParams

    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    if body.get("temperature") is not None:
        kwargs["temperature"] = float(body["temperature"])
    if body.get("top_p") is not None:
        kwargs["top_p"] = float(body["top_p"])
    if body.get("ignore_eos") is not None:
        kwargs["ignore_eos"] = bool(body["ignore_eos"])
    if body.get("seed") is not None:
        # vLLM's parallel sampling: the j-th of n samples is seeded seed + j, so they differ and each repeats
        kwargs["seed"] = int(body["seed"]) + sample
    if body.get("stop_token_ids"):
        kwargs["stop_token_ids"] = tuple(int(t) for t in body["stop_token_ids"])
    return SamplingParams(**kwargs)


def parse_common(ctx: ServedModel, body: Any) -> tuple[dict[str, Any], list[str], str]:
    """Validate the sampling fields both endpoints share; return (body, stop strings, model name)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    if model is not None and model not in ctx.names:
        raise BadRequest(f"The model `{model}` does not exist; this server serves `{ctx.served_model_name}`",
                         "model", status=404)
    for key in ("stream", "ignore_eos", "return_token_ids"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise BadRequest(f"'{key}' must be true or false", key)
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= MAX_CHOICES):
        raise BadRequest(f"'n' must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not is_int(v) or v <= 0):
            raise BadRequest(f"'{key}' must be a positive integer, got {v!r}", key)
    t = body.get("temperature")
    if t is not None and (not _is_num(t) or t < 0):
        raise BadRequest(f"'temperature' must be a number >= 0, got {t!r}", "temperature")
    p = body.get("top_p")
    if p is not None and (not _is_num(p) or not 0 < p <= 1):
        raise BadRequest(f"'top_p' must be in (0, 1], got {p!r}", "top_p")
    s = body.get("seed")
    if s is not None and not (is_int(s) and -(1 << 63) <= s < 1 << 63):
        raise BadRequest(f"'seed' must be a 64-bit integer, got {s!r}", "seed")
    if s is not None and s + (n or 1) - 1 >= 1 << 63:
        # sample j of n is seeded seed + j (_make_params)
        raise BadRequest(f"'seed' {s} leaves no room for n={n} samples seeded seed + j within 64 bits", "seed")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stops = list(stop)
    else:
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    sti = body.get("stop_token_ids")
    if sti is not None and not (isinstance(sti, list) and all(is_int(x) and x >= 0 for x in sti)):
        raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    if body.get("logprobs") is not None and body["logprobs"] is not False:  # completions' 0 asks for them too
        raise BadRequest("logprobs are not supported by the embedded engine", "logprobs")
    for key, off in _UNSUPPORTED_DEFAULTS.items():
        v = body.get(key)
        empty = isinstance(v, (list, dict)) and not v  # an empty list or object asks for nothing
        if v is not None and not empty and not any(v == o and type(v) is type(o) for o in off if o is not None):
            raise BadRequest(f"'{key}' is not supported by the embedded engine (got {v!r})", key)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    if so is not None and body.get("stream") is not True:
        raise BadRequest("'stream_options' needs 'stream': true", "stream_options")  # as vLLM refuses it
    return body, stops, model or ctx.served_model_name


# vLLM's CompletionRequest default (absent or null); its chat default is the rest of the context.
COMPLETION_MAX_TOKENS = 16


def _check_length(ctx: ServedModel, prompt_ids: list[int], body: dict[str, Any], default: int | None) -> int:
    """Return max_tokens (``default``, capped by the rest of the context, when the request names none, as vLLM
    does); 400 when it cannot fit."""
    limit = ctx.max_model_len
    n = len(prompt_ids)
    if n == 0:
        raise BadRequest("the prompt is empty", "prompt")
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    if n >= limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                         f"{n} tokens, leaving no room for the completion. Please shorten the prompt.", "prompt")
    if requested is None:
        return limit - n if default is None else min(default, limit - n)
    if n + requested > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{n + requested} tokens ({n} in the prompt, {requested} for the completion). "
                         "Please reduce the prompt or max_tokens.", "max_tokens")
    return int(requested)


def _prompt_ids(ctx: ServedModel, prompt: Any) -> list[int]:
    """One prompt (text or token ids) as token ids."""
    if isinstance(prompt, str):
        return list(ctx.tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list) and prompt and all(is_int(x) for x in prompt):
        vocab = ctx.vocab_size
        bad = [x for x in prompt if not 0 <= x < vocab]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is out of range [0, {vocab})", "prompt")
        return list(prompt)
    raise BadRequest("'prompt' must be a string, a non-empty list of token ids, or a list of those", "prompt")


def _choices(ctx: ServedModel, body: dict[str, Any], stops: list[str], model: str,
             prompts: list[list[int]], default_max_tokens: int | None) -> list[ParsedRequest]:
    """One request per choice, in the order vLLM indexes them: prompt by prompt, each prompt's n samples."""
    n = body.get("n") or 1
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n={n} asks for more than {MAX_CHOICES} choices; split the "
                         "request", "n")
    out = []
    for p, ids in enumerate(prompts):
        max_tokens = _check_length(ctx, ids, body, default_max_tokens)
        for j in range(n):
            out.append(ParsedRequest(ids, _make_params(body, max_tokens, j), stops, bool(body.get("stream")),
                                     _include_usage(body), model, _continuous_usage(body),
                                     body.get("return_token_ids") is True, p))
    return out


def parse_completion(ctx: ServedModel, body: Any) -> list[ParsedRequest]:
    """The choices a completion request asks for: each prompt of a batch (a list of texts or of token-id lists)
    times ``n``."""
    body, stops, model = parse_common(ctx, body)
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", "prompt")
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(x, (str, list)) for x in prompt)
    if batch and len({type(x) for x in prompt}) > 1:
        raise BadRequest("'prompt' must be a list of one kind: texts, or token-id lists", "prompt")
    return _choices(ctx, body, stops, model, [_prompt_ids(ctx, x) for x in (prompt if batch else [prompt])],
                    COMPLETION_MAX_TOKENS)


def _include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options") or {}
    return bool(so.get("include_usage"))


def _continuous_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options") or {}
    return bool(so.get("include_usage")) and bool(so.get("continuous_usage_stats"))


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _message_text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(ctx: ServedModel, body: Any) -> list[ParsedRequest]:
    """The choices a chat request asks for: ``n`` samples of one conversation."""
    body, stops, model = parse_common(ctx, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list", "messages")
    conv = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role = msg.get("role")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
        conv.append({"role": role, "content": _message_text(i, msg.get("content"))})
    tok = ctx.tokenizer
    if not getattr(tok, "chat_template", None):
        raise BadRequest("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 -- template errors (jinja raise_exception) are the user's input
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from None
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return _choices(ctx, body, stops, model, [ids], None)

