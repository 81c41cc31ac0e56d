"""Cost model + LP search: the chosen policy fits its budget (by the runtime's own footprint),
uses memory where it pays, runs, and `hf-dsinfer plan` prints it."""

from __future__ import annotations

import json

import pytest
import torch
from switches import switch
from tiny_models import prompts

import hf_dsinfer
from hf_dsinfer.cli import main
from hf_dsinfer.offload import cost
from hf_dsinfer.offload.cost import Hardware, Workload, predict
from hf_dsinfer.offload.memory import footprint
from hf_dsinfer.offload.search import measure_prefill_layer, model_shape, search

# A fixed machine (no measuring in the unit test): CPU compute, slow disk.
HW = Hardware(device="cpu", flops=2e11, memory_bw=2e10, disk_read=1.5e9, disk_write=1e9,
              h2d=float("inf"), decompress=2e9, int4_mm=5e10, kv_decompress=2e9,
              attn_decode=1e10)
WORK = Workload(prompt_len=64, gen_len=8)


def test_search_fits_budget_and_prefers_memory(llama_dir, tmp_path):
    shape = model_shape(llama_dir, torch.float32)
    budgets = (shape.layer_numel * 4 * 3 + (64 << 20), 1 << 30)
    best = []
    for budget in budgets:
        found = search(shape, HW, WORK, budget, str(tmp_path), compress="off", max_block=8)
        assert found, budget
        for cand in found:
            fp = footprint(shape, cand.policy, False, cand.policy.block_size, 64, 8)
            assert fp.host_total <= budget
            assert abs(cand.prediction.throughput
                       - predict(shape, HW, cand.policy, WORK).throughput) < 1e-9
        best.append(found[0])
    tight, roomy = best
    assert roomy.policy.weights[2] == 0  # with room, no weight is read from disk
    assert roomy.prediction.throughput >= tight.prediction.throughput
    # the chosen policy runs, and gives HF's tokens
    ids, mask = prompts()
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(llama_dir)
    expected = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(
        llama_dir, dsinfer={"offload": tight.policy.to_dict()})
    got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)
    assert hf_dsinfer.offload.get_engine(model) is not None


