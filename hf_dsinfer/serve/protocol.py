"""OpenAI request bodies (validated with pydantic: unknown fields, wrong types and out-of-range
values are refused with the field named) and the response / stream-chunk payloads.

What HF's continuous batching cannot do per request is refused rather than ignored: several
choices (`n`), `logprobs`, `echo`, `suffix`, `best_of`, penalties, `stop` strings; sampling
parameters on a server started greedy; a `seed` on a sampling server (HF's manager has one
random stream for every request).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hf_dsinfer.errors import ServeError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 and 0 mean off
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: the prompt's and choice's token ids


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


def refuse_unsupported(body: _Common) -> None:
    """400 for a field the server parses but cannot honour (instead of ignoring it)."""
    unsupported = {
        "n": body.n != 1,
        "stop": bool(body.stop),
        "presence_penalty": body.presence_penalty != 0.0,
        "frequency_penalty": body.frequency_penalty != 0.0,
        "logprobs": bool(getattr(body, "logprobs", None)),
        "top_logprobs": getattr(body, "top_logprobs", None) is not None,
        "echo": getattr(body, "echo", False),
        "suffix": getattr(body, "suffix", None) is not None,
        "best_of": getattr(body, "best_of", None) not in (None, 1),
    }
    for param, given in unsupported.items():
        if given:
            raise ServeError(400, f"`{param}` is not supported by hf-dsinfer serve (given: "
                             f"{getattr(body, param)!r}); HF's continuous batching has no per-"
                             f"request {param}. Fix: leave `{param}` out.", param=param,
                             code="unsupported_parameter")


def sampling_kwargs(body: _Common, do_sample: bool, supported: dict[str, type],
                    defaults: dict[str, Any]) -> dict:
    """The per-request logits-processor kwargs HF's manager takes for this request.

    Greedy server: only neutral values are accepted (temperature 0, top_p 1, top_k off).
    Sampling server: temperature 0 becomes top_k=1 (exactly greedy: one candidate left);
    otherwise each value goes to the per-request processor of that name, and a value the server
    has no processor for (its start-up default was neutral) is refused."""
    top_k = None if body.top_k in (None, -1, 0) else body.top_k
    asked = {"temperature": body.temperature, "top_p": body.top_p, "top_k": top_k}
    if not do_sample:
        for param, value in asked.items():
            if value is not None and value != {"temperature": 0.0, "top_p": 1.0}.get(param):
                raise ServeError(400, f"`{param}`={value!r}: this server decodes greedily. Fix: "
                                 f"leave `{param}` out (or temperature=0), or start the server "
                                 "with --do-sample.", param=param, code="greedy_server")
        return {}
    if body.seed is not None:
        raise ServeError(400, "`seed` is not supported on a sampling server: HF's continuous "
                         "batching draws every request from one random stream. Fix: leave "
                         "`seed` out, or set --seed at server start.", param="seed",
                         code="unsupported_parameter")
    if body.temperature == 0.0:
        asked = {"top_k": 1}
    kwargs = {}
    for param, value in asked.items():
        if value is None or value == defaults.get(param):
            continue
        if param not in supported:
            raise ServeError(400, f"`{param}`={value!r}: the server has no per-request {param} "
                             f"(its default {defaults.get(param)!r} is neutral). Fix: leave "
                             f"`{param}` out, or start the server with --{param.replace('_', '-')}"
                             " set to a non-neutral default.", param=param,
                             code="unsupported_parameter")
        kwargs[param] = supported[param](value)
    return kwargs


# -- responses ----------------------------------------------------------------------------------
def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
    kind = ("invalid_request_error" if status < 500 and status not in (429,)
            else "rate_limit_error" if status == 429 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, chat: bool, text: str, finish: str,
                    prompt_ids: list[int], tokens: list[int], token_ids: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(len(prompt_ids), len(tokens))}
    if token_ids:
        choice["token_ids"] = list(tokens)
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def chunk_sse(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None,
              role: bool = False, token_ids: list[int] | None = None) -> str:
    """One `data:` event of a stream (text None: an empty delta, as in a final chunk)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": int(time.time()), "model": model, "choices": [choice]}
    return sse(chunk)


def usage_sse(rid: str, model: str, chat: bool, prompt_tokens: int, tokens: int) -> str:
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [],
                "usage": usage(prompt_tokens, tokens)})


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
