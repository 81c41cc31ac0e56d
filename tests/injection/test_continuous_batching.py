"""Fused blocks under transformers' continuous batching (injection/paged.py) and its errors
reaching the caller (integration/continuous_batching.py).

`generate_batch` packs every request into one row over a paged KV cache, chunks prefills under a
token budget and mixes them with decode steps. For every family: mixed prompt lengths, one
prompt over the token budget, two prompts sharing a prefix of whole pages (prefix sharing),
greedy fp32: the injected model's tokens equal HF's own generate_batch on the un-injected model
and per-prompt generate, every request runs to max_new_tokens, and the fused paged path counts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
)
from transformers.generation.continuous_batching import PagedAttentionCache

import hf_dsinfer
from hf_dsinfer.errors import ContinuousBatchingError
from hf_dsinfer.hf.cache_args import KEYWORD
from hf_dsinfer.hf.continuous_batching import THREAD_KEEPS_INFERENCE_MODE, result_problems
from hf_dsinfer.injection import paged
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import attention as A
from tests.kernels.test_native_decode import _BASE  # head_dim 32: the native decode layer builds
from tests.tiny_models import FAMILIES, MOE_MODELS, VOCAB, make_model

NEW_TOKENS = 6
BUDGET = 32  # max_batch_tokens: the 40-token prompt is prefilled in two chunks
PAGE = 8
LENGTHS = (5, 17, 9, 40, 3)
RENAMED = KEYWORD == "cache"  # transformers >= 5.24 (hf/cache_args.py)
# HF's generate_batch itself gives wrong tokens for these before 5.24: their model code does not
# pass the paged cache to the blocks; an injected model raises instead. 5.24's GPT-J passes it.
NO_PAGED_CACHE = () if RENAMED else ("bloom", "gptj")
# HF's own generate_batch fails every request of these:
# - DeepSeek-V3 (5.23, 5.24), DeepSeek-V2 (5.24): the paged cache is sized by head_dim =
#   qk_rope_head_dim, MLA writes the expanded keys (V2: its latent);
# - OPT, BLOOM, GPT-NeoX (5.24), Falcon: their model forwards call cache.get_seq_length(),
#   which the PagedAttentionCache has not.
# - StableLM, Nemotron (5.24): their decoder layers call the attention without the batch's
#   kwargs, so the paged cache's update finds no cu_seq_lens_k.
# The injected model completes every request where its own code stands in for the failing
# part (GPT-NeoX), and otherwise raises with HF's error chained (test_hf_failures_raise).
NO_HF_CB = ("deepseek_v3", "deepseek_v2", "stablelm", "stablelm_parallel", "nemotron", "youtu",
            "glm4_moe_lite", "minicpm3", "falcon", "falcon_7b") + (
    ("opt", "opt_post_ln", "bloom", "gpt_neox", "gpt_neox_sequential") if RENAMED else ())
# HF's generate_batch gives other tokens than its own generate for these (5.24, greedy, the
# same prompts): the injected model's generate_batch is held to HF's generate instead.
HF_CB_DIFFERS = ("vaultgemma",)
CB_FAMILIES = [f for f in FAMILIES if f not in NO_PAGED_CACHE + NO_HF_CB] + [
    m for m in MOE_MODELS if m not in NO_HF_CB]


# eos_token_id=-1 on purpose (every request runs to NEW_TOKENS): its warning silenced
pytestmark = pytest.mark.usefixtures("quiet_eos_warning")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    return prompts + [prompts[3][:2 * PAGE] + [7, 8, 9]]  # shares two pages with prompt 3


def _gen_config() -> GenerationConfig:
    # eos_token_id=-1: no early stop, so every request must run to NEW_TOKENS
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                            pad_token_id=0)


def _generate_batch(model, prompts) -> list[list[int]]:
    cb = ContinuousBatchingConfig(max_batch_tokens=BUDGET, num_blocks=64, page_size=PAGE)
    out = model.generate_batch(prompts, generation_config=_gen_config(),
                               continuous_batching_config=cb, warmup=False)
    return [r.generated_tokens for r in out.values()]


def _generate_each(model, prompts) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), generation_config=_gen_config())[0, len(p):].tolist()
            for p in prompts]


@pytest.mark.parametrize("family", CB_FAMILIES)
def test_generate_batch_equals_hf(family):
    prompts = _prompts()
    ref = make_model(family)
    hf_batch = _generate_batch(ref, prompts)
    hf_each = _generate_each(ref, prompts)
    # the reference agrees with itself (where HF's does not, the entry leaves HF_CB_DIFFERS
    # once HF's generate_batch is fixed)
    assert (hf_batch == hf_each) != (family in HF_CB_DIFFERS)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    fused = list(get_report(model).blocks.values())
    with torch.inference_mode():
        tokens = _generate_batch(model, prompts)
    assert tokens == hf_each
    assert all(len(t) == NEW_TOKENS for t in tokens)
    # every block attended over the paged cache itself, in every forward
    assert all(f.paged.calls > 0 and not f.paged.deferred for f in fused)
    assert len({f.paged.calls for f in fused}) == 1
    assert all(f.calls >= f.paged.calls for f in fused)
    # the packed requests attended each over its own keys (ALiBi and MLA families defer above)
    assert all(0 < f.paged.segmented <= f.paged.calls for f in fused)
    moe = get_report(model).moe.values()
    assert all(m.calls > 0 for m in moe)
    assert "fused attention over the paged KV cache in" in hf_dsinfer.explain(model)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_no_grad_and_repeat(family):
    """Under no_grad, twice on one model (the manager's cache is rebuilt), and through the
    model's own generate afterwards (the paged marks are gone). The two prompts sharing whole
    pages are in: the second reads the first's cached prefix (fewer tokens are computed)."""
    prompts = _prompts()[2:]
    ref = make_model(family)
    expected = _generate_each(ref, prompts)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    computed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: computed.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True)
    with torch.no_grad():
        assert _generate_batch(model, prompts) == expected
        hook.remove()
        assert _generate_batch(model, prompts[::-1]) == expected[::-1]
    assert sum(computed) < sum(map(len, prompts)) + len(prompts) * (NEW_TOKENS - 1)
    assert _generate_each(model, prompts) == expected
    assert not any(f.paged.expected for f in get_report(model).blocks.values())


