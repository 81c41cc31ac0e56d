"""4-bit offloaded weights in torch's CPU int4 layout (PackedInt4Linear): the decode step
multiplies by the packed codes, in RAM or as read from disk. Checked against HF eager running on
the same 4-bit weights dequantized to fp32: logits (whole prompt, > QUANT_PACK_MAX_ROWS rows:
chunked dequantize) and greedy tokens (decode steps of 3 rows: the packed kernel)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.kernels import quant as Q
from hf_dsinfer.offload import get_engine
from hf_dsinfer.offload.packed import PackedInt4Linear

GROUP, NEW = 32, 5


def _model() -> torch.nn.Module:
    """Tiny llama whose linears all fit the packed layout (out % 64 == 0)."""
    config = CONFIGS["llama"]()
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _dequantized_reference() -> torch.nn.Module:
    """HF eager with every decoder linear weight replaced by its 4-bit value, as the CPU
    kernel computes it: (q - 8) * scale + zero."""
    model = _model()
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            q = Q.quantize_int4(module.weight.detach(), GROUP, torch_layout=True)
            w = Q.dequantize_int4pack_rows(q.cpu_packed, q.cpu_scales_zeros, GROUP,
                                           torch.float32, 0, module.out_features)
            module.weight.data.copy_(w)
    return model


@pytest.mark.parametrize("tiers", [(0, 100, 0), (0, 0, 100)], ids=["ram", "disk"])
def test_packed_weights_match_dequantized_hf(tiers, tmp_path):
    ids, mask = prompts()
    wide = torch.randint(3, 100, (1, Q.QUANT_PACK_MAX_ROWS + 8))
    reference = _dequantized_reference()
    model = hf_dsinfer.init_inference(_model(), offload={
        "weights": tiers, "cache": (0, 100, 0), "compress_weights": True, "group_size": GROUP,
        "micro_batch_size": 2, "num_micro_batches": 2, "offload_dir": str(tmp_path)})
    packed = [m for m in model.model.layers.modules() if isinstance(m, PackedInt4Linear)]
    assert len(packed) == 7 * len(model.model.layers)  # q k v o gate up down
    with torch.no_grad():
        torch.testing.assert_close(model(wide).logits, reference(wide).logits,
                                   atol=1e-4, rtol=1e-4)
        engine = get_engine(model)
        engine.reset_stats()
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                  do_sample=False)
    assert torch.equal(got, want)
    if tiers[2]:  # codes read from disk for every layer, every step
        assert engine.stats["loads"] >= NEW * len(model.model.layers)
    assert all(m.weight_codes is None for m in packed) == bool(tiers[2])  # dropped after use


def test_store_fingerprint_tells_packed_from_flexgen_codes():
    """A disk tier is reused by its fingerprint: a folder holding 4-bit linears as FlexGen codes
    must not be taken for one holding them packed (the same slots otherwise), or the first load
    finds no `.int4` tensors."""
    from hf_dsinfer.offload.policy import OffloadPolicy
    from hf_dsinfer.offload.store import Slot, fingerprint

    policy = OffloadPolicy(weights=(0, 0, 100), compress_weights=True, group_size=64,
                           offload_dir="/tmp/unused")
    codes = [Slot("fc1.weight", (128, 64), torch.bfloat16, "disk", True, False)]
    packed = [Slot("fc1.weight", (128, 64), torch.bfloat16, "disk", True, True)]
    assert fingerprint({}, codes, 2, policy, "src") != fingerprint({}, packed, 2, policy, "src")
    assert fingerprint({}, packed, 2, policy, "src") == fingerprint({}, packed, 2, policy, "src")
