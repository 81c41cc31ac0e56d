"""MoE ops: gating, the token->expert table, and the grouped expert MLP against transformers'
own Mixtral / Qwen2-MoE / OLMoE sparse-MoE blocks, plus every backend against the reference."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from hf_dsinfer.kernels import _native, moe
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, requires_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GATING = ((True, False), (True, True), (False, False))  # (softmax_first, renormalize)
# 7 tokens, hidden 80, intermediate 48, 3 experts, top-2; and 5 experts top-3.
MLP_SHAPES = ((7, 80, 48, 3, 2), (5, 32, 40, 5, 3))


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_block(name: str):
    common = {"hidden_size": 80, "num_experts_per_tok": 2, "hidden_act": "silu"}
    if name == "mixtral":
        cfg = MixtralConfig(intermediate_size=48, num_local_experts=3, **common)
        return MixtralSparseMoeBlock(cfg), {"softmax_first": True, "renormalize": True}, True
    if name == "olmoe":
        cfg = OlmoeConfig(intermediate_size=48, num_experts=4, norm_topk_prob=False, **common)
        return OlmoeSparseMoeBlock(cfg), {"softmax_first": True, "renormalize": False}, False
    cfg = Qwen2MoeConfig(moe_intermediate_size=48, num_experts=3, norm_topk_prob=True,
                         shared_expert_intermediate_size=64, **common)
    return Qwen2MoeSparseMoeBlock(cfg), {"softmax_first": True, "renormalize": True}, False


def _our_block(block, hidden: torch.Tensor, gating: dict, fp32_weights: bool, backend: str):
    """The block's forward written with our ops (router weights read from the HF module)."""
    x = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
    logits = F.linear(x, block.gate.weight)  # [T, E]
    weights, ids = moe.topk_gating(logits, block.gate.top_k, backend=backend, **gating)
    weights = weights if fp32_weights else weights.to(logits.dtype)  # Qwen2-MoE / OLMoE cast
    ex = block.experts
    out = moe.grouped_expert_mlp(x, ex.gate_up_proj, ex.down_proj, weights, ids, "silu",
                                 backend=backend)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: sigmoid-gated shared expert, HF modules
        out = out + F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out.reshape(hidden.shape)


@pytest.mark.parametrize("name", ("mixtral", "qwen2_moe", "olmoe"))
@pytest.mark.parametrize("backend", ("ref", "cpu", "triton"))
def test_matches_hf_moe_block_fp32(triton_interpret, name, backend):
    torch.manual_seed(0)
    block, gating, fp32_weights = _hf_block(name)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        hidden = torch.randn(2, 7, 80)
        expected = block(hidden)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = _our_block(block, hidden, gating, fp32_weights, backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softmax_first,renormalize", GATING)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", (2, 3))
def test_topk_gating_triton_matches_ref(triton_interpret, softmax_first, renormalize, dtype,
                                        top_k):
    logits = torch.randn(7, 5, generator=_gen()).to(dtype)
    w, ids = moe.topk_gating(logits, top_k, softmax_first=softmax_first,
                             renormalize=renormalize, backend="triton")
    w_ref, ids_ref = moe.topk_gating_ref(logits, top_k, softmax_first, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ids_ref)
    assert_close_tol(w, w_ref)


def test_topk_gating_orders():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = moe.topk_gating(logits, 2, softmax_first=True, renormalize=False, backend="ref")
    assert ids.tolist() == [[1, 2]] and w.sum() < 1  # top-2 of the softmax over 4
    w_n, _ = moe.topk_gating(logits, 2, softmax_first=True, renormalize=True, backend="ref")
    w_after, _ = moe.topk_gating(logits, 2, softmax_first=False, backend="ref")
    torch.testing.assert_close(w_n, w_after)  # both equal softmax over the selected two
    torch.testing.assert_close(w_n.sum(), torch.tensor(1.0))


def test_moe_align_table():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    align = moe.moe_align(ids, num_experts=4)
    assert align.expert_offsets.tolist() == [0, 3, 5, 8, 8]
    assert align.token_idx.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert torch.equal(ids.reshape(-1)[align.flat_idx], torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]))


