"""`hf-dsinfer serve` on a tiny injected Llama, fp32 greedy, over real HTTP: served tokens equal
HF's own generate, streams concatenate to the same text, concurrent requests all complete, the
fused blocks ran over the paged cache, bad requests get a 4xx naming the problem, metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.serve import Engine
from tests.tiny_models import VOCAB

NEW = 8


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _stream(served, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """(the data events as JSON, every raw line) of one streamed request."""
    events, lines = [], []
    with served.client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
    return events, lines


def test_completion_tokens_equal_hf_generate(served, reference):
    """Token-id prompts of 5, 23 and 45 tokens (45: prefill over the 32-token budget, in two
    chunks): the served tokens are HF's greedy generate's; the fused blocks attended over the
    paged cache in every forward."""
    fused = list(get_report(served.engine.model).blocks.values())
    before = hf_dsinfer.fused_call_counts(served.engine.model)
    paged_before = [f.paged.calls for f in fused]
    for n, seed in ((5, 1), (23, 2), (45, 3)):
        ids = _ids(n, seed)
        r = served.client.post("/v1/completions", json={"prompt": ids, "max_tokens": NEW,
                                                        "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        expected = reference(ids, NEW)
        assert body["choices"][0]["token_ids"] == expected
        assert body["prompt_token_ids"] == ids
        assert body["usage"] == {"prompt_tokens": n, "completion_tokens": len(expected),
                                 "total_tokens": n + len(expected)}
        finish = "stop" if len(expected) < NEW or expected[-1] == 2 else "length"
        assert body["choices"][0]["finish_reason"] == finish
    after = hf_dsinfer.fused_call_counts(served.engine.model)
    assert all(after[p] > before[p] for p in before)
    assert all(f.paged.calls > c and not f.paged.deferred for f, c in zip(fused, paged_before))


def test_text_prompt_and_stream_concatenate_to_same_text(served, reference):
    prompt = "w5 w17 w9 w33 w12 w40"
    ids = served.engine.tokenizer(prompt)["input_ids"]
    plain = served.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": NEW,
                                                        "return_token_ids": True}).json()
    expected = reference(ids, NEW)
    assert plain["choices"][0]["token_ids"] == expected
    assert plain["choices"][0]["text"] == served.engine.tokenizer.decode(
        expected, skip_special_tokens=True)
    events, _ = _stream(served, "/v1/completions", {
        "prompt": prompt, "max_tokens": NEW, "stream_options": {"include_usage": True},
        "return_token_ids": True})
    chunks = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == plain["choices"][0]["text"]
    assert [t for e in chunks for t in e["choices"][0].get("token_ids") or []] == expected
    assert len(chunks) >= 3  # it streamed, token by token
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    assert events[-1]["usage"] == plain["usage"] and events[-1]["choices"] == []


def test_chat_completion_and_stream(served, reference):
    messages = [{"role": "system", "content": "w7 w8"},
                {"role": "user", "content": [{"type": "text", "text": "w21 w22 w23"}]}]
    ids = served.engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w21 w22 w23"}],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    r = served.client.post("/v1/chat/completions", json={
        "model": "tiny-llama", "messages": messages, "max_completion_tokens": NEW,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == ids
    assert body["choices"][0]["token_ids"] == reference(ids, NEW)
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    events, _ = _stream(served, "/v1/chat/completions", {"messages": messages, "max_tokens": NEW})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == message["content"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_concurrent_requests_all_complete(served, reference):
    """12 requests at once (some streamed), mixed lengths: each gets its own greedy tokens."""
    prompts = [_ids(n, 10 + i) for i, n in enumerate((3, 30, 9, 17, 44, 6, 12, 25, 4, 38, 8, 15))]

    async def one(client: httpx.AsyncClient, i: int, ids: list[int]) -> list[int]:
        body = {"prompt": ids, "max_tokens": NEW, "return_token_ids": True}
        if i % 3:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        tokens = []
        async with client.stream("POST", "/v1/completions",
                                 json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return tokens

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    got = asyncio.run(run())
    assert got == [reference(p, NEW) for p in prompts]
    assert served.wait_idle()["kv_blocks_in_use"] == 0


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


BAD_REQUESTS = [  # (path, body, status, the param named, words the message must hold)
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, 400, "max_tokens", "greater than"),
    ("/v1/completions", {"prompt": "w5", "bogus": 1}, 400, "bogus", "Extra inputs"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
    ("/v1/completions", {"prompt": "w5", "model": "gpt-9"}, 404, "model", "tiny-llama"),
    ("/v1/completions", {"prompt": "w5", "temperature": 0.8}, 400, "temperature", "--do-sample"),
    ("/v1/completions", {"prompt": "w5", "top_p": 1.5}, 400, "top_p", "less than or equal"),
    ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, 400, "temperature", "hot"),
    ("/v1/completions", {"prompt": "w5", "n": 2}, 400, "n", "not supported"),
    ("/v1/completions", {"prompt": "w5", "stop": ["w9"]}, 400, "stop", "not supported"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", "[0, 101)"),
    ("/v1/completions", {"prompt": ["w5", "w6"]}, 400, "prompt", "one prompt"),
    ("/v1/completions", {"prompt": "w5 " * 100, "max_tokens": 40}, 400, "max_tokens",
     "140 tokens"),
    ("/v1/completions", {"prompt": "w5 " * 130, "max_tokens": 1}, 400, "prompt", "131 tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w5"}]}, 400,
     "messages", "robot"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS)
def test_bad_request_gets_4xx_naming_it(served, path, body, status, param, words):
    error = _error(served.client.post(path, json=body), status)
    assert error["param"] == param
    assert words in error["message"]
    assert served.client.get("/health").status_code == 200


def test_malformed_json_and_wrong_method(served):
    r = served.client.post("/v1/completions", content=b'{"prompt": "w5",',
                           headers={"content-type": "application/json"})
    assert "not valid JSON" in _error(r, 400)["message"]
    assert served.client.get("/v1/completions").status_code == 405
    assert served.client.get("/health").json() == {"status": "ok"}
    assert served.metrics()["requests_failed_total"] == 0


def test_models_and_metrics(served):
    models = served.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert models["data"][0]["max_model_len"] == 128
    served.client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
    m = served.wait_idle()
    assert m["healthy"] is True and m["status"] == "ok"
    assert m["kv_blocks_total"] >= 64 and m["kv_page_size"] == 8
    assert m["kv_blocks_in_use"] == 0 and m["kv_blocks_reserved"] == 0
    assert m["requests_running"] == m["requests_waiting"] == m["requests_in_flight"] == 0
    assert m["tokens_per_second"] > 0  # tokens were generated in the last 10 s
    assert m["tokens_generated_total"] >= 4
    assert m["fused_block_calls"] == sum(hf_dsinfer.fused_call_counts(served.engine.model).values())
    assert m["fused_block_calls"] > 0
    assert m["requests_completed_total"] >= 1
    assert m["requests_submitted_total"] == (m["requests_completed_total"]
                                             + m["requests_failed_total"]
                                             + m["requests_cancelled_total"])
    assert isinstance(served.engine, Engine)