@pytest.mark.parametrize("family", NO_PAGED_CACHE)
def test_model_without_paged_cache_raises(family):
    """HF's own generate_batch returns wrong tokens for these (its blocks never see the paged
    cache); the injected model raises, naming the block and the fix."""
    prompts = _prompts()[:3]
    ref = make_model(family)
    assert _generate_batch(ref, prompts) != _generate_each(ref, prompts)  # HF's own is wrong
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    with pytest.raises(ContinuousBatchingError, match="did not pass it on") as err:
        _generate_batch(model, prompts)
    assert "model.generate()" in str(err.value)
    assert "calls refused" in hf_dsinfer.explain(model)


@pytest.mark.parametrize("family", NO_HF_CB)
def test_hf_failures_raise(family):
    """Where HF's own generate_batch fails requests, the injected model never returns them short:
    every request complete and equal to per-prompt generate, or ContinuousBatchingError with
    the failure chained."""
    prompts = _prompts()
    ref = make_model(family)
    expected = _generate_each(ref, prompts)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    try:
        tokens = _generate_batch(model, prompts)
    except ContinuousBatchingError as err:
        assert "requests failed" in str(err)
        return
    assert tokens == expected


def test_error_in_fused_block_reaches_caller():
    """An exception in a fused block, in the manager's thread, is raised by generate_batch
    (chained), instead of requests coming back short with a log line."""
    model = hf_dsinfer.init_inference(make_model("llama"))
    fused = next(iter(get_report(model).blocks.values()))
    boom = RuntimeError("boom in the fused MLP")

    def fail(x):
        raise boom

    fused._mlp = fail  # on this one block instance
    with pytest.raises(ContinuousBatchingError, match="boom in the fused MLP") as err:
        _generate_batch(model, _prompts()[:3])
    assert err.value.__cause__ is boom
    del fused._mlp
    assert all(len(t) == NEW_TOKENS for t in _generate_batch(model, _prompts()[:3]))


def test_inference_mode_with_warmup_completes_or_raises_with_fix():
    """Before transformers 5.24, HF's own generate_batch under inference_mode with its default
    warmup returned every request empty (its thread, outside inference mode, could not update
    the cache made in it); ours raises and says what to change. From 5.24 the thread keeps the
    caller's inference mode, and every request completes."""
    model = hf_dsinfer.init_inference(make_model("llama"))
    cb = ContinuousBatchingConfig(max_batch_tokens=BUDGET, num_blocks=64, page_size=PAGE)
    prompts = _prompts()[:2]
    with torch.inference_mode():
        if THREAD_KEEPS_INFERENCE_MODE:
            out = model.generate_batch(prompts, generation_config=_gen_config(),
                                       continuous_batching_config=cb)  # warmup=True
            assert [r.generated_tokens for r in out.values()] == _generate_each(model, prompts)
        else:
            with pytest.raises(ContinuousBatchingError, match="warmup=False"):
                model.generate_batch(prompts, generation_config=_gen_config(),
                                     continuous_batching_config=cb)