def _mlp_inputs(t, h, inter, n_exp, k, dtype):
    g = _gen(1)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    gate_up = (torch.randn(n_exp, 2 * inter, h, generator=g) * 0.2).to(dtype)
    down = (torch.randn(n_exp, h, inter, generator=g) * 0.2).to(dtype)
    weights, ids = moe.topk_gating_ref(torch.randn(t, n_exp, generator=g), k, True, True)
    return hidden, gate_up, down, weights, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MLP_SHAPES)
@pytest.mark.parametrize("backend", ("cpu", "triton"))
def test_grouped_expert_mlp_matches_ref(triton_interpret, dtype, shape, backend):
    args = _mlp_inputs(*shape, dtype)
    out = moe.grouped_expert_mlp(*args, "silu", backend=backend)
    ref = moe.grouped_expert_mlp_ref(*args, "silu")
    if dtype == torch.float32:
        assert_close_tol(out, ref, dtype, REDUCTION_TOL)
        return
    # Two GEMMs with an intermediate rounded to 8 (11) mantissa bits: a one-ulp difference in
    # the intermediate, from a different summation order, reaches the output through I terms,
    # so in bf16 / fp16 compare accuracy instead: error vs fp32 no worse than twice the ref's.
    exact = moe.grouped_expert_mlp_ref(*(a.float() for a in args[:4]), args[4], "silu")
    err, err_ref = ((t.float() - exact).abs().max().item() for t in (out, ref))
    bound = 2 * err_ref + REDUCTION_TOL[dtype][0]
    if backend == "triton" and dtype == torch.bfloat16:
        # Triton 3.9's interpreter casts fp32 -> bf16 by truncation (measured: up to 1 ulp off
        # torch's round-to-nearest), which biases the kernel's 4 chained roundings toward zero
        # (~2% here); on a GPU the cast rounds to nearest. Allow 4 ulps of bias on top.
        bound += 4 * 2**-8 * exact.abs().max().item()
    assert out.dtype == dtype and err <= bound, (err, err_ref)


@requires_triton()
@pytest.mark.parametrize("act", ("gelu", "gelu_pytorch_tanh", "relu", "relu2"))
def test_grouped_expert_mlp_triton_activations(triton_interpret, act):
    args = _mlp_inputs(7, 80, 48, 3, 2, torch.float32)
    out = moe.grouped_expert_mlp(*args, act, backend="triton")
    assert_close_tol(out, moe.grouped_expert_mlp_ref(*args, act), table=REDUCTION_TOL)


def test_cpu_path_is_two_grouped_gemms():
    """No Python loop over experts: one grouped GEMM per projection, whatever E is."""
    hidden, gate_up, down, weights, ids = _mlp_inputs(5, 32, 40, 6, 2, torch.float32)
    with mock.patch.object(F, "grouped_mm", wraps=F.grouped_mm) as gmm, \
            mock.patch.object(moe, "_expert_mlp", wraps=moe._expert_mlp) as expert_mlp:
        out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    assert gmm.call_count == 2 and expert_mlp.call_count == 0
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)


def test_cpu_fallback_runs_only_experts_with_tokens(monkeypatch):
    hidden, gate_up, down, _, _ = _mlp_inputs(4, 32, 40, 6, 2, torch.float32)
    ids = torch.tensor([[0, 4], [4, 0], [0, 4], [4, 0]])  # experts 1, 2, 3, 5 unused
    weights = torch.full((4, 2), 0.5)
    monkeypatch.delattr(F, "grouped_mm")  # torch without a grouped GEMM
    with mock.patch.object(moe, "_expert_mlp", wraps=moe._expert_mlp) as expert_mlp:
        out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    assert expert_mlp.call_count == 2
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)


@pytest.mark.parametrize("tokens", (8, 96))
def test_cpu_path_picks_grouped_gemm_or_per_expert_gemms_by_rows(tokens):
    """Few rows per expert: one grouped GEMM pair. Many (>= 32 per active expert): one oneDNN
    GEMM pair per active expert, which is faster there. Same result either way."""
    hidden, gate_up, down, weights, ids = _mlp_inputs(tokens, 32, 48, 4, 2, torch.float32)
    with mock.patch.object(moe, "_expert_mlp", wraps=moe._expert_mlp) as expert_mlp:
        out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    looped = expert_mlp.call_count
    assert looped == (0 if tokens == 8 else 4)
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)


