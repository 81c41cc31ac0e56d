"""What HF's own model tests ask of a model, asked of injected ones, for every family: copies
(deepcopy, pickle, torch.save), heads other than *ForCausalLM, attention weights and router
logits asked through the config, torch.compile(fullgraph=True) on MoE models,
set_experts_implementation, and a failed injection leaving the model as it was.

Positions of left padding are compared nowhere: HF itself gives them different values under
eager and sdpa attention (a query row with every key masked), and fused attention gives 0."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import transformers
from tiny_models import FAMILIES, MOE_MODELS, make_model, prompts

import hf_dsinfer
from hf_dsinfer.errors import DSInferError, MoeStateError
from hf_dsinfer.injection import walker

ALL = FAMILIES + MOE_MODELS
HEADS = ("AutoModelForSequenceClassification", "AutoModelForTokenClassification",
         "AutoModelForQuestionAnswering")


def _valid(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask.bool()]


def _counts(model) -> dict[str, int]:
    return hf_dsinfer.fused_call_counts(model)


def _installed(model) -> list[str]:
    """Modules with a forward installed on the instance (a fused block, FusedMoE, head...)."""
    return [name for name, m in model.named_modules()
            if "forward" in m.__dict__ or "_old_forward" in m.__dict__]


# -- copies ----------------------------------------------------------------------------------------
def _copies():
    def save_load(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
            "torch.save": save_load}


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])  # torch.save pickles the module
def test_copy_of_injected_model_runs_fused_and_on_its_own_weights(family, how):
    ids, mask = prompts()
    model = make_model(family)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    hf_dsinfer.init_inference(model, strict=True)
    twin = _copies()[how](model)
    before = _counts(twin)
    with torch.no_grad():
        for p in model.parameters():  # the copy must not read the original's weights
            p.zero_()
        out = twin(ids, attention_mask=mask).logits
    torch.testing.assert_close(_valid(out, mask), _valid(ref, mask), rtol=1e-4, atol=1e-4)
    after = _counts(twin)
    assert after and all(after[k] > before[k] for k in after)


def _decode_model(**extra) -> torch.nn.Module:
    """Llama with head_dim 64: a shape the native decode layer takes (bf16)."""
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
        initializer_range=0.15, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("quant", [None, {"bits": 8}, {"bits": 4, "group_size": 64}])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_builds_its_own_native_decode_layers(quant, how):
    from hf_dsinfer.kernels import _native

    if _native.lib() is None:
        pytest.skip(f"native kernels unavailable: {_native.why_unavailable()}")
    ids = prompts(1, (6,))[0]
    model = hf_dsinfer.init_inference(_decode_model(), quant=quant)
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    report = walker.get_report(model)
    assert report.step.calls > 0  # the native step ran on the original
    twin = _copies()[how](model)
    twin_report = walker.get_report(twin)
    assert all(f._decode is None for f in twin_report.blocks.values())
    with torch.no_grad():
        for m in model.modules():  # wipe the original's weights, quantized ones included
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if t.is_floating_point():
                    t.zero_()
    steps = twin_report.step.calls
    got = twin.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    assert twin_report.step.calls > steps
    assert all(f._decode is not None for f in twin_report.blocks.values())


def test_offloaded_model_refuses_to_be_copied(tmp_path):
    model = hf_dsinfer.init_inference(make_model("llama"), offload={
        "weights": (0, 100, 0), "offload_dir": str(tmp_path)})
    for fn in _copies().values():
        with pytest.raises(DSInferError, match="cannot be copied or pickled"):
            fn(model)
    ids, mask = prompts()
    model(ids, attention_mask=mask)  # the failed copy left the original working


# -- heads -----------------------------------------------------------------------------------------
def _head(family: str, head: str):
    config = make_model(family).config
    try:
        cls = getattr(transformers, head)._model_mapping[type(config)]
    except KeyError:
        return None
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("head", HEADS)
def test_heads_other_than_causal_lm_are_injected(family, head):
    # strict=True: no block may fall back to HF (the gate passes) and nothing may raise;
    # the families whose base model sits under another attribute are covered by strict=False
    # in test_question_answering_heads_under_strict_false
    _check_head(family, head, strict=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe", "bloom", "gptj"])
def test_question_answering_heads_under_strict_false(family):
    _check_head(family, "AutoModelForQuestionAnswering", strict=False)


def _check_head(family: str, head: str, strict: bool) -> None:
    model = _head(family, head)
    if model is None:
        pytest.skip(f"transformers has no {head} for {family}")
    ids, mask = prompts()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no parity fallback, no 'running unmodified'
        hf_dsinfer.init_inference(model, strict=strict)
    report = walker.get_report(model)
    assert report.blocks and all(f.enabled for f in report.blocks.values())
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    assert all(n > 0 for n in _counts(model).values())
    if head.endswith("QuestionAnswering"):
        pairs = [(out.start_logits, ref.start_logits), (out.end_logits, ref.end_logits)]
        pairs = [(_valid(a, mask), _valid(b, mask)) for a, b in pairs]
    elif head.endswith("TokenClassification"):
        pairs = [(_valid(out.logits, mask), _valid(ref.logits, mask))]
    else:  # pooled at the last real token
        pairs = [(out.logits, ref.logits)]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_model_without_the_policys_layers_is_refused_or_run_unmodified():
    model = make_model("llama")
    model.model.layers = torch.nn.ModuleList()  # pretend the layers live elsewhere
    del model.model.layers
    with pytest.raises(hf_dsinfer.UnsupportedModelError, match="found no decoder layers"):
        hf_dsinfer.init_inference(model, strict=True)
    assert walker.get_report(model) is None
    with pytest.warns(UserWarning, match="no decoder layers"):
        hf_dsinfer.init_inference(model, strict=False)
    assert walker.get_report(model).unmodified_reason


# -- outputs HF records with hooks -------------------------------------------------------------------
def _ask(model, flag: str, through: str) -> dict:
    """Ask for output `flag` through the model's config, or as the keyword returned."""
    if through == "config":
        setattr(model.config, flag, True)
        return {}
    return {flag: True}


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("through", ["config", "keyword"])
def test_attention_weights_asked_through_config_or_keyword(family, through):
    ids, mask = prompts()
    model = make_model(family)
    ask = _ask(model, "output_attentions", through)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, **ask)
    hf_dsinfer.init_inference(model)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **ask)
    layers = model.config.num_hidden_layers
    assert len(ref.attentions) == len(out.attentions) == layers
    for got, want in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.config.output_attentions = False
    counts = _counts(model)
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
    assert not plain.attentions and all(_counts(model)[k] > n for k, n in counts.items())


