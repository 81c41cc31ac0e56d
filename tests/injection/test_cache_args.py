"""hf.cache_args: a fused block finds its cache by type under whatever keyword the installed
transformers passes it (5.24 renamed `past_key_values` to `cache`; BLOOM and GPT-NeoX blocks
take `layer_past`), and hf_dsinfer's own calls into transformers use the installed keyword, so
they raise no deprecation warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import hf_dsinfer
from hf_dsinfer.hf import cache_args
from hf_dsinfer.injection.walker import get_report
from tests.tiny_models import make_model

PAGED = PagedAttentionCache.__new__(PagedAttentionCache)  # an instance: what is checked is its type


def test_the_keyword_is_the_installed_releases():
    import inspect

    params = inspect.signature(LlamaDecoderLayer.forward).parameters
    assert cache_args.KEYWORD in params
    assert cache_args.KEYWORD in cache_args.MODEL_NAMES


@pytest.mark.parametrize("name", cache_args.NAMES)
def test_dense_and_paged_caches_are_told_apart_under_every_name(name):
    dense = DynamicCache()
    assert cache_args.dense_cache({name: dense}, "past_key_values") is dense
    assert cache_args.dense_cache({name: dense}, name) is dense
    assert cache_args.dense_cache({name: PAGED}, name) is None
    assert cache_args.paged_cache({name: dense}, name) is None
    assert cache_args.paged_cache({name: PAGED}, name) is PAGED
    # a paged cache under `cache` beside an empty dense keyword (transformers < 5.24)
    assert cache_args.dense_cache({"past_key_values": None, "cache": PAGED}, name) is None
    assert cache_args.paged_cache({"past_key_values": None, "cache": PAGED}, name) is PAGED
    assert cache_args.dense_cache({"hidden_states": 1}, name) is None


def test_with_cache_and_model_cache():
    dense = DynamicCache()
    out = cache_args.with_cache({"past_key_values": 1, "cache": 2, "use_cache": True}, dense)
    assert out == {"use_cache": True, cache_args.KEYWORD: dense}
    assert cache_args.model_cache({"past_key_values": dense}) is dense
    assert cache_args.model_cache({"cache": dense}) is dense
    assert cache_args.model_cache({}) is None


def test_parameter_of_a_block_forward():
    assert cache_args.parameter(LlamaDecoderLayer.forward, "nope") == cache_args.KEYWORD

    def old(hidden_states, layer_past=None):
        return hidden_states

    assert cache_args.parameter(old, "layer_past") == "layer_past"
    assert cache_args.parameter(lambda hidden_states: 0, "cache") is None


@pytest.mark.parametrize("family", ["llama", "bloom", "gpt_neox", "gptj", "opt"])
def test_injection_and_cached_decode_warn_nothing(family):
    """The parity gate's probe and a cached decode through the injected model name the cache
    as the installed transformers does: no FutureWarning from hf_dsinfer's calls; and the
    fused blocks found the dense cache (decode steps equal a full forward)."""
    model = make_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = hf_dsinfer.init_inference(model, strict=True)
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        model(ids[:, :-1], use_cache=True, **{cache_args.KEYWORD: cache})
        step = model(ids[:, -1:], use_cache=True, **{cache_args.KEYWORD: cache}).logits[0, -1]
    assert cache.get_seq_length() == 7
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)
    assert all(f.calls > 0 for f in get_report(model).blocks.values())


def test_policy_default_names_the_installed_keyword():
    from hf_dsinfer.injection.policies import llama

    assert llama.POLICY.cache_arg == cache_args.KEYWORD
