"""4-bit offloaded weights as the project's portable Int4Weight (PackedInt4Linear): the decode
step multiplies by the codes, in RAM or as read from disk. Checked against HF eager running on
the same 4-bit weights dequantized to fp32: logits (whole prompt, more rows than the tier's
int4_native_max_rows: dequantized once) and greedy tokens (decode steps of 3 rows: the project's int4 CPU path).
A disk tier written by a process whose torch dispatches avx2 (and without the native kernels,
as on an AVX2-only machine) holds the same bytes and is read back here to the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import CONFIGS, prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.kernels import crossovers
from hf_dsinfer.kernels import quant as Q
from hf_dsinfer.offload import files, get_engine, store
from hf_dsinfer.offload.packed import PackedInt4Linear

GROUP, NEW = 32, 5


def _model() -> torch.nn.Module:
    """Tiny llama whose decoder linears are all packed (in % GROUP == 0)."""
    config = CONFIGS["llama"]()
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _dequantized_reference() -> torch.nn.Module:
    """HF eager with every decoder linear weight replaced by its 4-bit value, by the project's
    reference dequantization: q * scale + min."""
    model = _model()
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            q = Q.quantize_int4(module.weight.detach(), GROUP, portable=True)
            module.weight.data.copy_(Q.dequantize_int4(q, torch.float32))
    return model


@pytest.mark.parametrize("tiers", [(0, 100, 0), (0, 0, 100)], ids=["ram", "disk"])
def test_packed_weights_match_dequantized_hf(tiers, tmp_path):
    ids, mask = prompts()
    wide = torch.randint(3, 100, (1, crossovers.rows().int4_native_max_rows + 8))
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


def test_store_fingerprint_tells_packed_from_flexgen_codes(monkeypatch):
    """A disk tier is reused by its fingerprint: a folder holding 4-bit linears as FlexGen codes
    must not be taken for one holding them packed (the same slots otherwise), or the first load
    finds no `.int4` tensors; nor a folder of format 2 (torch's private int4 layout) for one of
    this format."""
    from hf_dsinfer.offload.policy import OffloadPolicy
    from hf_dsinfer.offload.store import Slot, fingerprint

    policy = OffloadPolicy(weights=(0, 0, 100), compress_weights=True, group_size=64,
                           offload_dir="/tmp/unused")
    codes = [Slot("fc1.weight", (128, 64), torch.bfloat16, "disk", True, False)]
    packed = [Slot("fc1.weight", (128, 64), torch.bfloat16, "disk", True, True)]
    now = fingerprint({}, packed, 2, policy, "src")
    assert fingerprint({}, codes, 2, policy, "src") != now
    assert fingerprint({}, packed, 2, policy, "src") == now
    monkeypatch.setattr(store, "STORE_FORMAT", 2)
    assert fingerprint({}, packed, 2, policy, "src") != now


# Writes a disk tier in a process of its own: argv = checkpoint, policy (JSON)
_WRITE_STORE = """
import json, sys
from transformers import AutoModelForCausalLM
import hf_dsinfer
AutoModelForCausalLM.from_pretrained(sys.argv[1], dsinfer={"offload": json.loads(sys.argv[2])})
"""


def test_store_written_under_avx2_is_read_the_same(tmp_path):
    """torch's int4 layout depends on its dispatch (avx2 / avx512); the store's must not. A
    process with ATEN_CPU_CAPABILITY=avx2 and no native kernels writes the disk tier; this one
    reuses it (same fingerprint, no rewrite), finds the project's portable codes in it, and
    generates the reference tokens from it."""
    checkpoint = tmp_path / "checkpoint"
    _model().save_pretrained(checkpoint)
    policy = {"weights": (0, 0, 100), "cache": (0, 100, 0), "compress_weights": True,
              "group_size": GROUP, "offload_dir": str(tmp_path / "store")}
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "HF_DSINFER_NATIVE": "0"}
    run = subprocess.run([sys.executable, "-c", _WRITE_STORE, str(checkpoint), json.dumps(policy)],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    layer_files = sorted((tmp_path / "store").glob("weights/*/layer_*.safetensors"))
    written = {f: f.stat().st_mtime_ns for f in layer_files}
    assert len(written) == 2

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dsinfer={"offload": policy})
    assert {f: f.stat().st_mtime_ns for f in layer_files} == written  # reused, not rewritten
    weight = AutoModelForCausalLM.from_pretrained(checkpoint).model.layers[1].mlp.down_proj.weight
    want = Q.quantize_int4(weight.detach(), GROUP, portable=True)
    stored = files.SafetensorsFile(layer_files[1])
    for part, tensor in zip(("int4", "scales", "mins"), (want.packed, want.scales, want.mins)):
        assert torch.equal(stored.read(f"mlp.down_proj.weight.{part}"), tensor), part
    stored.close()
    ids, mask = prompts()
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        want = _dequantized_reference().generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                                 do_sample=False)
    assert torch.equal(got, want)
