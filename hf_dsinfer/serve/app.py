"""The FastAPI app of `hf-dsinfer serve`: OpenAI-compatible routes over one Engine.

    POST /v1/completions        prompt (text or token ids) -> text; `stream: true` for SSE
    POST /v1/chat/completions   messages -> the model's chat template -> text; SSE as above
    GET  /v1/models             the one served model
    GET  /health                200 ok, or 503 with the reason (generation thread failed, ...)
    GET  /metrics               queue depth, KV blocks in use, tok/s, request counts (JSON)

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}` with a 4xx for the
client's mistakes (400 bad field, 404 unknown model, 429 busy) and 5xx for the server's; the
server keeps serving after each. A client that goes away (a closed stream, or a dropped
connection while a non-streaming request runs) has its request cancelled in the manager, which
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from tokenizers.decoders import DecodeStream

from hf_dsinfer.errors import ServeError
from hf_dsinfer.serve import protocol
from hf_dsinfer.serve.engine import Admitted, Engine

logger = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # an idle stream sends an SSE comment this often: a gone client shows up


def create_app(engine: Engine) -> FastAPI:
    """The app; its lifespan starts the engine (unless started) and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine.manager is None:
            await asyncio.to_thread(engine.start)
        yield
        await engine.aclose()

    app = FastAPI(title="hf-dsinfer serve", lifespan=lifespan)
    app.state.engine = engine
    app.add_exception_handler(ServeError, _serve_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy, reason = engine.health()
        return JSONResponse({"status": reason}, status_code=200 if healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                            "created": engine.created, "owned_by": "hf-dsinfer",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> dict:
        return engine.metrics()

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
        return await _generate(engine, request, body, _prompt_ids(engine, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Any:
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await _generate(engine, request, body, _chat_ids(engine, body), chat=True)

    return app


# -- errors ---------------------------------------------------------------------------------------
async def _serve_error(request: Request, exc: ServeError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(protocol.error_body(exc.message, exc.status, exc.param, exc.code),
                        status_code=exc.status, headers=headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's errors, one line each: where, what is wrong, what was given."""
    lines, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        given = err.get("input")
        shown = "" if err.get("type") == "missing" else f" (given: {str(given)[:80]!r})"
        lines.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}{shown}")
    message = "invalid request: " + "; ".join(lines[:5])
    if any(err.get("type") == "json_invalid" for err in exc.errors()):
        message = "the request body is not valid JSON: " + "; ".join(lines[:1])
    return JSONResponse(protocol.error_body(message, 400, param, "invalid_request"),
                        status_code=400)


# -- prompts ----------------------------------------------------------------------------------------
def _prompt_ids(engine: Engine, body: protocol.CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ServeError(400, f"`prompt`: one prompt per request (given a list of "
                             f"{len(prompt)}). Fix: send one request per prompt.", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.tokenizer(prompt)["input_ids"]
    vocab = engine.model.config.get_text_config().vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ServeError(400, f"`prompt`: token ids must be in [0, {vocab}) (given: {bad[:5]}).",
                         param="prompt")
    return list(prompt)


def _chat_ids(engine: Engine, body: protocol.ChatCompletionRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(400, f"model {engine.model_name!r} has no chat template. Fix: use "
                         "/v1/completions with a prompt.", param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    except Exception as exc:  # the template's own checks (roles must alternate, ...)
        raise ServeError(400, f"`messages`: the chat template refused them: {exc}",
                         param="messages") from exc
    return list(ids)


# -- generation -------------------------------------------------------------------------------------
def _check(engine: Engine, body: protocol._Common, prompt_ids: list[int]) -> int:
    """max_new_tokens for this request, after the model / length / parameter checks."""
    engine.check_accepting()  # 503 while stopping or after the generation thread died
    if body.model is not None and body.model != engine.model_name:
        raise ServeError(404, f"model {body.model!r} is not served here; this server serves "
                         f"{engine.model_name!r} (GET /v1/models). Fix: set `model` to it.",
                         param="model", code="model_not_found")
    protocol.refuse_unsupported(body)
    if not prompt_ids:
        raise ServeError(400, "the prompt is empty (0 tokens). Fix: send some text.",
                         param="prompt")
    max_new = body.max_tokens or min(engine.limits.default_max_tokens,
                                     engine.max_model_len - len(prompt_ids))
    total, limit = len(prompt_ids) + max_new, min(engine.max_model_len, engine.kv_capacity_tokens)
    if total > limit:
        raise ServeError(400, f"prompt of {len(prompt_ids)} tokens + max_tokens {max_new} = "
                         f"{total} tokens; the server takes at most {limit} (context "
                         f"{engine.max_model_len}, KV cache {engine.kv_capacity_tokens}). Fix: "
                         "shorten the prompt or lower max_tokens.", param="max_tokens"
                         if len(prompt_ids) < limit else "prompt", code="context_length_exceeded")
    return max_new


async def _generate(engine: Engine, request: Request, body: protocol._Common,
                    prompt_ids: list[int], chat: bool) -> Any:
    max_new = _check(engine, body, prompt_ids)
    config = engine.generation_config
    sampling = protocol.sampling_kwargs(
        body, bool(config.do_sample), getattr(engine, "sampling_keys", {}),
        {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k})
    outputs: asyncio.Queue = asyncio.Queue()
    admitted = await engine.submit(prompt_ids, max_new, sampling, outputs.put_nowait)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(engine, admitted, outputs, chat, include_usage, body.return_token_ids)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        output = await _wait_finished(request, outputs)
    finally:
        engine.cancel(admitted)  # no-op when it finished; frees its blocks when it did not
    if output is None:  # the client went away
        return JSONResponse(protocol.error_body("client disconnected", 499), status_code=499)
    _raise_failed(engine, output)
    tokens = list(output.generated_tokens)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return protocol.completion_body(admitted.request_id, engine.model_name, chat, text,
                                    _finish_reason(engine, admitted, tokens), prompt_ids, tokens,
                                    body.return_token_ids)


async def _wait_finished(request: Request, outputs: asyncio.Queue) -> Any | None:
    """The finished output, or None when the client disconnected first."""
    while True:
        try:
            output = await asyncio.wait_for(outputs.get(), timeout=KEEPALIVE_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            continue
        if output.is_finished():
            return output


def _raise_failed(engine: Engine, output: Any) -> None:
    if output.error is None:
        return
    fatal = engine.manager.background_thread_status.fatal_error
    status = 503 if fatal is not None else 500
    raise ServeError(status, f"generation failed: {output.error}"
                     + (" (the generation thread stopped; restart the server)" if fatal else ""),
                     code="generation_failed")


def _finish_reason(engine: Engine, admitted: Admitted, tokens: list[int]) -> str:
    eos = engine.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    if tokens and tokens[-1] in eos:
        return "stop"
    return "length" if len(tokens) >= admitted.max_new_tokens else "stop"


async def _stream(engine: Engine, admitted: Admitted, outputs: asyncio.Queue, chat: bool,
                  include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
    """SSE events: text deltas as tokens arrive (incremental detokenization, so the pieces
    concatenate to the non-streaming text), a final chunk with finish_reason, usage if asked,
    [DONE]. Closed early (client gone): the request is cancelled in the manager."""
    rid, name = admitted.request_id, engine.model_name
    decoder = DecodeStream(skip_special_tokens=True)
    rust = engine.tokenizer._tokenizer
    seen = 0
    try:
        if chat:
            yield protocol.chunk_sse(rid, name, chat, "", role=True)
        while True:
            try:
                output = await asyncio.wait_for(outputs.get(), timeout=KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"  # a write to a gone client raises here
                continue
            new = list(output.generated_tokens[seen:])
            seen += len(new)
            text = "".join(piece for t in new if (piece := decoder.step(rust, t)) is not None)
            if text or (token_ids and new):
                yield protocol.chunk_sse(rid, name, chat, text, token_ids=new if token_ids else None)
            if output.error is not None:
                try:
                    _raise_failed(engine, output)
                except ServeError as exc:
                    yield protocol.sse(protocol.error_body(exc.message, exc.status, None,
                                                           exc.code))
                return
            if output.is_finished():
                tokens = list(output.generated_tokens)
                finish = _finish_reason(engine, admitted, tokens)
                yield protocol.chunk_sse(rid, name, chat, None, finish=finish)
                if include_usage:
                    yield protocol.usage_sse(rid, name, chat, admitted.prompt_len, len(tokens))
                yield protocol.sse("[DONE]")
                return
    finally:
        engine.cancel(admitted)  # no-op when it finished