@pytest.mark.skipif(not moe._onednn_bf16(), reason="oneDNN bf16 not available on this CPU")
def test_bf16_many_rows_fuse_activation_into_onednn_gemms(monkeypatch):
    """bf16 experts with many rows: silu(gate) * up in the oneDNN GEMM epilogues, once per
    active expert, close to HF's op sequence (one bf16 rounding fewer)."""
    from hf_dsinfer.kernels import linear as lin

    monkeypatch.setattr(lin, "fp32_gemm_tier", lambda: False)  # a tier with bf16 dot products
    monkeypatch.setattr(lin, "native_bf16_takes", lambda *a: False)  # rows past its kernels
    hidden, gate_up, down, weights, ids = _mlp_inputs(96, 32, 48, 4, 2, torch.bfloat16)
    picked, original = [], moe._onednn_gated
    monkeypatch.setattr(moe, "_onednn_gated", lambda *a: picked.append(original(*a)) or picked[-1])
    out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    assert picked == [True] * 4
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)
    assert picked == [True] * 4  # the reference keeps HF's own ops


def test_bf16_many_rows_per_expert_in_fp32_gemms_without_bf16_dots(monkeypatch):
    """At a tier without bf16 dot products (kernels/linear.py: bf16_gemm_in_fp32), an expert's
    many bf16 rows go through fp32 GEMMs (two per active expert), rounded as HF's F.linear
    rounds them; not through oneDNN's bf16 GEMMs, fused or not."""
    from hf_dsinfer.kernels import linear as lin

    monkeypatch.setattr(lin, "fp32_gemm_tier", lambda: True)
    monkeypatch.setattr(lin, "fp32_gemm_calls", 0)
    monkeypatch.setattr(moe, "_native_moe_lib", lambda *a: None)  # (AMX would take any rows)
    # (nor the tier's native bf16 GEMV / panel kernels, which take up to 512 rows on avx2)
    monkeypatch.setattr(lin, "_native_gemv_lib", lambda *a: None)
    monkeypatch.setattr(lin, "_native_gemm_lib", lambda *a: None)
    monkeypatch.setattr(lin, "_native_amx_lib", lambda *a: None)  # (nor the AMX linear)
    hidden, gate_up, down, weights, ids = _mlp_inputs(96, 32, 48, 4, 2, torch.bfloat16)
    picked = []
    monkeypatch.setattr(moe, "_onednn_gated", lambda *a: picked.append(a) or False)
    out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    assert lin.fp32_gemm_calls == 2 * 4 and picked == []
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)


def test_bf16_few_rows_per_expert_run_the_tiers_native_linears(monkeypatch):
    """At a tier whose native bf16 GEMV / panel kernels run (all but amx), few bf16 rows per
    expert go expert by expert through them (kernels/linear.py: linear_cpu), not through the
    grouped GEMMs, which were several times slower there (moe._native_bf16_linears)."""
    from hf_dsinfer.kernels import crossovers
    from hf_dsinfer.kernels import linear as lin

    if crossovers.rows().bf16_gemm_max_rows is None or _native.lib("bf16_gemv") is None:
        pytest.skip(f"no native bf16 GEMV / panel at the {_native.tier()} tier here")
    monkeypatch.setattr(moe, "_native_moe_lib", lambda *a: None)  # (AMX's kernel: any rows)
    hidden, gate_up, down, weights, ids = _mlp_inputs(8, 32, 64, 4, 2, torch.bfloat16)
    active = len(ids.unique())
    with mock.patch.object(F, "grouped_mm", wraps=F.grouped_mm) as gmm, \
            mock.patch.object(lin, "_native_bf16", wraps=lin._native_bf16) as native:
        out = moe.grouped_expert_mlp(hidden, gate_up, down, weights, ids, backend="cpu")
    assert gmm.call_count == 0 and native.call_count == 2 * active
    assert_close_tol(out, moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids),
                     table=REDUCTION_TOL)


