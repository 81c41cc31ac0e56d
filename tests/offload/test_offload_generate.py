"""Offloaded generation gives HF's tokens (fp32), whatever the placement: weights partly on
disk, KV cache in RAM or on disk, several micro-batches per block, overlap on or off; and the
block schedule really ran (layer loads, micro-batch calls, fused calls)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import make_model, prompts, tiny_tokenizer
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    OPTConfig,
    TextIteratorStreamer,
    pipeline,
)

import hf_dsinfer
from hf_dsinfer.injection.fused import FusedBlock
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import kv_quant as KV
from hf_dsinfer.offload import get_engine
from hf_dsinfer.offload.schedule import OffloadEngine

NEW = 6
PLACEMENTS = {  # name -> policy fields (offload_dir added per test)
    "disk_weights_disk_kv": {"weights": (0, 0, 100), "cache": (0, 0, 100), "micro_batch_size": 1,
                                 "num_micro_batches": 3},
    "mixed_2x2": {"weights": (20, 30, 50), "cache": (0, 50, 50), "micro_batch_size": 2,
                      "num_micro_batches": 2},
    "ram_no_overlap": {"weights": (0, 100, 0), "cache": (0, 100, 0), "overlap": False,
                           "micro_batch_size": 3},
}


def _greedy(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              **kwargs)


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2", "bloom"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_offloaded_tokens_equal_hf(family, placement, tmp_path):
    ids, mask = prompts()
    expected = _greedy(make_model(family), ids, mask)
    model = make_model(family)
    policy = {**PLACEMENTS[placement], "offload_dir": str(tmp_path)}
    hf_dsinfer.init_inference(model, offload=policy)
    engine = get_engine(model)
    engine.reset_stats()
    assert torch.equal(_greedy(model, ids, mask), expected)
    layers = len(engine.blocks)
    assert engine.stats["loads"] >= NEW * layers  # every layer loaded once per token per block
    micro = -(-3 // policy["micro_batch_size"])
    calls = sum(hf_dsinfer.fused_call_counts(model).values())
    # prefill: one fused call per micro-batch per layer; each decode step on the CPU: one call
    # per layer for the whole block (the weights are streamed once per step, not per micro-batch)
    assert calls == layers * (micro + NEW - 1)
    assert not list(tmp_path.glob("kv/*/*.bin")), "KV files are removed after generate()"


def test_compressed_tokens_do_not_depend_on_placement(tmp_path):
    """4-bit weights and KV: the codes read from disk are the codes kept in RAM."""
    ids, mask = prompts()
    outs = []
    for tiers in ((0, 100, 0), (0, 0, 100)):
        model = make_model("llama")
        hf_dsinfer.init_inference(model, offload={
            "weights": tiers, "cache": tiers, "compress_weights": True, "compress_cache": True,
            "group_size": 16,
            "micro_batch_size": 2, "num_micro_batches": 2, "offload_dir": str(tmp_path)})
        outs.append(_greedy(model, ids, mask))
    assert torch.equal(outs[0], outs[1])
    plain = _greedy(make_model("llama"), ids, mask)
    assert outs[0].shape == plain.shape


def test_batch_larger_than_block_and_sampling(tmp_path):
    ids, mask = prompts()
    reference = make_model("llama")
    model = hf_dsinfer.init_inference(copy.deepcopy(reference), offload={
        "weights": (0, 50, 50), "micro_batch_size": 1, "num_micro_batches": 2,
        "offload_dir": str(tmp_path)})
    assert torch.equal(_greedy(model, ids, mask), _greedy(reference, ids, mask))  # 2 blocks
    sampled = []
    for m in (reference, model):
        torch.manual_seed(3)
        sampled.append(m.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=NEW,
                                  do_sample=True, top_k=5))
    assert torch.equal(sampled[0], sampled[1])


def test_revert_brings_the_weights_back(tmp_path):
    ids, mask = prompts()
    model = make_model("gpt2")
    expected = _greedy(model, ids, mask)
    hf_dsinfer.init_inference(model, offload={"weights": (0, 0, 100),
                                                  "offload_dir": str(tmp_path)})
    assert all(p.device.type == "meta" for p in model.transformer.h[0].parameters())
    hf_dsinfer.revert(model)
    assert get_engine(model) is None and "generate" not in model.__dict__
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(_greedy(model, ids, mask), expected)


def test_from_pretrained_device_map_explain_pipeline(llama_dir, tmp_path):
    policy = {"weights": (0, 50, 50), "cache": (0, 50, 50), "micro_batch_size": 2,
              "num_micro_batches": 2, "offload_dir": str(tmp_path)}
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"offload": policy})
    device_map = model.hf_device_map
    assert device_map["model.embed_tokens"] == "cpu"
    assert {device_map[f"model.layers.0.{n}"] for n in ("self_attn.q_proj", "mlp.down_proj")} \
        == {"cpu", "disk"}
    assert model.model.layers[1].mlp.down_proj.weight.device.type == "meta"  # disk tier
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "cpu"  # bound in RAM
    text = hf_dsinfer.explain(model)
    assert "offload: weights 0/50/50" in text and "disk" in text
    texts = ["w5 w6 w7 w8 w9 w10 w11", "w20 w21", "w30 w31 w32 w33"]
    plain = pipeline("text-generation", model=llama_dir)
    offl = pipeline("text-generation", model=llama_dir,
                    model_kwargs={"dsinfer": {"offload": policy}})
    assert offl.model.hf_device_map and get_engine(offl.model) is not None
    args = {"max_new_tokens": NEW, "do_sample": False, "batch_size": 3}
    assert offl(texts, **args) == plain(texts, **args)
    streamer = TextIteratorStreamer(tiny_tokenizer(), skip_prompt=True)
    out = offl(texts[0], max_new_tokens=NEW, do_sample=False, streamer=streamer)
    assert "".join(streamer).strip() in out[0]["generated_text"]


@pytest.mark.parametrize("compress", [False, True])
def test_read_ahead_under_inference_mode(compress, tmp_path):
    """generate() under torch.inference_mode with the cache read ahead on the I/O thread into
    pooled buffers, several micro-batches, KV on disk (dense and 4-bit): inference mode is
    thread-local, so the reads must run in it too; the same tokens as under no_grad."""
    ids, mask = prompts()
    policy = {"weights": (0, 50, 50), "cache": (0, 0, 100), "micro_batch_size": 2,
              "num_micro_batches": 2, "compress_cache": compress, "group_size": 16,
              "offload_dir": str(tmp_path)}
    model = make_model("opt")
    hf_dsinfer.init_inference(model, offload=policy)
    expected = _greedy(model, ids, mask)
    with torch.inference_mode():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, expected)
    if not compress:
        assert torch.equal(got, _greedy(make_model("opt"), ids, mask))


def _wide(family: str) -> torch.nn.Module:
    """A bf16 model whose layers the native decode layer takes (inputs a multiple of 32
    columns): its q comes from the native step, scaled already for OPT."""
    common = {"vocab_size": 128, "hidden_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 128, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}
    config = (LlamaConfig(**common, intermediate_size=256, num_key_value_heads=2)
              if family == "llama" else OPTConfig(**common, ffn_dim=256, word_embed_proj_dim=128))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _batched_layer_runs(model, rows: int) -> bool:
    """The batched native layer takes `rows` rows of this (un-offloaded, injected) model's
    layers here: AMX, or without it the tier's kernels (DecodeLayer.rows_why, rows_max)."""
    hf_dsinfer.init_inference(model, parity_check=False)
    layers = [block.decode_layer() for block in get_report(model).blocks.values()]
    return all(layer is not None and layer.rows_why is None and layer.rows_max >= rows
               for layer in layers)