def test_revert_restores_hf_entry_points():
    model = hf_dsinfer.init_inference(make_model("llama"))
    assert "generate_batch" in model.__dict__
    hf_dsinfer.revert(model)
    assert "generate_batch" not in model.__dict__
    assert "init_continuous_batching" not in model.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_result_problems_names_failed_missing_and_short():
    class Out:
        def __init__(self, tokens, error=None):
            self.generated_tokens, self.error = tokens, error

    ok = {"a": Out([5] * 4), "b": Out([5, 2])}  # b ended on EOS (2)
    assert result_problems(ok, 2, 4, {2}) == []
    bad = {"a": Out([5]), "b": Out([], "RuntimeError: x")}
    problems = result_problems(bad, 3, 4, {2})
    assert problems[0].startswith("1 of 3 requests failed (first: b: RuntimeError: x")
    assert problems[1] == "1 of 3 requests returned no result"
    assert "first: a: 1 of max_new_tokens=4" in problems[2]


def test_calls_without_mask_or_with_alibi_go_to_hf():
    """Flash attention's calls (no mask, or a block table) and ALiBi layouts: the HF forward."""
    llama = next(iter(get_report(hf_dsinfer.init_inference(make_model("llama"))).blocks.values()))
    bloom = next(iter(get_report(hf_dsinfer.init_inference(make_model("bloom"))).blocks.values()))
    mask = torch.zeros(1, 1, 2, 2)
    assert paged.call_why(llama, {"attention_mask": mask, "block_table": None}) is None
    assert "varlen" in paged.call_why(llama, {"attention_mask": None})
    assert "block-table" in paged.call_why(llama, {"attention_mask": mask,
                                                   "block_table": torch.zeros(1)})
    assert "ALiBi" in paged.call_why(bloom, {"attention_mask": mask})
    stand_in = PagedAttentionCache.__new__(PagedAttentionCache)  # what defers checks: its type
    assert paged.defers(llama, {"cache": stand_in, "attention_mask": None})
    assert not paged.defers(llama, {"cache": object(), "attention_mask": None})  # a dense one
    assert sum(llama.paged.deferred.values()) == 1
    assert not paged.defers(llama, {"attention_mask": mask})  # not a continuous-batching call


@pytest.mark.parametrize("extra", [{}, {"compile": True}, {"quant": {"bits": 4, "group_size": 32}}])
def test_bf16_native_step_and_compiled_decode_hand_over(monkeypatch, extra):
    """bf16 Llama with the native one-loop decode step installed (and compiled decode, and
    int4 weights): continuous batching's calls go through HF's layer loop to the fused blocks'
    paged path, the step refuses them, and the model's generation_config (static cache and
    compile config under compile=True) does not break generate_batch. Where the native kernels
    run, the decode rows of a packed step are attended in one native call per layer."""
    from hf_dsinfer.kernels import _native
    from hf_dsinfer.kernels import attention as A
    from tests.kernels.conftest import count_calls

    rows = count_calls(monkeypatch, A, "attend_rows_native")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16).eval()
    model = hf_dsinfer.init_inference(model, dtype=torch.bfloat16, **extra)
    report = get_report(model)
    model.generation_config.update(**_gen_config().to_diff_dict())  # used when none is passed
    cb = ContinuousBatchingConfig(max_batch_tokens=BUDGET, num_blocks=64, page_size=PAGE)
    with torch.inference_mode():
        out = model.generate_batch(_prompts(), continuous_batching_config=cb, warmup=False)
    assert all(len(r.generated_tokens) == NEW_TOKENS for r in out.values())
    assert report.step.calls == 0 and report.step.last_reason == "arguments other than HF generate's"
    assert all(f.paged.calls > 0 for f in report.blocks.values())
    assert bool(rows) == (_native.lib() is not None)


