"""The native bf16 expert-MLP kernel (csrc/cpu_moe.c via kernels/moe.py).

It must round where HF's expert ops round (each GEMM, silu, the product, the routing weight), so
it lands within the bf16 reference's own distance of a float64 computation, and the CPU entry
points must really call it (counted): for any number of rows per expert on AMX, for about one
row per expert on AVX-512, and not for other dtypes or activations.
"""

from __future__ import annotations

import pytest
import torch
from switches import switch

from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import moe as M
from tests.kernels.conftest import count_calls

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]


def _count(monkeypatch):
    return count_calls(monkeypatch, M, "_native_moe_rows")


def _experts(num_experts, hidden, inter, tokens, top_k, seed=0, drop=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).bfloat16()
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    if drop:  # an id >= E marks a dropped slot (capacity factor, or an expert on another rank)
        ids.view(-1)[:drop] = num_experts
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    return x, gate_up, down, ids, weights


def _check_against_float64(out, xs, gate_up, down, offsets):
    """out within 1.5x the bf16 reference's own distance of float64; returns the reference."""
    ref = M.grouped_expert_rows_ref(xs, gate_up, down, offsets)
    exact = M.grouped_expert_rows_ref(xs.double(), gate_up.double(), down.double(), offsets)
    err, ref_err = ((out.double() - exact).abs().max().item(),
                    (ref.double() - exact).abs().max().item())
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)
    return ref


# (experts, hidden, intermediate, tokens, top_k): 40, 56, 70, 33 exercise the masked column tail
# of the 32-wide loop; 9 tokens x top-2 over 3 experts gives more rows per expert than one
# 4-row register tile; 20 rows per expert take two 16-row AMX panels; the last is the
# benchmark's shape at 16 tokens.
SHAPES = [(8, 64, 96, 5, 2), (4, 40, 56, 3, 1), (3, 33, 70, 9, 2), (8, 128, 64, 1, 2),
          (2, 64, 96, 20, 2), (8, 1024, 3584, 16, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("drop", (0, 2))
@pytest.mark.parametrize("amx", ("1", "0"), ids=("amx-if-present", "avx512"))
def test_native_expert_rows_match_reference(monkeypatch, shape, drop, amx):
    """Any number of rows per expert (the dispatcher sends it a few, the kernel takes all), on
    AMX tiles where the CPU has them and the sizes are multiples of 32, and on AVX-512."""
    switch(monkeypatch, amx=amx != "0")
    x, gate_up, down, ids, _ = _experts(*shape, drop=drop)
    align = M.moe_align(ids, gate_up.shape[0])
    xs = x.index_select(0, align.token_idx)
    kept = int(align.expert_offsets[-1])
    out = M._native_moe_rows(_native.lib(), xs, gate_up, down, align.expert_offsets, kept)
    ref = _check_against_float64(out, xs, gate_up, down, align.expert_offsets)
    assert torch.all(out[kept:] == 0)  # dropped rows come back as zeros
    # small shapes sum few enough terms that fp32 sums in any order round to the same bf16
    if shape[1] * shape[2] <= 64 * 96:
        assert torch.equal(out, ref)


def _one_row_per_expert(num_experts=8, hidden=64, inter=96, tokens=4, top_k=2):
    """Decode-like routing: each token's experts distinct from the other tokens'."""
    x, gate_up, down, _, weights = _experts(num_experts, hidden, inter, tokens, top_k, seed=3)
    ids = torch.arange(tokens * top_k).view(tokens, top_k) % num_experts
    return x, gate_up, down, ids, weights


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (4, 2), (3, 1)])
def test_native_runs_for_decode_routing(monkeypatch, tokens, top_k):
    x, gate_up, down, ids, weights = _one_row_per_expert(tokens=tokens, top_k=top_k)
    calls = _count(monkeypatch)
    out = M.grouped_expert_mlp(x, gate_up, down, weights, ids, "silu", backend="cpu")
    ref = M.grouped_expert_mlp_ref(x, gate_up, down, weights, ids, "silu")
    assert calls == [1]
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    align = M.moe_align(ids, gate_up.shape[0])
    xs = x.index_select(0, align.token_idx)
    rows = M.grouped_expert_rows(xs, gate_up, down, align.expert_offsets, "silu", backend="cpu")
    assert calls == [1, 1]
    assert torch.equal(rows, M.grouped_expert_rows_ref(xs, gate_up, down, align.expert_offsets))


def test_native_not_used_for_fp32_or_other_activations(monkeypatch):
    calls = _count(monkeypatch)
    x, gate_up, down, ids, weights = _one_row_per_expert()
    M.grouped_expert_mlp(x.float(), gate_up.float(), down.float(), weights, ids, "silu",
                         backend="cpu")
    M.grouped_expert_mlp(x, gate_up, down, weights, ids, "gelu", backend="cpu")
    assert calls == []


