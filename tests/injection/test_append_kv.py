"""append_kv (injection/fused.py): a one-token cache update that writes the token into spare
room instead of HF DynamicLayer's torch.cat of the whole cache. HF's own cache, updated the
HF way, is the reference: same keys and values after every operation generate() performs."""

from __future__ import annotations

import gc
import weakref

import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from hf_dsinfer.injection import fused
from hf_dsinfer.injection.fused import KV_SPARE_MIN, append_kv, commit_kv, kv_rooms

CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=32)


def _kv(b: int, s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 2, s, 16, generator=g).bfloat16() for _ in range(2))


def _same(ours: DynamicCache, hf: DynamicCache) -> None:
    for a, b in zip(ours.layers, hf.layers):
        if a.keys is None or b.keys is None:  # a layer no update reached
            assert a.keys is None and b.keys is None
            continue
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.get_seq_length() == hf.get_seq_length()


def test_appends_like_hf_without_copying_the_cache():
    ours, hf = DynamicCache(config=CONFIG), DynamicCache(config=CONFIG)
    for cache in (ours, hf):
        cache.update(*_kv(3, 5, 0), 0)  # the prefill: HF's update
    buffers = set()
    for step in range(KV_SPARE_MIN + 10):  # past the first buffer's room: it grows once
        k, v = _kv(3, 1, step + 1)
        got = append_kv(ours, k, v, 0)
        want = hf.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0] is ours.layers[0].keys and got[0].stride(-1) == 1
        buffers.add(got[0].data_ptr())
        _same(ours, hf)
    assert len(buffers) == 2  # one buffer per growth, not one tensor per step


def test_cache_operations_of_generate_keep_working():
    """Beam reorders, crops (assisted decoding) and batch selection rebind the layer's tensors:
    the next append starts from them, never from stale buffer contents."""
    ours, hf = DynamicCache(config=CONFIG), DynamicCache(config=CONFIG)
    for cache in (ours, hf):
        cache.update(*_kv(4, 6, 0), 0)
    operations = [
        lambda c: c.reorder_cache(torch.tensor([1, 1, 3, 0])),
        lambda c: c.crop(-2),
        lambda c: c.batch_select_indices(torch.tensor([0, 2, 3])),
        lambda c: c.batch_repeat_interleave(2),
    ]
    seed = 1
    for op in operations:
        for _ in range(3):
            k, v = _kv(ours.layers[0].keys.shape[0], 1, seed)
            seed += 1
            append_kv(ours, k, v, 0)
            hf.update(k, v, 0)
            _same(ours, hf)
        op(ours)
        op(hf)
        _same(ours, hf)
    k, v = _kv(ours.layers[0].keys.shape[0], 1, seed)
    append_kv(ours, k, v, 0)
    hf.update(k, v, 0)
    _same(ours, hf)


def test_other_caches_and_calls_take_hf_update():
    static = StaticCache(config=CONFIG, max_cache_len=8)
    k, v = _kv(1, 1, 0)
    got = append_kv(static, k, v, 0)
    assert got[0].shape[2] == 8  # HF's StaticLayer.update ran
    dyn = DynamicCache(config=CONFIG)
    got = append_kv(dyn, k, v, 0)  # not initialized yet: HF's update
    assert "_hfd_room" not in dyn.layers[0].__dict__ and got[0].shape[2] == 1
    two = _kv(1, 2, 1)
    got = append_kv(dyn, *two, 0)  # two tokens: HF's update
    assert "_hfd_room" not in dyn.layers[0].__dict__ and got[0].shape[2] == 3


def test_steps_may_switch_between_inference_mode_and_no_grad():
    """A buffer made under inference_mode cannot be written outside it: a new one is made."""
    ours, hf = DynamicCache(config=CONFIG), DynamicCache(config=CONFIG)
    for cache in (ours, hf):
        cache.update(*_kv(2, 3, 0), 0)
    for i, context in enumerate([torch.inference_mode, torch.no_grad, torch.inference_mode,
                                 torch.no_grad]):
        k, v = _kv(2, 1, i + 1)
        with context():
            append_kv(ours, k, v, 0)
            hf.update(k, v, 0)
        _same(ours, hf)


def _chain_step(cache: DynamicCache, k: torch.Tensor, v: torch.Tensor) -> None:
    """What a LayerChain step does to the cache: kv_rooms, token n written into every layer's
    room (the C side does it there), commit_kv."""
    rooms, n = kv_rooms(cache, len(cache.layers), 2, 16)
    for kb, vb in rooms:
        kb[:, :, n] = k[:, :, 0]
        vb[:, :, n] = v[:, :, 0]
    commit_kv(cache, rooms, n)


def test_chained_steps_after_every_cache_operation(monkeypatch):
    """kv_rooms takes the layers commit_kv left (the same tensor objects) without its full
    checks; a crop, a reorder, append_kv's own update or a switch out of inference_mode rebinds
    or invalidates them, and the next step starts from what the layers hold then."""
    ours, hf = DynamicCache(config=CONFIG), DynamicCache(config=CONFIG)
    for cache in (ours, hf):
        cache.update(*_kv(1, 4, 0), 0)
        cache.update(*_kv(1, 4, 0), 1)
    seed = 1

    def step(how=_chain_step):
        nonlocal seed
        k, v = _kv(1, 1, seed)
        seed += 1
        for layer in range(2):
            if how is append_kv:
                append_kv(ours, k, v, layer)
            hf.update(k, v, layer)
        if how is _chain_step:
            _chain_step(ours, k, v)
        _same(ours, hf)

    checked = []
    full_checks = fused._plain_layer
    monkeypatch.setattr(fused, "_plain_layer", lambda layer: checked.append(layer) or
                        full_checks(layer))
    with torch.inference_mode():
        for _ in range(KV_SPARE_MIN + 3):  # past the first room: a new one
            step()
        layer = ours.layers[0]
        assert layer.keys is layer.__dict__["_hfd_committed"][0]()
        # fully checked at the first step and when the room grew; otherwise as committed
        assert len(checked) == 4
        for op in (lambda c: c.crop(-3), lambda c: c.reorder_cache(torch.tensor([0]))):
            op(ours)
            op(hf)
            step()
            step()
        step(append_kv)
        step()
    with torch.no_grad():  # the inference-mode rooms cannot be written here: new ones
        step()
        assert not ours.layers[0].__dict__["_hfd_room"][0].is_inference()
        step()
    # the committed views do not keep a room alive once the layer holds other tensors
    room = weakref.ref(ours.layers[0].__dict__["_hfd_room"][0])
    for cache in (ours, hf):  # a copy of the keys: append_kv makes a room of its own for it
        cache.reorder_cache(torch.tensor([0]))
    step(append_kv)
    gc.collect()
    assert room() is None
