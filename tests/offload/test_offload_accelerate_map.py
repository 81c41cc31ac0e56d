"""A model loaded with an accelerate device_map that offloads some decoder blocks ("disk") plus
plain dsinfer=True (no offload policy): the blocks whose weights accelerate keeps on meta run
the HF forward (accelerate's hooks fill them per submodule), are reported by `explain` and
warned about; the in-memory blocks are fused; tokens equal HF's on the same device_map."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report


def _device_map(num_layers: int) -> dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    for i in range(num_layers):
        device_map[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
    return device_map


def _greedy(model) -> torch.Tensor:
    ids, mask = prompts()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)


def test_accelerate_disk_blocks_keep_hf_forward(llama_dir, tmp_path):
    layers = AutoModelForCausalLM.from_pretrained(llama_dir).config.num_hidden_layers
    device_map = _device_map(layers)
    expected = _greedy(AutoModelForCausalLM.from_pretrained(
        llama_dir, device_map=device_map, offload_folder=str(tmp_path / "hf")))
    with pytest.warns(UserWarning, match="offloaded by accelerate"):
        model = AutoModelForCausalLM.from_pretrained(
            llama_dir, device_map=device_map, offload_folder=str(tmp_path / "ours"),
            dsinfer=True)
    assert torch.equal(_greedy(model), expected)
    counts = hf_dsinfer.fused_call_counts(model)
    report = get_report(model)
    on_disk = [f"model.layers.{i}" for i in range(1, layers, 2)]
    assert sorted(report.skipped) == sorted(on_disk)
    assert all(counts.get(f"model.layers.{i}", 0) > 0 for i in range(0, layers, 2)), counts
    assert all(path not in counts for path in on_disk), counts
    text = hf_dsinfer.explain(model)
    assert "offloaded by accelerate" in text and "dsinfer={'offload'" in text