def _many_rows(num_experts, hidden, inter, rows_per_expert, seed=5):
    """Every token routed to experts (t, t + 1) mod E: rows_per_expert * E / 2 tokens."""
    tokens = rows_per_expert * num_experts // 2
    x, gate_up, down, _, weights = _experts(num_experts, hidden, inter, tokens, 2, seed=seed)
    t = torch.arange(tokens)
    ids = torch.stack([t % num_experts, (t + 1) % num_experts], dim=1)
    return x, gate_up, down, ids, weights


@pytest.mark.amx
@pytest.mark.skipif(not _native.amx_available(), reason="the CPU or kernel grants no AMX tiles")
@pytest.mark.parametrize("weights_dtype", (torch.float32, torch.bfloat16),
                         ids=("fp32 weights (Mixtral)", "bf16 weights (Qwen-MoE, OLMoE)"))
def test_amx_kernel_takes_many_rows_and_weights_them(monkeypatch, weights_dtype):
    """Prefill-sized routing (75 rows per expert, not a multiple of 16: an odd panel count and a
    partial last panel) runs the AMX kernel, which also multiplies each row by its routing
    weight as it writes it: the combined output equals HF's experts loop bit for bit on a shape
    small enough that any fp32 summation order rounds to the same bf16."""
    calls = _count(monkeypatch)
    x, gate_up, down, ids, weights = _many_rows(4, 64, 96, 75)
    weights = weights.to(weights_dtype)
    out = M.grouped_expert_mlp(x, gate_up, down, weights, ids, "silu", backend="cpu")
    ref = M.grouped_expert_mlp_ref(x, gate_up, down, weights, ids, "silu")
    assert calls == [1]
    assert torch.equal(out, ref)


@pytest.mark.amx
@pytest.mark.skipif(not _native.amx_available(), reason="the CPU or kernel grants no AMX tiles")
@pytest.mark.parametrize("threads", (1, 2))
def test_amx_kernel_over_several_panel_groups(monkeypatch, threads):
    """Phase 2's packed rows (37 panels x 1024 columns) exceed one L2 group (32 panels at this
    K), so the kernel walks two groups, the second with an odd number of panels, and the next
    task's prefetch crosses from one group to the next; one and two threads split the tasks
    differently. Checked against float64 like the other shapes."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x, gate_up, down, ids, _ = _many_rows(2, 256, 1024, 590)
    align = M.moe_align(ids, 2)
    xs = x.index_select(0, align.token_idx)
    kept = int(align.expert_offsets[-1])
    out = M._native_moe_rows(_native.lib(), xs, gate_up, down, align.expert_offsets, kept)
    _check_against_float64(out, xs, gate_up, down, align.expert_offsets)


def test_avx512_path_takes_only_about_one_row_per_expert(monkeypatch):
    """Without AMX tiles the dot products bound the kernel from 2 rows per expert on."""
    switch(monkeypatch, amx=False)
    calls = _count(monkeypatch)
    x, gate_up, down, _, weights = _one_row_per_expert(tokens=4)
    M.grouped_expert_mlp(x, gate_up, down, weights, torch.tensor([[0, 1]] * 4), "silu",
                         backend="cpu")
    assert calls == []
    x, gate_up, down, ids, weights = _one_row_per_expert(tokens=4)
    out = M.grouped_expert_mlp(x, gate_up, down, weights, ids, "silu", backend="cpu")
    assert calls == [1]
    # the routing weights are applied as the rows are written, as on AMX
    assert torch.equal(out, M.grouped_expert_mlp_ref(x, gate_up, down, weights, ids, "silu"))


def test_native_moe_can_be_switched_off(monkeypatch):
    switch(monkeypatch, native=False)
    calls = _count(monkeypatch)
    x, gate_up, down, ids, weights = _one_row_per_expert()
    out = M.grouped_expert_mlp(x, gate_up, down, weights, ids, "silu", backend="cpu")
    ref = M.grouped_expert_mlp_ref(x, gate_up, down, weights, ids, "silu")
    assert calls == [] and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_native_moe_under_inference_mode(monkeypatch):
    calls = _count(monkeypatch)
    x, gate_up, down, ids, weights = _one_row_per_expert()
    with torch.inference_mode():
        out = M.grouped_expert_mlp(x, gate_up, down, weights, ids, "silu", backend="cpu")
    ref = M.grouped_expert_mlp_ref(x, gate_up, down, weights, ids, "silu")
    assert calls == [1] and torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
