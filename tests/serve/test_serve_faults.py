"""Faults around `hf-dsinfer serve`: a client that disconnects mid-stream frees its KV blocks,
the request limit answers 429, requests beyond the KV cache wait instead of failing, an error in
the manager's thread reaches clients, /health and stop(), shutdown is graceful, and the
command line's --dsinfer options are checked before anything loads."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import pytest

from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.serve import ServeLimits, sampling_config
from hf_dsinfer.serve.cli import add_parser, dsinfer_options
from tests.serve.conftest import serve, tiny_engine

LONG = 100  # max_tokens of requests that must still be running when the client leaves


def _first_token_then_close(served, body: dict) -> None:
    with served.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one token arrived: leave, with the request generating


def test_disconnect_mid_stream_frees_kv_blocks(served):
    before = served.wait_idle()
    prompt = list(range(5, 25))
    _first_token_then_close(served, {"prompt": prompt, "max_tokens": LONG})
    after = served.wait_idle()
    assert after["kv_blocks_in_use"] == 0 and after["requests_running"] == 0
    assert after["requests_in_flight"] == 0 and after["kv_blocks_reserved"] == 0
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["requests_completed_total"] == before["requests_completed_total"]
    assert after["tokens_generated_total"] - before["tokens_generated_total"] < LONG
    # and the server goes on serving
    ok = served.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert ok.status_code == 200


def test_disconnect_during_non_streaming_request_cancels_it(served):
    before = served.wait_idle()
    manager = served.engine.manager
    with manager.pause():  # nothing generates: the request is in flight when the client leaves
        with pytest.raises(httpx.ReadTimeout):
            served.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": LONG},
                               timeout=0.5)
        deadline = time.monotonic() + 10
        while served.metrics()["requests_cancelled_total"] == before["requests_cancelled_total"]:
            assert time.monotonic() < deadline, "the server did not notice the client left"
            time.sleep(0.05)
    after = served.wait_idle()
    assert after["kv_blocks_in_use"] == 0 and after["requests_in_flight"] == 0
    assert after["requests_completed_total"] == before["requests_completed_total"]


def test_request_limit_answers_429_then_recovers():
    engine = tiny_engine(ServeLimits(max_requests=2))
    with serve(engine) as served:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "stream": True}
        with engine.manager.pause(), served.client.stream("POST", "/v1/completions",
                                                          json=body) as a, \
                served.client.stream("POST", "/v1/completions", json=body) as b:
            assert a.status_code == b.status_code == 200
            r = served.client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "--max-requests" in error["message"]
            assert served.metrics()["requests_in_flight"] == 2
        m = served.wait_idle()
        assert m["requests_rejected_total"] == 1 and m["kv_blocks_in_use"] == 0
        assert served.client.post("/v1/completions",
                                  json={"prompt": [5], "max_tokens": 2}).status_code == 200


def test_requests_beyond_kv_cache_wait_then_complete(reference):
    """A cache of 16 blocks of 8 tokens; 6 requests of 20 + 28 tokens (6 blocks each): two fit
    at a time, the others wait here (not in the manager, which would run out of blocks)."""
    engine = tiny_engine(num_blocks=16)
    with serve(engine) as served:
        assert served.metrics()["kv_blocks_total"] == 16
        prompts = [list(range(3 + i, 23 + i)) for i in range(6)]
        seen_waiting = []

        async def run() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
                async def one(ids):
                    r = await client.post("/v1/completions", json={
                        "prompt": ids, "max_tokens": 28, "return_token_ids": True})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["token_ids"]

                async def watch():
                    while True:
                        m = (await client.get("/metrics")).json()
                        seen_waiting.append(m["requests_waiting_for_kv"])
                        assert m["kv_blocks_reserved"] <= 16
                        await asyncio.sleep(0.01)

                watcher = asyncio.create_task(watch())
                try:
                    return await asyncio.gather(*(one(p) for p in prompts))
                finally:
                    watcher.cancel()

        assert asyncio.run(run()) == [reference(p, 28) for p in prompts]
        assert max(seen_waiting) > 0
        assert served.wait_idle()["kv_blocks_reserved"] == 0
        assert engine.health() == (True, "ok")


def test_error_in_generation_thread_reaches_clients_and_stop():
    """A fused block that raises inside the manager's thread: the request gets a 5xx naming the
    error, /health turns 503, new requests get 503, and stop() returns the error."""
    engine = tiny_engine()
    fused = next(iter(get_report(engine.model).blocks.values()))

    def fail(x):
        raise RuntimeError("boom in the fused MLP")

    with serve(engine) as served:
        fused._mlp = fail
        r = served.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code in (500, 503)
        assert "boom in the fused MLP" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while served.client.get("/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        health = served.client.get("/health")
        assert "boom in the fused MLP" in health.json()["status"]
        again = served.client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert again.status_code == 503 and "restart" in again.json()["error"]["message"]
    assert "boom in the fused MLP" in repr(engine.fatal_error)
    del fused._mlp


def test_graceful_shutdown_finishes_stream_then_stops_manager():
    """Shutdown asked while a stream is in flight (its generation paused): the stream still
    ends with [DONE], then the manager's thread is stopped, with no error."""
    engine = tiny_engine()
    lines: list[str] = []
    with serve(engine) as served:
        def read() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 20, "stream": True}
            with served.client.stream("POST", "/v1/completions", json=body) as r:
                lines.extend(r.iter_lines())

        reader = threading.Thread(target=read)
        with engine.manager.pause():
            reader.start()
            deadline = time.monotonic() + 10
            while served.metrics()["requests_in_flight"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            served.server.should_exit = True  # what SIGINT / SIGTERM do
            time.sleep(0.3)
            assert engine.manager.is_running()  # uvicorn waits for the open stream
        reader.join(30)
    assert "data: [DONE]" in lines  # the stream in flight was finished, not cut
    assert sum(line.startswith("data: {") for line in lines) >= 2
    assert not engine.manager.is_running() and engine.fatal_error is None
    assert engine.health() == (False, "shutting down")


def test_sampling_server_per_request_parameters(reference):
    """--do-sample: temperature 0 is exactly greedy (top_k=1), other values go to HF's
    per-request processors, a seed is refused (one random stream for every request)."""
    engine = tiny_engine()
    engine.generation_config = sampling_config(engine.model, 0.7, 0.95, 50)
    engine.cb_config.per_request_processors = True
    with serve(engine) as served:
        ids = [5, 17, 9, 33]
        r = served.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6,
                                                        "temperature": 0,
                                                        "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == reference(ids, 6)
        sampled = served.client.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 6, "temperature": 1.3, "top_p": 0.5, "top_k": 7})
        assert sampled.status_code == 200 and sampled.json()["usage"]["completion_tokens"] >= 1
        seeded = served.client.post("/v1/completions", json={"prompt": ids, "seed": 3})
        assert seeded.status_code == 400 and seeded.json()["error"]["param"] == "seed"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_dsinfer_options():
    assert dsinfer_options(_args()) is True
    assert dsinfer_options(_args("--no-dsinfer")) is False
    assert dsinfer_options(_args("--dsinfer", '{"quant": {"bits": 8}}')) == {"quant": {"bits": 8}}
    assert dsinfer_options(_args("--dsinfer", '{"kernels": "ref"}', "--quant", "int4")) == {
        "kernels": "ref", "quant": {"bits": 4}}
    assert dsinfer_options(_args("--quant", "int4-a8")) == {
        "quant": {"bits": 4, "act_bits": 8}}
    with pytest.raises(SystemExit, match="not JSON"):
        dsinfer_options(_args("--dsinfer", "{quant: 8"))
    with pytest.raises(SystemExit, match="qaunt"):
        dsinfer_options(_args("--dsinfer", '{"qaunt": {"bits": 8}}'))
    with pytest.raises(SystemExit, match="drop --no-dsinfer"):
        dsinfer_options(_args("--no-dsinfer", "--quant", "int8"))
    args = _args()
    assert (args.host, args.port, args.max_requests, args.model) == ("127.0.0.1", 8000, 64, None)
