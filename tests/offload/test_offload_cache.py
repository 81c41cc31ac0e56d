"""The offloaded KV cache's decode-step reads: a prefetched read with room for the new token,
4-bit codes decoded straight into attention's layout, and the pool of read buffers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_dsinfer.kernels.kv_quant import dequantize_kv_int4, quantize_kv_int4
from hf_dsinfer.offload.cache import BlockCache, BufferPool
from hf_dsinfer.offload.policy import OffloadPolicy

CPU = torch.device("cpu")


def test_pool_reuses_only_buffers_nobody_holds():
    pool = BufferPool()
    a = pool.tensor((4, 8), torch.bfloat16, CPU, (4, 16))
    b = pool.tensor((4, 8), torch.bfloat16, CPU, (4, 16))
    assert a.data_ptr() != b.data_ptr()  # a is held: b gets a buffer of its own
    where = a.data_ptr()
    del a
    c = pool.tensor((4, 12), torch.bfloat16, CPU, (4, 16))  # fits a's reserve
    assert c.data_ptr() == where and len(pool._buffers) == 2
    kept = c[1:]  # a view keeps the buffer busy
    del c
    d = pool.tensor((4, 12), torch.bfloat16, CPU)
    assert d.data_ptr() != where and len(pool._buffers) == 3
    raw = pool.take(5000, CPU, 0, 4096)
    assert raw.data_ptr() % 4096 == 0 and raw.numel() == 5000
    assert kept.shape == (3, 12)


@pytest.mark.parametrize("compress", [False, True])
def test_prefetched_decode_steps_read_what_was_stored(compress, tmp_path):
    """Rows split over RAM and disk; a prompt, then decode steps whose cache reads run ahead on
    an I/O thread: every step returns the whole cache as stored (the dense tokens, or the
    decoded 4-bit codes) and the tensors a caller kept from earlier steps stay intact."""
    rows, heads, dim, prompt, steps = 3, 2, 32, 7, 4
    policy = OffloadPolicy(weights=(0, 100, 0), cache=(0, 50, 50), compress_cache=compress,
                           group_size=16, offload_dir=str(tmp_path))
    cache = BlockCache(1, [rows], policy, CPU, tmp_path, prompt + steps)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    ks = torch.randn(rows, heads, prompt + steps, dim, generator=gen).bfloat16()
    vs = torch.randn(rows, heads, prompt + steps, dim, generator=gen).bfloat16()

    def stored(x, n):
        if not compress:
            return x[:, :, :n]
        tokens = x[:, :, :n].permute(2, 0, 1, 3).contiguous()
        codes = quantize_kv_int4(tokens, 16)
        return dequantize_kv_int4(codes, torch.bfloat16).permute(1, 2, 0, 3)

    k, v = layer.update_micro(0, ks[:, :, :prompt], vs[:, :, :prompt])
    assert torch.equal(k, stored(ks, prompt)) and torch.equal(v, stored(vs, prompt))
    # the prompt's cache is the prompt itself: nothing is read back (from disk that read would
    # first flush the pages just written)
    assert cache.stats["kv_read_s"] == 0
    kept = []
    with ThreadPoolExecutor(1) as io:
        for n in range(prompt + 1, prompt + steps + 1):
            layer.prefetch_micro(0, io)
            k, v = layer.update_micro(0, ks[:, :, n - 1:n], vs[:, :, n - 1:n])
            assert torch.equal(k, stored(ks, n)) and torch.equal(v, stored(vs, n))
            kept.append((k, k.clone()))
    assert all(torch.equal(a, b) for a, b in kept)
    assert cache.stats["kv_read_s"] > 0
    cache.close()


@pytest.mark.parametrize("compress", [False, True])
def test_block_prefetch_reads_micro_batches_into_one_tensor(compress, tmp_path):
    """Two micro-batches decoded as one block (the CPU decode step): the read-ahead fills each
    micro-batch's rows of one block tensor, and the whole-block update returns that tensor
    (no assembling copy) with the same values as a block without read-ahead."""
    rows, heads, dim, prompt, steps = [2, 3], 2, 32, 5, 3
    policy = OffloadPolicy(weights=(0, 100, 0), cache=(0, 0, 100), compress_cache=compress,
                           group_size=16, offload_dir=str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    ks = torch.randn(5, heads, prompt + steps, dim, generator=gen).bfloat16()
    vs = torch.randn(5, heads, prompt + steps, dim, generator=gen).bfloat16()
    results = []
    for ahead in (False, True):
        folder = tmp_path / str(ahead)
        folder.mkdir()
        cache = BlockCache(1, rows, policy, CPU, folder, prompt + steps, attends=False)
        layer, got = cache.layers[0], []
        k, v = layer.update(ks[:, :, :prompt], vs[:, :, :prompt])
        first = (quantize_kv_int4(ks[:, :, :prompt].permute(2, 0, 1, 3).contiguous(), 16)
                 if compress else None)
        want = (dequantize_kv_int4(first, torch.bfloat16).permute(1, 2, 0, 3) if compress
                else ks[:, :, :prompt])
        assert torch.equal(k, want) and cache.stats["kv_read_s"] == 0
        with ThreadPoolExecutor(1) as io:
            for n in range(prompt, prompt + steps):
                if ahead:
                    layer.prefetch_block(io)
                    block = layer._block
                k, v = layer.update(ks[:, :, n:n + 1], vs[:, :, n:n + 1])
                if ahead:
                    assert k.data_ptr() == block[0].data_ptr()  # returned as read, no copy
                got.append((k.clone(), v.clone()))
        results.append(got)
        cache.close()
    for (k0, v0), (k1, v1) in zip(*results):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert results[0][-1][0].shape == (5, heads, prompt + steps, dim)


def test_read_ahead_then_several_tokens(tmp_path):
    """A read-ahead sized for one token, then an update of three (a caller feeding a chunk):
    the cache is assembled in new buffers, with every token."""
    policy = OffloadPolicy(weights=(0, 100, 0), cache=(0, 0, 100), offload_dir=str(tmp_path))
    cache = BlockCache(1, [2], policy, CPU, tmp_path, 8)
    layer = cache.layers[0]
    x = torch.randn(2, 2, 8, 16)
    layer.update(x[:, :, :4], x[:, :, :4])
    with ThreadPoolExecutor(1) as io:
        layer.prefetch_block(io)
        k, v = layer.update(x[:, :, 4:7], x[:, :, 4:7])
    assert torch.equal(k, x[:, :, :7]) and torch.equal(v, x[:, :, :7])
    cache.close()
