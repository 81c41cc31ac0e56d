"""Partial rotary in the native decode layer (csrc/cpu_decode.c: hfd_layer.rotary_dim): Phi-3's
partial_rotary_factor (Phi-4-mini: 0.75) rotates only the first rotary_dim dims of each q / k
head, rotate_half within them, and passes the rest through (HF's q_rot / q_pass).

The native steps must compute what the torch path of the same fused block computes (bf16, every
weight format, batch 1 and batched), really run (counted every step, every layer), give the same
bits at every ISA tier, and leave fp32 greedy tokens equal to HF eager's."""

from __future__ import annotations

import pytest
import torch
from switches import switch
from test_native_decode import (
    BATCHED,
    QUANTS,
    VOCAB,
    _close,
    _native_calls,
    _padded_batch,
    _row_calls,
    _step_logits,
)
from transformers import AutoModelForCausalLM, DynamicCache, Phi3Config

import hf_dsinfer
from hf_dsinfer.errors import NativeUnsupported
from hf_dsinfer.injection.native_layer import _check_rotary_dim
from hf_dsinfer.kernels import _native

pytestmark = pytest.mark.skipif(not _native.builds(),
                                reason=f"native kernels unavailable: {_native.why_unavailable()}")

# head_dim 64 (2 query heads over 1 kv head): 0.5 rotates 32 dims (a whole 16-lane half),
# 0.75 rotates 48 (Phi-4-mini's factor: a half of 24, one full and one masked chunk)
FACTORS = {"half": 0.5, "three_quarters": 0.75}
_PHI3 = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _model(factor: float, dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    config = Phi3Config(**_PHI3, partial_rotary_factor=factor)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _blocks(model):
    return [layer.forward for layer in model.model.layers]


def _steps(model, monkeypatch, native: bool):
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    return _step_logits(model, ids, torch.ones(1, 9, dtype=torch.long), native, monkeypatch)


# at the CPU's best tier; the lower tiers' bits equal it: test_same_bits_at_every_isa_tier
@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("factor", list(FACTORS))
def test_partial_rotary_steps_match_the_torch_path(factor, quant, monkeypatch):
    model = hf_dsinfer.init_inference(_model(FACTORS[factor]), dtype=torch.bfloat16,
                                      quant=QUANTS[quant])
    rotary = int(64 * FACTORS[factor])
    torch_path = _steps(model, monkeypatch, native=False)
    assert _native_calls(model) == 0
    native = _steps(model, monkeypatch, native=True)
    assert _native_calls(model) == 4 * len(model.model.layers)  # every step, every layer
    assert all(b._decode.rotary_dim == rotary and b._decode.struct.rotary_dim == rotary
               for b in _blocks(model))
    _close(native, torch_path)


def test_pass_through_dims_are_not_rotated(monkeypatch):
    """The layer's q and k against HF's apply_rotary_pos_emb on the same projections: the
    rotated dims with HF's bf16 roundings, the rest exactly the projection's values."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    model = hf_dsinfer.init_inference(_model(0.75), dtype=torch.bfloat16)
    block = _blocks(model)[0]
    x = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    cos, sin = model.model.rotary_emb(x, torch.tensor([[7]]))
    layer = block.decode_layer(rotary_dim=cos.shape[-1])
    assert layer is not None, block.decode_why
    q, k, _ = layer.attn_in(x, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous())
    q0, k0, _ = layer.attn_in(x, torch.ones(48, dtype=torch.bfloat16),
                              torch.zeros(48, dtype=torch.bfloat16))  # no rotation
    want_q, want_k = apply_rotary_pos_emb(q0, k0, cos, sin)
    assert torch.equal(q[..., 48:], q0[..., 48:]) and torch.equal(k[..., 48:], k0[..., 48:])
    assert not torch.equal(q[..., :48], q0[..., :48])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_same_bits_at_every_isa_tier(monkeypatch):
    """The native steps' logits at each tier this CPU has equal the best tier's to the bit."""
    best = _native.cpu_tier()
    tiers = _native.runnable_tiers()
    model = hf_dsinfer.init_inference(_model(0.75, seed=2), dtype=torch.bfloat16,
                                      quant={"bits": 8})
    got = {}
    for tier in tiers:
        with monkeypatch.context() as m:
            switch(m, isa=tier, amx=False)
            before = _native_calls(model)
            got[tier] = _steps(model, m, native=True)
            assert _native.tier() == tier
            assert _native_calls(model) - before == 4 * len(model.model.layers)
    for tier in tiers:
        assert torch.equal(got[tier], got[best]), tier


@pytest.mark.amx
@BATCHED
@pytest.mark.parametrize("factor", list(FACTORS))
def test_batched_partial_rotary_matches_the_torch_path(factor, monkeypatch):
    """Three sequences, two left-padded: the batched layer's per-row cos / sin of rotary_dim
    values (cs_stride) against the torch path."""
    model = hf_dsinfer.init_inference(_model(FACTORS[factor]), dtype=torch.bfloat16)
    ids, mask = _padded_batch(3, 9)
    before = _row_calls(model)
    torch_path = _step_logits(model, ids, mask, False, monkeypatch)
    native = _step_logits(model, ids, mask, True, monkeypatch)
    assert _row_calls(model) - before == 4 * len(model.model.layers)
    _close(native, torch_path)


@pytest.mark.parametrize("factor", list(FACTORS))
def test_fp32_greedy_tokens_equal_hf_eager(factor):
    """fp32 models take the torch path (the native layer is bf16): tokens equal HF eager's."""
    hf = _model(FACTORS[factor], dtype=torch.float32, seed=4)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
              "disable_compile": True}
    with torch.inference_mode():
        want = hf.generate(ids, **kwargs)
        ref_logits = hf(ids).logits
        model = hf_dsinfer.init_inference(hf, dtype=torch.float32)
        got = model.generate(ids, **kwargs)
        logits = model(ids).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert _native_calls(model) == 0 and all(b.calls > 0 for b in _blocks(model))


def test_rotary_widths_the_kernel_cannot_take_are_refused(monkeypatch):
    """An odd width, or one wider than the head, is refused with the reason; a block given such
    cos / sin builds no layer, takes the torch path, and explain says why."""
    for bad in (0, 31, 66):
        with pytest.raises(NativeUnsupported, match=f"partial rotary over {bad} of 64"):
            _check_rotary_dim(bad, 64)
    _check_rotary_dim(2, 64)
    _check_rotary_dim(64, 64)
    model = hf_dsinfer.init_inference(_model(0.5), dtype=torch.bfloat16)
    block = _blocks(model)[0]
    assert block.decode_layer(rotary_dim=30) is not None  # even: taken
    assert "in all 2 blocks" in hf_dsinfer.explain(model)  # the config's 32 dims: taken
    assert block.decode_layer(rotary_dim=31) is None
    assert "partial rotary over 31 of 64 head dims" in block.decode_why
    block._rotary_dim = 31  # as a call with cos / sin of 31 values leaves it
    assert "partial rotary over 31 of 64 head dims" in hf_dsinfer.explain(model)
    x = torch.randn(1, 1, 128).bfloat16()
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        cos, sin = model.model.rotary_emb(x, torch.tensor([[3]]))
        odd = (cos[..., :31], sin[..., :31])
        named = {"hidden_states": x, "position_embeddings": odd, "past_key_values": cache}
        assert block._decode_step(x, named) is None