def test_reference_keeps_hfs_ops(monkeypatch):
    """The references (HF's experts loop, and its rows form) run F.linear, never the kernels the fast paths use
    (native bf16 linears, fp32 GEMMs): a test against it then checks those kernels."""
    from hf_dsinfer.kernels import linear as lin

    monkeypatch.setattr(lin, "fp32_gemm_tier", lambda: True)
    monkeypatch.setattr(lin, "fp32_gemm_calls", 0)
    hidden, gate_up, down, weights, ids = _mlp_inputs(96, 32, 64, 4, 2, torch.bfloat16)
    align = moe.moe_align(ids, gate_up.shape[0])
    with mock.patch.object(lin, "linear_cpu", wraps=lin.linear_cpu) as fast:
        moe.grouped_expert_mlp_ref(hidden, gate_up, down, weights, ids)
        moe.grouped_expert_rows_ref(hidden[align.token_idx], gate_up, down, align.expert_offsets)
    assert fast.call_count == 0 and lin.fp32_gemm_calls == 0


def test_moe_align_sentinel_rows_sort_last():
    ids = torch.tensor([[2, 4], [4, 1]])  # 4 = E: dropped slots
    align = moe.moe_align(ids, num_experts=4)
    assert align.expert_offsets.tolist() == [0, 0, 1, 2, 2]
    assert align.flat_idx.tolist()[:2] == [3, 0] and sorted(align.flat_idx.tolist()[2:]) == [1, 2]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("backend", ("ref", "cpu", "triton"))
def test_grouped_expert_rows_with_dropped_rows(triton_interpret, dtype, backend):
    """Rows of dropped slots come back as zeros; kept rows equal the per-expert MLP."""
    hidden, gate_up, down, weights, ids = _mlp_inputs(6, 32, 40, 5, 2, dtype)
    ids = ids.clone()
    ids[1, 0] = ids[4, 1] = 5  # two dropped slots
    align = moe.moe_align(ids, 5)
    x = hidden[align.token_idx]
    y = moe.grouped_expert_rows(x, gate_up, down, align.expert_offsets, backend=backend)
    kept = int(align.expert_offsets[-1])
    assert kept == 10 and torch.equal(y[kept:], torch.zeros_like(y[kept:]))
    expert = ids.reshape(-1)[align.flat_idx]
    exact = torch.stack([moe._expert_mlp(x[r:r + 1].float(), gate_up[expert[r]].float(),
                                         down[expert[r]].float(), "silu")[0]
                         for r in range(kept)])
    assert_close_tol(y[:kept], exact.to(dtype), dtype, REDUCTION_TOL)
    combined = moe.combine_expert_rows(y, weights.masked_fill(ids == 5, 0.0), align)
    assert combined.shape == hidden.shape and torch.isfinite(combined).all()


def test_cpu_entry_points_trace_fullgraph_with_dropped_rows():
    """Under torch.compile(fullgraph=True) the CPU entry points read no offsets on the host
    (kernels.moe.traced_expert_rows) and give the eager results, dropped ids included."""
    torch.manual_seed(0)
    t, h, e, i, k = 9, 32, 4, 24, 2
    x = torch.randn(t, h)
    gate_up, down = torch.randn(e, 2 * i, h) * 0.2, torch.randn(e, h, i) * 0.2
    ids = torch.randint(0, e, (t, k))
    ids[0, 1] = e  # dropped (over capacity): never computed
    weights = torch.rand(t, k)
    align = moe.moe_align(ids, e)
    rows = x.index_select(0, align.token_idx)
    torch._dynamo.reset()
    traced_rows = torch.compile(moe.grouped_expert_rows_cpu, fullgraph=True)
    traced_mlp = torch.compile(moe.grouped_expert_mlp_cpu, fullgraph=True)
    torch.testing.assert_close(traced_rows(rows, gate_up, down, align.expert_offsets),
                               moe.grouped_expert_rows_cpu(rows, gate_up, down,
                                                           align.expert_offsets))
    torch.testing.assert_close(traced_mlp(x, gate_up, down, weights, ids),
                               moe.grouped_expert_mlp_cpu(x, gate_up, down, weights, ids))