@pytest.mark.skipif(not _native.available(), reason="attention over the 4-bit KV codes is a "
                    f"native kernel: {_native.why_unavailable()}")
@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attends_over_the_stored_codes(family, dtype, tmp_path, monkeypatch):
    """A 4-bit cache on the CPU: each decode step's attention runs straight over the stored
    codes (FlexGen's attention where the cache lives; no dense copy, nothing decoded), with
    padding, two micro-batches, rows in RAM and on disk. Against the engine decoding the cache
    for attention: every decode layer step attended (counted, the native kernel ran), logits
    within rounding. fp32: the same greedy tokens. bf16: layers the native decode layer takes
    (batched rows: where the batched layer runs), whose q arrives from its first call (q_scaled); the dense
    cache is rounded to bf16, the codes are not."""
    ids, mask = prompts()
    policy = {"weights": (0, 50, 50), "cache": (0, 50, 50), "compress_cache": True,
              "group_size": 16, "micro_batch_size": 2, "num_micro_batches": 2,
              "offload_dir": str(tmp_path)}
    asked = []
    ask = FusedBlock._attend_in_cache
    monkeypatch.setattr(FusedBlock, "_attend_in_cache",
                        lambda self, *a, **kw: asked.append(kw.get("q_scaled", False))
                        or ask(self, *a, **kw))
    runs = []
    for attends in (True, False):
        if not attends:
            monkeypatch.setattr(OffloadEngine, "attends", property(lambda self: False))
        model = make_model(family) if dtype == torch.float32 else _wide(family)
        hf_dsinfer.init_inference(model, offload=policy, parity_check=False)
        engine = get_engine(model)
        engine.reset_stats()
        native = KV.ATTEND_CALLS["native"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        runs.append((out, engine.stats["kv_attend"], KV.ATTEND_CALLS["native"] - native,
                     hf_dsinfer.explain(model)))
    (codes, attended, kernel, said), (dense, none, _, said_dense) = runs
    assert "attention over the stored 4-bit KV codes" in said
    assert "decoded to dense K/V" in said_dense
    assert attended == len(engine.blocks) * (NEW - 1) and none == 0
    assert kernel >= attended  # one call per segment of each micro-batch
    batched_native = dtype == torch.bfloat16 and _batched_layer_runs(_wide(family), 2)
    assert all(asked) == batched_native and any(asked) == all(asked)
    tol = 1e-3 if dtype == torch.float32 else 0.1
    for a, b in zip(codes.logits, dense.logits):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)
    if dtype == torch.float32:
        assert torch.equal(codes.sequences, dense.sequences)
