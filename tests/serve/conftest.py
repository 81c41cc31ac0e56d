"""A served tiny model: the app under a real uvicorn on a free local port, in a thread (streams,
disconnects and 429s behave as over a network), and HF's own greedy generate as reference."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn
from transformers import ContinuousBatchingConfig

import hf_dsinfer
from hf_dsinfer.serve import Engine, ServeLimits, create_app
from tests.tiny_models import make_model, tiny_tokenizer

# a template the word-level tiny tokenizer reads back: <s> then each message's words, then w4
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}w4"


def tiny_engine(limits: ServeLimits | None = None, num_blocks: int = 64, **engine_kw) -> Engine:
    """An injected tiny Llama (fp32) behind an Engine; page 8, prefill chunks of 32 tokens."""
    model = hf_dsinfer.init_inference(make_model("llama"))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    cb = engine_kw.pop("cb_config", None) or ContinuousBatchingConfig(
        num_blocks=num_blocks, page_size=8, max_batch_tokens=32)
    return Engine(model, tokenizer, "tiny-llama", cb_config=cb,
                  limits=limits or ServeLimits(max_requests=16), **engine_kw)


class Served:
    def __init__(self, engine: Engine, server: uvicorn.Server, url: str):
        self.engine, self.server, self.url = engine, server, url
        self.client = httpx.Client(base_url=url, timeout=60)

    def metrics(self) -> dict:
        return self.client.get("/metrics").json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Metrics once no request is in flight and no KV block is referenced."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m["requests_in_flight"] == 0 and m["kv_blocks_in_use"] == 0 \
                and m["requests_running"] == 0 and m["requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


@contextlib.contextmanager
def serve(engine: Engine) -> Iterator[Served]:
    """uvicorn in a thread; on exit the app's shutdown stops the engine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    served = Served(engine, server, f"http://127.0.0.1:{port}")
    try:
        yield served
    finally:
        served.client.close()
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(tiny_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    """HF's own model (un-injected, same weights): greedy token ids for a prompt."""
    model = make_model("llama")

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    generate.model = model
    return generate
