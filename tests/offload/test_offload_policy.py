"""OffloadPolicy / DSInferConfig.offload: validation with fix-it errors, JSON round trip, and the
bad-input errors that must come before any generation (unwritable folder, budget below one
layer, truncated / corrupted / half-written offload files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_models import prompts
from transformers import AutoModelForCausalLM

import hf_dsinfer
from hf_dsinfer.offload import OffloadBudgetError, OffloadFileError, OffloadPolicy

BAD_POLICIES = [  # (fields, words the error must contain)
    ({"weights": (0, 50, 40)}, ["sum to 100", "Fix"]),
    ({"weights": (0, 50)}, ["three non-negative percentages"]),
    ({"cache": {"gpu": 100}}, ["unknown tier", "device"]),
    ({"weights": (0, 50, 50)}, ["offload_dir", "Fix"]),
    ({"activations": (0, 0, 100)}, ["activations on disk are not supported"]),
    ({"activations": (50, 50, 0)}, ["whole on one memory tier"]),
    ({"micro_batch_size": 0}, ["positive int"]),
    ({"group_size": 63}, ["even int"]),
    ({"memory": "lots"}, ["'2.5GiB'"]),
    ({"overlap": "yes"}, ["True or False"]),
    ({"wieghts": (0, 100, 0)}, ["Did you mean 'weights'"]),
]


@pytest.mark.parametrize(("fields", "words"), BAD_POLICIES)
def test_bad_policy_fails_at_construction(fields, words):
    with pytest.raises(hf_dsinfer.DSInferConfigError) as err:
        hf_dsinfer.DSInferConfig(offload=fields)
    for word in words:
        assert word in str(err.value)


def test_config_round_trip_and_clashes(tmp_path):
    cfg = hf_dsinfer.DSInferConfig(offload={
        "weights": [10, 40, 50], "cache": {"cpu": 25, "disk": 75}, "memory": "1.5GiB",
        "offload_dir": str(tmp_path), "compress_weights": True, "micro_batch_size": 4,
        "num_micro_batches": 2})
    assert cfg.offload.weights == (10.0, 40.0, 50.0) and cfg.offload.cache == (0.0, 25.0, 75.0)
    assert cfg.offload.memory == int(1.5 * 2**30) and cfg.offload.block_size == 8
    assert hf_dsinfer.DSInferConfig.from_json(cfg.to_json()) == cfg
    assert hf_dsinfer.DSInferConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert OffloadPolicy.coerce(cfg.offload.to_dict()) == cfg.offload
    for clash in ({"quant": {"bits": 8}}, {"compile": True}, {"cache": "static"}):
        with pytest.raises(hf_dsinfer.DSInferConfigError, match="cannot be combined"):
            hf_dsinfer.DSInferConfig(offload={}, **clash)


def test_unwritable_offload_dir(llama_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    policy = {"weights": (0, 0, 100), "offload_dir": str(blocker / "offload")}
    with pytest.raises(OffloadFileError, match="not writable.*Fix"):
        AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"offload": policy})


def test_budget_smaller_than_one_layer(llama_dir, tmp_path):
    policy = {"weights": (0, 0, 100), "offload_dir": str(tmp_path), "memory": "64KiB"}
    with pytest.raises(OffloadBudgetError, match="budget is 64.00 KiB.*Fix"):
        AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"offload": policy})
    assert not (tmp_path / "weights").exists(), "nothing may be written before the budget check"


def test_generate_time_budget(llama_dir, tmp_path):
    # the weights fit, a KV cache of 3 x 4096 tokens does not: refused before the first token
    policy = {"weights": (0, 100, 0), "memory": "48MiB", "micro_batch_size": 3}
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"offload": policy})
    ids, mask = prompts()
    with pytest.raises(OffloadBudgetError, match="kv cache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4096, do_sample=False)


def _layer_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("weights/*/layer_*.safetensors"))


def _reload(path: str, policy: dict):
    return AutoModelForCausalLM.from_pretrained(path, dsinfer={"offload": policy})


def _corrupt(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside the last tensor's data
    file.write_bytes(bytes(data))


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size - 100)


@pytest.mark.parametrize(("damage", "words"), [(_corrupt, "CRC-32"), (_truncate, "truncated")])
def test_damaged_offload_file_is_refused(llama_dir, tmp_path, damage, words):
    policy = {"weights": (0, 30, 70), "offload_dir": str(tmp_path)}
    _reload(llama_dir, policy)  # writes the disk tier once
    files = _layer_files(tmp_path)
    assert len(files) == 2
    damage(files[1])
    with pytest.raises(OffloadFileError, match=f"{words}.*refused before generation.*Fix"):
        _reload(llama_dir, policy)


def test_half_written_folder_is_rewritten_not_trusted(llama_dir, tmp_path):
    policy = {"weights": (0, 30, 70), "offload_dir": str(tmp_path)}
    ids, mask = prompts()
    expected = _reload(llama_dir, policy).generate(ids, attention_mask=mask, max_new_tokens=5,
                                                      do_sample=False)
    folder = _layer_files(tmp_path)[0].parent
    (folder / "manifest.json").unlink()  # as if the writer died before its last step
    _corrupt(_layer_files(tmp_path)[0])
    again = _reload(llama_dir, policy)
    assert (folder / "manifest.json").exists()
    got = again.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)