def _packed_mask(q_lens, k_lens, window=None, leak=False):
    """The additive [1, 1, T, K] mask of requests packed one after another: each query reads its
    own request's keys up to its position (the last q_len of its k_len keys are the new ones)."""
    t, k = sum(q_lens), sum(k_lens)
    allowed = torch.zeros(t, k, dtype=torch.bool)
    q0 = k0 = 0
    for ql, kl in zip(q_lens, k_lens):
        for i in range(ql):
            pos = kl - ql + i
            lo = 0 if window is None else max(0, pos - window + 1)
            allowed[q0 + i, k0 + lo:k0 + pos + 1] = True
        q0, k0 = q0 + ql, k0 + kl
    if leak:
        allowed[0, k - 1] = True  # the first query may read the last request's key
    mask = torch.zeros(t, k).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None], _offsets(q_lens), _offsets(k_lens)


def _offsets(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


@pytest.mark.parametrize("window", [None, 3])
def test_segments_attend_like_the_whole_row(window):
    from hf_dsinfer.kernels.attention import attention, attention_segments

    q_lens, k_lens = (1, 4, 1, 2), (9, 4, 3, 12)
    mask, cu_q, cu_k = _packed_mask(q_lens, k_lens, window)
    found = paged.segments(mask, cu_q, cu_k)
    assert found == [(0, 1, 0, 9), (1, 5, 9, 13), (5, 6, 13, 16), (6, 8, 16, 28)]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=gen)
    k, v = (torch.randn(1, 2, 28, 16, generator=gen) for _ in range(2))
    whole = attention(q, k, v, scale=0.25, mask=mask)
    torch.testing.assert_close(attention_segments(q, k, v, found, scale=0.25, mask=mask), whole,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_causal_prefill_segments_attend_without_the_mask(monkeypatch, dtype, bool_mask):
    """Prefill chunks whose block of the mask is the causal rule (a fresh prompt, and a chunk
    after 10 earlier tokens) attend with causal=True and no mask: the masked attention's bits.
    A sliding window that masks keys, or a bias in the block, keeps the mask. Checked once per
    forward (same mask and segments objects)."""
    from tests.kernels.conftest import count_calls

    q_lens, k_lens = (1, 5, 2, 3), (9, 5, 12, 3)
    mask, cu_q, cu_k = _packed_mask(q_lens, k_lens)
    mask = mask == 0 if bool_mask else mask.to(dtype)
    found = paged.segments(mask, cu_q, cu_k)
    assert A.causal_segments(found, mask) == [True, True, True, True]
    windowed, _, _ = _packed_mask(q_lens, k_lens, window=3)
    assert A.causal_segments(found, windowed.to(dtype)) == [False, False, False, True]
    biased = _packed_mask(q_lens, k_lens)[0].to(dtype)
    biased[0, 0, 1, 9] = 0.5
    assert A.causal_segments(found, biased) == [True, False, True, True]

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(q_lens), 32, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, sum(k_lens), 32, generator=gen).to(dtype) for _ in range(2))
    monkeypatch.setattr(A, "rows_plan", lambda *a: None)  # every segment through `attention`
    seen = []
    attention = A.attention
    monkeypatch.setattr(A, "attention", lambda *a, **kw: seen.append(kw["causal"])
                        or attention(*a, **kw))
    checks = count_calls(monkeypatch, A, "_is_causal_block")
    got = A.attention_segments(q, k, v, found, scale=0.2, mask=mask)
    A.attention_segments(q, k, v, found, scale=0.2, mask=mask)  # the next layer: no new check
    assert seen == [True] * 8 and len(checks) == 4
    monkeypatch.setattr(A, "causal_segments", lambda segs, m: [False] * len(segs))
    want = A.attention_segments(q, k, v, found, scale=0.2, mask=mask)
    assert torch.equal(got, want)


def test_segments_refused_where_a_query_reads_another_request():
    mask, cu_q, cu_k = _packed_mask((1, 2), (5, 3), leak=True)
    assert paged.segments(mask, cu_q, cu_k) is None
    mask, cu_q, cu_k = _packed_mask((1, 2), (5, 3))
    assert paged.segments(mask, cu_q, None) is None  # offsets missing
    assert paged.segments(mask, cu_q, torch.tensor([0, 4, 8])) is None  # not covering K
    assert paged.segments(mask, cu_q, cu_k) == [(0, 1, 0, 5), (1, 3, 5, 8)]


