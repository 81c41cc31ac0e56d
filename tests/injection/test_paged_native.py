"""Continuous batching's forwards in the native decode layer (FusedBlock._paged_native): each
block runs attn_in_rows over every packed token, the paged cache's own update, each request's
queries over its own keys (the decode rows in one native attention call, prefill chunks by
torch's attention) and post_attn_rows (one request's decode step: the batch-1 layer). Decode-only
forwards count as "paged_native", forwards with prefill chunks as "paged_native_mixed". Counted by the block's path record ("paged_native") and the layer's
call counters; tokens equal to the torch path's (the same kernels for the linears, per-row code
between them); calls the layer does not take go to the torch path.

Also: a manager's start releases the starting thread's OpenMP workers
(hardware.release_openmp_threads), so the manager's thread is the only pool that computes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
)

import hf_dsinfer
from hf_dsinfer import hardware
from hf_dsinfer.injection import paged
from hf_dsinfer.injection.fused import FusedBlock
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native, attention
from hf_dsinfer.kernels import decode as native_decode
from tests.kernels.conftest import count_calls, pin_crossovers
from tests.kernels.test_native_decode import _BASE  # head_dim 32: the native decode layer builds
from tests.switches import switch

pytestmark = [pytest.mark.skipif(not _native.builds(),
                                 reason=f"native kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("quiet_eos_warning")]

LENGTHS = (5, 11, 3, 17, 8)
NEW_TOKENS = 6


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16).eval()
    return hf_dsinfer.init_inference(model, dtype=torch.bfloat16)


def _prompts(lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, _BASE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def _generate_batch(model, prompts) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    cb = ContinuousBatchingConfig(max_batch_tokens=64, num_blocks=64, page_size=16)
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                               warmup=False)
    return [r.generated_tokens for r in out.values()]


def _layers(model) -> list[native_decode.DecodeLayer]:
    return [block.decode_layer() for block in get_report(model).blocks.values()]


def _counts(model) -> tuple[int, int, int]:
    """(paged_native calls over the blocks, batch-1 layer calls, batched layer calls)."""
    blocks = get_report(model).blocks.values()
    layers = _layers(model)
    return (sum(b.paths.counts["paged_native"] for b in blocks),
            sum(layer.calls for layer in layers), sum(layer.row_calls for layer in layers))


def _need_rows(model) -> native_decode.DecodeLayer:
    layer = _layers(model)[0]
    if layer.rows_why is not None:
        pytest.skip(f"the batched layer does not run here: {layer.rows_why}")
    return layer


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_decode_rows_run_the_native_layer(grad_mode, monkeypatch):
    """Several requests: their decode-only steps run the batched layer in every block (counted),
    and so do the forwards with prefill chunks where the layer takes all their rows (with AMX:
    up to 256; else the tier's bound, past which the torch path, "paged"); the tokens are the
    torch path's."""
    model = _model()
    layer = _need_rows(model)
    context = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    before = _counts(model)
    blocks = list(get_report(model).blocks.values())
    rows_attended = count_calls(monkeypatch, attention, "attend_rows_native")
    with context():
        native = _generate_batch(model, _prompts())
        after = _counts(model)
        assert len(rows_attended) >= len(blocks)  # the decode rows in the native kernel
        paths = [dict(b.paths.counts) for b in blocks]
        switch(monkeypatch, native=False)
        torch_path = _generate_batch(model, _prompts())
    assert all(len(tokens) == NEW_TOKENS for tokens in native)
    assert all(p.get("paged_native", 0) > 0 for p in paths)
    assert all(p.get("paged_native_mixed", 0) + p.get("paged", 0) > 0 for p in paths)
    if layer.rows_max >= sum(LENGTHS):  # every prefill forward fits the batched layer
        assert all(p.get("paged_native_mixed", 0) > 0 and "paged" not in p for p in paths)
    assert after[2] - before[2] >= len(blocks)  # post_attn_rows of several rows
    assert after == _counts(model)  # the torch path's run took none of them
    assert native == torch_path


def test_one_request_runs_the_batch_one_layer(monkeypatch):
    """A single request's decode steps run the batch-1 layer over its pages (counted), reading
    the keys where the cache keeps them (through the read index: no copy of them is made)."""
    model = _model(seed=1)
    prompt = _prompts((9,))
    gathers, keys_read, checking = [], [], []
    rows, attn_out = attention.SlotRows.rows, native_decode.DecodeLayer.attn_out
    read_in_place = paged.read_in_place

    def first_call_check(cache, *a):  # the allocator's one comparison with HF's own update
        checking.append(paged._verified.get(cache.layer_to_allocator[a[2]]) is None)
        try:
            return read_in_place(cache, *a)
        finally:
            checking.pop()

    monkeypatch.setattr(paged, "read_in_place", first_call_check)
    monkeypatch.setattr(attention.SlotRows, "rows",
                        lambda self, *a: gathers.append((a, any(checking))) or rows(self, *a))
    monkeypatch.setattr(native_decode.DecodeLayer, "attn_out",
                        lambda self, x, q, k, *a: keys_read.append(k) or attn_out(self, x, q, k, *a))
    with torch.inference_mode():
        before = _counts(model)
        native = _generate_batch(model, prompt)
        after = _counts(model)
    assert len(keys_read) == after[0] - before[0] > 0
    # the first decode step's update is HF's own (paged.read_in_place checks it), then in place
    assert all(isinstance(k, attention.SlotRows) for k in keys_read[1:])
    # none of the whole row (the prefill chunk's own keys only), but for the keys and values of
    # the first-call check, which compares HF's update with the rows read in place
    assert sum(1 for a, check in gathers if not a and check) <= 2
    assert all(a for a, check in gathers if not check)
    monkeypatch.setattr(attention.SlotRows, "rows", rows)
    monkeypatch.setattr(paged, "read_in_place", read_in_place)
    monkeypatch.setattr(native_decode.DecodeLayer, "attn_out", attn_out)
    with torch.inference_mode():
        switch(monkeypatch, native=False)
        torch_path = _generate_batch(model, prompt)
    blocks = len(get_report(model).blocks)
    assert after[0] - before[0] == (NEW_TOKENS - 1) * blocks  # every step after the prefill
    assert after[1] - before[1] == (NEW_TOKENS - 1) * blocks
    mixed = sum(b.paths.counts["paged_native_mixed"] for b in get_report(model).blocks.values())
    assert after[2] - before[2] == mixed  # the prefill, where the batched layer takes its rows
    assert native == torch_path


def test_rows_past_the_bound_take_the_torch_path(monkeypatch):
    """Without AMX the batched layer takes the rows for which the torch path's linears run the
    same native dot products (the tier's crossovers): more rows go to the torch path."""
    model = _model(seed=2)
    layer = _need_rows(model)
    if layer._amx:
        pytest.skip("with AMX the batched layer's bound is the AMX linear's (256 rows)")
    pin_crossovers(monkeypatch, bf16_gemv_max_rows=2, bf16_gemm_max_rows=None)
    assert layer.rows_max == 2
    seen: list[int] = []
    post = native_decode.DecodeLayer.post_attn_rows

    def counted(self, x, a):
        seen.append(x.shape[0])
        return post(self, x, a)

    monkeypatch.setattr(native_decode.DecodeLayer, "post_attn_rows", counted)
    with torch.inference_mode():
        native = _generate_batch(model, _prompts())
        switch(monkeypatch, native=False)
        torch_path = _generate_batch(model, _prompts())
    assert max(seen, default=0) <= 2
    assert native == torch_path
    assert all(b.paths.counts["paged"] > 0 for b in get_report(model).blocks.values())


def test_fp32_models_do_not_take_it():
    """fp32 models never run the native layer under continuous batching (it is bf16)."""
    torch.manual_seed(0)
    model = hf_dsinfer.init_inference(
        AutoModelForCausalLM.from_config(LlamaConfig(**_BASE)).eval())
    with torch.inference_mode():
        _generate_batch(model, _prompts())
    blocks = get_report(model).blocks.values()
    assert all(b.paths.counts["paged_native"] == 0 and b.paths.counts["paged"] > 0
               for b in blocks)


def test_manager_start_releases_the_starting_threads_openmp_workers(monkeypatch):
    """generate_batch's manager releases the caller's OpenMP workers once, when it starts."""
    calls: list[int] = []
    monkeypatch.setattr(hardware, "release_openmp_threads", lambda: calls.append(1) or True)
    model = _model(seed=3)
    with torch.inference_mode():
        assert all(len(t) == NEW_TOKENS for t in _generate_batch(model, _prompts((4, 6))))
    assert calls == [1]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info()
                    or not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs torch on OpenMP with 2+ threads, and Linux's /proc")
def test_release_openmp_threads_frees_this_threads_pool():
    """libgomp (torch's OpenMP runtime on Linux) offers omp_pause_resource_all: a fresh thread's
    parallel work starts a pool of workers, the release ends them, and parallel work afterwards
    still computes (on a new pool)."""
    a = torch.randn(1 << 20)
    seen = {}

    def work():
        seen["sum"] = (a + a).sum()  # parallel: this thread's pool of workers starts
        seen["with_pool"] = _os_threads()
        seen["released"] = hardware.release_openmp_threads()
        deadline = time.monotonic() + 5
        while _os_threads() >= seen["with_pool"] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after"] = _os_threads()
        seen["again"] = (a + a).sum()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"]
    assert seen["after"] < seen["with_pool"]  # its workers ended
    assert torch.equal(seen["again"], seen["sum"])


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2", "smollm3"])
def test_family_options_in_the_mixed_forwards(family, monkeypatch):
    """The 2026 Llama-like families' layer options (sandwich and post-only norms, (1 + w) norms,
    GeGLU, soft-cap, q/k norms, sliding windows, NoPE layers, fp32 RoPE) through the native
    forwards of continuous batching, prefill chunks included: the tokens of the torch path with
    its own native kernels (the reference the native layer matches by design: with torch's
    kernels alone, AVX2 oneDNN's GEMMs round differently from the native dot products)."""
    from tests.kernels.test_native_decode_families import CONFIGS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.bfloat16).eval()
    model = hf_dsinfer.init_inference(model, dtype=torch.bfloat16)
    _need_rows(model)
    blocks = list(get_report(model).blocks.values())
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.inference_mode():
        native = _generate_batch(model, prompts)
        paths = [dict(b.paths.counts) for b in blocks]
        monkeypatch.setattr(FusedBlock, "_paged_native", lambda *args: None)
        torch_path = _generate_batch(model, prompts)
    assert all(p.get("paged_native", 0) > 0 for p in paths), paths
    if blocks[0]._decode.rows_max >= sum(LENGTHS):  # the layer the calls built
        assert all(p.get("paged_native_mixed", 0) > 0 for p in paths), paths
    assert native == torch_path