def test_plan_cli(llama_dir, tmp_path, capsys, monkeypatch):

    switch(monkeypatch, cache_dir=tmp_path)  # cost.cache_file() is tmp_path / "hardware.json"
    code = main(["plan", "--model", llama_dir, "--prompt-len", "32", "--gen-len", "4",
                 "--memory", "256MiB", "--offload-dir", str(tmp_path), "--probe-mib", "8",
                 "--dtype", "float32", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "measured cpu: matmul" in out and "chosen policy" in out and "tok/s" in out
    assert "measured prefill of one decoder layer, one sequence of 32 tokens" in out
    # the candidates table tells policies apart that differ only in overlap or KV packing
    assert "| 4-bit | overlap |" in out


@pytest.mark.parametrize("name", ["llama_dir", "opt_dir", "gpt2_dir"])
def test_prefill_layer_probe_times_the_models_own_layer(name, request, monkeypatch):
    """The probe builds a one-layer copy of the model, injected as the engine runs it, and times
    that layer alone (hooks on it): one warm-up and `reps` calls of the fused block. It leaves the
    caller's random state as it was."""
    from hf_dsinfer.injection.fused import FusedBlock

    calls = []
    original = FusedBlock.__call__

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("hidden_states", args[0] if args else None).shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedBlock, "__call__", counted)
    path = request.getfixturevalue(name)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    seconds = measure_prefill_layer(path, torch.float32, "cpu", 24, reps=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert 0 < seconds < 5
    assert len(calls) == 3 and all(tuple(c)[:2] == (1, 24) for c in calls)


def test_measured_prefill_layer_prices_the_prefill(llama_dir, tmp_path):
    """With the layer's prefill measured, the prefill's compute is that time per sequence and
    layer (here far above the FLOP price, so it decides the prefill); decode is unchanged."""
    shape = model_shape(llama_dir, torch.float32)
    found = search(shape, HW, WORK, 1 << 30, str(tmp_path), compress="off", max_block=8)
    policy = found[0].policy
    plain = predict(shape, HW, policy, WORK)
    measured = predict(shape, HW, policy, Workload(64, 8, prefill_layer_s=0.5))
    head = cost.head_seconds(shape, HW, policy.block_size)
    assert abs(measured.prefill_s - (shape.num_layers * policy.block_size * 0.5 + head)) < 1e-9
    assert measured.prefill_s > plain.prefill_s and measured.decode_s == plain.decode_s


def test_hardware_probe_is_cached_per_machine(tmp_path, monkeypatch):
    """A second measure_hardware(cache=True) for the same machine/folder/dtype reuses the first
    result; cache=False measures again."""
    from hf_dsinfer.offload import cost

    calls = []
    switch(monkeypatch, cache_dir=tmp_path)  # cost.cache_file() is tmp_path / "hardware.json"
    monkeypatch.setattr(cost, "measure_disk",
                        lambda folder, mib, old=None: calls.append(mib) or (2e9, 1e9))
    for name in ("measure_flops", "measure_decompress", "measure_int4_mm",
                 "measure_kv_decompress", "measure_attn_decode", "measure_attn_int4"):
        monkeypatch.setattr(cost, name, lambda dtype, dev: 1e9)
    monkeypatch.setattr(cost, "read_bandwidth", lambda dev, gib: 10.0)
    first = cost.measure_hardware(tmp_path, torch.bfloat16, "cpu", 64, cache=True)
    assert cost.measure_hardware(tmp_path, torch.bfloat16, "cpu", 64, cache=True) == first
    assert calls == [64]
    cost.measure_hardware(tmp_path, torch.bfloat16, "cpu", 64, cache=False)
    assert calls == [64, 64]
    assert first.disk_read == 2e9 and first.memory_bw == 1e10
    # an entry written before a constant existed is re-measured, not filled with a default
    data = json.loads(cost.cache_file().read_text())
    for entry in data.values():
        entry.pop("int4_mm")
    cost.cache_file().write_text(json.dumps(data))
    assert cost.measure_hardware(tmp_path, torch.bfloat16, "cpu", 64, cache=True) == first
    assert calls == [64, 64, 64]
    # a probe that reads a checkpoint's old data is keyed apart from one that reads its own file
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"\0" * (64 << 20))
    cost.measure_hardware(tmp_path, torch.bfloat16, "cpu", 64, cache=True, sample=checkpoint)
    assert calls == [64, 64, 64, 64]


def test_disk_probe_reads_old_data_when_given(tmp_path, monkeypatch):
    """Given a checkpoint on the same disk, the read probe reads disjoint windows of its files
    (largest first), not the file it has just written; the checkpoint is left as it was. No
    file of a whole window: no old data, the probe reads its own file back."""
    from hf_dsinfer.offload import cost

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    big, small = checkpoint / "model-00000.safetensors", checkpoint / "model-00001.safetensors"
    big.write_bytes(bytes(range(256)) * (12 << 12))  # 12 MiB: three 4 MiB windows
    small.write_bytes(b"\1" * (5 << 20))  # one window
    windows = [(big, 0), (big, 4 << 20), (big, 8 << 20), (small, 0)]
    assert cost.old_data_windows(checkpoint, tmp_path / "offload", 4) == windows
    assert cost.old_data_windows(checkpoint, tmp_path, 4, count=2) == windows[:2]
    assert cost.old_data_windows(big, tmp_path, 4) == windows[:3]
    assert cost.old_data_windows(checkpoint, tmp_path, 16) == []  # no file of 16 MiB
    assert cost.old_data_windows(tmp_path / "missing", tmp_path, 4) == []
    assert cost.old_data_windows(None, tmp_path, 4) == []
    reads = []
    real = cost._read_windows
    monkeypatch.setattr(cost, "_read_windows", lambda *a: reads.append(a) or real(*a))
    read, write = cost.measure_disk(tmp_path / "offload", 4, old=windows)
    assert read > 0 and write > 0 and reads == [(windows, 4 << 20)]
    assert len(real(windows, 4 << 20)) == len(windows)  # one rate per window
    assert big.read_bytes() == bytes(range(256)) * (12 << 12)
    assert not list((tmp_path / "offload").iterdir())


def test_disk_probe_reads_like_the_store(tmp_path):
    """The disk probe writes, then reads a file whole several times (O_DIRECT where allowed)
    and leaves nothing behind."""
    from hf_dsinfer.offload.cost import measure_disk

    read, write = measure_disk(tmp_path, 4, reps=3)
    assert read > 0 and write > 0
    assert not list(tmp_path.iterdir())


def test_codes_attention_pricing_and_footprint(llama_dir):
    """A 4-bit cache on the CPU: with the attention-over-codes rate measured, a decode step
    prices the stored codes at that rate and no decoding (dearer than before only if that rate
    is slow); without it (inf: no native kernels), the decode and dense attention as before.
    The footprint holds two layers' disk codes, not the dense block copy, unless the layers are
    not fused blocks (the engine decodes then)."""
    import dataclasses

    from hf_dsinfer.offload.cache import attends_in_cache
    from hf_dsinfer.offload.cost import layer_terms
    from hf_dsinfer.offload.policy import OffloadPolicy

    shape = model_shape(llama_dir, torch.bfloat16)
    policy = OffloadPolicy(weights=(0, 100, 0), cache=(0, 50, 50), compress_cache=True,
                           micro_batch_size=4, num_micro_batches=2, offload_dir="/tmp/x")
    decoded = layer_terms(shape, HW, policy, WORK, 8, False).compute
    fast = dataclasses.replace(HW, attn_int4=1e12)
    slow = dataclasses.replace(HW, attn_int4=1e6)
    assert layer_terms(shape, fast, policy, WORK, 8, False).compute < decoded
    assert layer_terms(shape, slow, policy, WORK, 8, False).compute > decoded
    codes = 8 * (64 + 4) * shape.kv_token_bytes(True, policy.group_size)
    assert layer_terms(shape, slow, policy, WORK, 8, False).compute == pytest.approx(
        layer_terms(shape, dataclasses.replace(HW, attn_int4=2e6), policy, WORK, 8,
                    False).compute + codes / 2e6)
    fused = footprint(shape, policy, False, 8, 64, 8).host["kv read"]
    unfused = footprint(shape, policy, False, 8, 64, 8, fused=False).host["kv read"]
    if attends_in_cache(policy, torch.device("cpu")):
        assert fused == pytest.approx(2 * 8 * 72 * shape.kv_token_bytes(True, 64) * 0.5)
        assert fused < unfused
    else:
        assert fused == unfused