def test_tensor_parallel_manager_refusals(monkeypatch):
    """transformers' TP mode needs the TP group to be the world and the paged cache to hold all
    KV heads or 1 / tp of them (tests/serve/test_serve_tp.py runs the cases that work)."""
    from types import SimpleNamespace

    from hf_dsinfer.hf import continuous_batching as cb_module

    model = hf_dsinfer.init_inference(make_model("llama"))  # 3 KV heads
    report = get_report(model)
    monkeypatch.setattr(report, "tp", SimpleNamespace(size=2, ranks=(0, 1)))
    config = ContinuousBatchingConfig(num_blocks=16, page_size=8)
    monkeypatch.setattr(cb_module.dist, "get_world_size", lambda: 4)
    with pytest.raises(ContinuousBatchingError, match="world of 4 processes"):
        model.init_continuous_batching(continuous_batching_config=config)
    monkeypatch.setattr(cb_module.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(report.serving, "blocks",
                        [SimpleNamespace(spec=SimpleNamespace(num_kv_heads=2))] * 2)
    with pytest.raises(ContinuousBatchingError, match=r"\[2\] KV heads per rank out of 3"):
        model.init_continuous_batching(continuous_batching_config=config)
    assert "_device_mesh" not in model.__dict__


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma2", "mixtral_8x2"])
def test_keys_read_in_place_equal_hf_update(monkeypatch, family):
    """The fused blocks read the paged cache's keys where it keeps them (paged.read_in_place:
    HF's writes, no gather of every key of the batch per layer), counted; the tokens are HF's
    own generate_batch's and those of the same model with HF's cache.update doing the reads."""
    prompts = _prompts()
    ref = make_model(family)
    hf_batch = _generate_batch(ref, prompts)
    model = hf_dsinfer.init_inference(copy.deepcopy(ref))
    fused = list(get_report(model).blocks.values())
    with torch.inference_mode():
        in_place = _generate_batch(model, prompts)
        counted = sum(f.paged.in_place for f in fused)
        monkeypatch.setattr(paged, "read_in_place", lambda *a, **k: None)
        updated = _generate_batch(model, prompts)
    assert in_place == updated == hf_batch
    assert counted > 0 and sum(f.paged.in_place for f in fused) == counted
    assert all(f.paged.in_place <= f.paged.segmented for f in fused)
    assert "of them reading the keys where the cache keeps them" in hf_dsinfer.explain(model)


class FullAttentionCacheAllocator:  # the name read_in_place takes
    def __init__(self, slots):
        self._kv_token_views = {0: slots}
        self.index, self.layer_type = 0, "full_attention"


class _StubCache:
    """A paged cache whose update returns what read_in_place would read, or (`differs`) other
    keys: a transformers whose cache does not work as read_in_place assumes."""

    def __init__(self, differs: bool):
        self.slots = (torch.zeros(8, 2, 4), torch.zeros(8, 2, 4))
        self.layer_to_allocator = [FullAttentionCacheAllocator(self.slots)]
        self.differs, self.updates = differs, 0

    def update(self, k, v, layer_idx, kwargs):
        self.updates += 1
        write, read = kwargs["write_index"][0], kwargs["read_index"][0]
        for cache, x in zip(self.slots, (k, v)):
            cache.index_copy_(0, write, x.squeeze(0).transpose(0, 1))
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"]["full_attention"]
        kwargs["max_length_k"] = kwargs["max_length_k"]["full_attention"]
        out = [c.index_select(0, read).transpose(0, 1).unsqueeze(0) for c in self.slots]
        return (out[0] + 1, out[1]) if self.differs else tuple(out)


def _stub_kwargs():
    return {"read_index": [torch.tensor([5, 1, 2])], "write_index": [torch.tensor([2])],
            "cu_seq_lens_k": {"full_attention": torch.tensor([0, 3])},
            "max_length_k": {"full_attention": 3}}


@pytest.mark.parametrize("differs", [False, True])
def test_read_in_place_checks_hf_update_first(differs):
    """The first call for an allocator runs HF's update and compares; in place afterwards only
    where it matched, HF's update every time where it did not."""
    cache = _StubCache(differs)
    k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    first = paged.read_in_place(cache, k, v, 0, _stub_kwargs())
    assert cache.updates == 1 and not isinstance(first[0], A.SlotRows)
    kwargs = _stub_kwargs()
    second = paged.read_in_place(cache, k + 1, v, 0, kwargs)
    if differs:
        assert second is None and cache.updates == 1
        return
    assert isinstance(second[0], A.SlotRows) and cache.updates == 1
    assert torch.equal(cache.slots[0][2], (k + 1)[0, :, 0])  # written as HF writes
    assert torch.equal(second[0].rows(), cache.slots[0].index_select(0, kwargs["read_index"][0])
                       .transpose(0, 1).unsqueeze(0))
    assert kwargs["max_length_k"] == 3 and kwargs["cu_seq_lens_k"].dtype == torch.int32