@pytest.mark.parametrize("family", MOE_MODELS)
@pytest.mark.parametrize("through", ["config", "keyword"])
def test_router_logits_and_aux_loss(family, through):
    ids, mask = prompts()
    model = make_model(family)
    ask = _ask(model, "output_router_logits", through)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, labels=ids, **ask)
    hf_dsinfer.init_inference(model, strict=True)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=ids, **ask)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    rows = mask.reshape(-1).bool()  # router logits are [B * S, E]
    for got, want in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)  # pads masked
    assert all(n > 0 for n in _counts(model).values())  # the experts stayed fused


# -- torch.compile and experts implementations ---------------------------------------------------
@pytest.mark.parametrize("family, quant", [("mixtral_8x2", None), ("qwen2_moe", None),
                                           ("mixtral_4x1", {"bits": 8})])
def test_moe_compiles_fullgraph(family, quant):
    ids, mask = prompts()
    model = make_model(family)
    hf_dsinfer.init_inference(model, quant=quant)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits
    torch.testing.assert_close(_valid(out, mask), _valid(eager, mask), rtol=1e-4, atol=1e-4)


def test_set_experts_implementation_hands_the_experts_to_hf():
    ids, mask = prompts()
    model = hf_dsinfer.init_inference(make_model("mixtral_8x2"))
    injected_with = model.config._experts_implementation
    other = "eager" if injected_with != "eager" else "grouped_mm"
    with torch.no_grad():
        fused = model(ids, attention_mask=mask).logits
    moe_paths = list(walker.get_report(model).moe)
    counts = _counts(model)
    model.set_experts_implementation(other)
    with torch.no_grad():
        hf = model(ids, attention_mask=mask).logits
    assert all(_counts(model)[p] == counts[p] for p in moe_paths)  # HF's experts ran
    assert f"set_experts_implementation({other!r}) after injection" in hf_dsinfer.explain(model)
    torch.testing.assert_close(_valid(hf, mask), _valid(fused, mask), rtol=1e-4, atol=1e-4)
    model.set_experts_implementation(injected_with)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert all(_counts(model)[p] == counts[p] + 1 for p in moe_paths)


def test_set_experts_implementation_on_quantized_experts_raises():
    ids, mask = prompts()
    model = hf_dsinfer.init_inference(make_model("mixtral_8x2"), quant={"bits": 8})
    model.set_experts_implementation("eager")
    with pytest.raises(MoeStateError, match="set_experts_implementation"):
        model(ids, attention_mask=mask)


# -- a failed injection --------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "mixtral_8x2", "gpt2"])
def test_failed_injection_leaves_the_model_as_it_was(family, monkeypatch):
    ids, mask = prompts()
    model = make_model(family)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits

    def broken(*args, **kwargs):
        raise RuntimeError("late failure")

    monkeypatch.setattr(walker, "install_head", broken)  # fails after the blocks are installed
    with pytest.raises(RuntimeError, match="late failure"):
        hf_dsinfer.init_inference(model)
    assert walker.get_report(model) is None and _installed(model) == []
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref)
