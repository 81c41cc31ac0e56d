"""Continuous batching's single-query rows in one native call (kernels/attention.py:
attention_segments -> attend_rows_native, csrc/cpu_decode.c: hfd_attend_rows).

A packed row's decode requests (one query each, over keys of their own) are attended together
by the native decode layer's attention instead of one torch call per request. Against the
per-request torch path (the same segments, the native rows switched off): bf16 close, with the
keys a mask masks (sliding window), a soft-cap, GQA; counted; one plan per forward; and the
calls it does not take (fp32, sinks, a bias in the mask, head_dim) keep the torch path.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer.injection import paged
from hf_dsinfer.kernels import _native
from hf_dsinfer.kernels import attention as A
from tests.injection.test_continuous_batching import _packed_mask
from tests.kernels.conftest import REDUCTION_TOL, assert_close_tol, count_calls

pytestmark = [pytest.mark.skipif(not _native.builds(),
               reason=f"native CPU kernels unavailable: {_native.why_unavailable()}"),
              pytest.mark.usefixtures("native_tier")]

# three decode requests (one query) and two prefill chunks, one of them longer than its window
Q_LENS, K_LENS = (1, 4, 1, 2, 1), (9, 4, 3, 12, 40)


def _packed(window=None, d=32, dtype=torch.bfloat16, bool_mask=False):
    mask, cu_q, cu_k = _packed_mask(Q_LENS, K_LENS, window)
    found = paged.segments(mask, cu_q, cu_k)
    assert found is not None and sum(q1 - q0 == 1 for q0, q1, _, _ in found) == 3
    if bool_mask:
        mask = mask == 0
    gen = torch.Generator().manual_seed(0)
    t, k = sum(Q_LENS), sum(K_LENS)
    q = torch.randn(1, t, 4, d, generator=gen).to(dtype).transpose(1, 2)  # as the block's q
    kv = [torch.randn(1, 2, k, d, generator=gen).to(dtype) for _ in range(2)]
    return q, kv[0], kv[1], found, mask.to(dtype) if not bool_mask else mask


def _torch_path(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(A, "rows_plan", lambda *a: None)
        return A.attention_segments(*args, **kwargs)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("bool_mask", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_rows_attend_like_the_segments(monkeypatch, window, bool_mask, softcap):
    q, k, v, found, mask = _packed(window, bool_mask=bool_mask)
    want = _torch_path(monkeypatch, q, k, v, found, scale=0.2, mask=mask, softcap=softcap)
    calls = count_calls(monkeypatch, A, "attend_rows_native")
    got = A.attention_segments(q, k, v, found, scale=0.2, mask=mask, softcap=softcap)
    assert len(calls) == 1
    assert_close_tol(got, want, table=REDUCTION_TOL)
    prefill = [seg for seg in found if seg[1] - seg[0] > 1]
    for q0, q1, _, _ in prefill:  # the torch path's own rows: its bits
        assert torch.equal(got[:, :, q0:q1], want[:, :, q0:q1])


def test_a_row_with_no_key_is_zeros(monkeypatch):
    """A decode row whose keys are all masked (padding) gives zeros, as the torch path."""
    q, k, v, found, mask = _packed(bool_mask=True)
    mask = mask.clone()
    mask[0, 0, 0] = False  # request 0's one query reads nothing
    got = A.attention_segments(q, k, v, found, scale=0.2, mask=mask)
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))
    want = _torch_path(monkeypatch, q, k, v, found, scale=0.2, mask=mask)
    assert torch.equal(want[:, :, 0], got[:, :, 0])


def test_planned_once_per_mask_and_segments(monkeypatch):
    q, k, v, found, mask = _packed()
    plans = count_calls(monkeypatch, A, "_plan_rows")
    for _ in range(3):  # the layers of one forward
        A.attention_segments(q, k, v, found, scale=0.2, mask=mask)
    assert len(plans) == 1
    A.attention_segments(q, k, v, list(found), scale=0.2, mask=mask)  # the next forward's
    assert len(plans) == 2


def test_calls_it_does_not_take_keep_the_torch_path(monkeypatch):
    calls = count_calls(monkeypatch, A, "attend_rows_native")
    q, k, v, found, mask = _packed(dtype=torch.float32)
    A.attention_segments(q, k, v, found, scale=0.2, mask=mask)  # fp32
    q, k, v, found, mask = _packed(d=16)
    A.attention_segments(q, k, v, found, scale=0.2, mask=mask)  # head_dim not a multiple of 32
    q, k, v, found, mask = _packed()
    A.attention_segments(q, k, v, found, scale=0.2, mask=mask, sinks=torch.zeros(4))  # sinks
    biased = mask.clone()
    biased[0, 0, 0, 0] = 0.5  # a bias the kernel does not add
    out = A.attention_segments(q, k, v, found, scale=0.2, mask=biased)
    assert not calls
    assert_close_tol(out, _torch_path(monkeypatch, q, k, v, found, scale=0.2, mask=biased))
    A.attention_segments(q, k, v, found, scale=0.2, mask=mask, backend="ref")  # not the CPU path
    assert not calls


def _in_slots(k: torch.Tensor, v: torch.Tensor, seed: int = 1):
    """k, v [1, Hkv, K, D] scattered over a larger cache [S, Hkv, D] (other slots random): the
    SlotRows that stand for them, through a shuffled read index."""
    gen = torch.Generator().manual_seed(seed)
    n = k.shape[2]
    index = torch.randperm(3 * n, generator=gen)[:n]
    slots = []
    for x in (k, v):
        cache = torch.randn(3 * n, x.shape[1], x.shape[3], generator=gen).to(x.dtype)
        cache[index] = x[0].transpose(0, 1)
        slots.append(A.SlotRows(cache, index))
    return slots


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_keys_read_in_place_equal_the_gathered_keys(monkeypatch, window, softcap):
    """Keys and values left in a paged cache (SlotRows over a shuffled read index): the native
    rows kernel reads them through the index and the prefill segments gather their own keys
    only; the result is the gathered tensors' to the bit, and the kernel ran once."""
    q, k, v, found, mask = _packed(window)
    ks, vs = _in_slots(k, v)
    assert torch.equal(ks.rows(), k) and ks.shape == k.shape
    want = A.attention_segments(q, k, v, found, scale=0.2, mask=mask, softcap=softcap)
    calls = count_calls(monkeypatch, A, "attend_rows_native")
    got = A.attention_segments(q, ks, vs, found, scale=0.2, mask=mask, softcap=softcap)
    assert len(calls) == 1
    assert torch.equal(got, want)


def test_keys_in_place_without_the_native_rows(monkeypatch):
    """Where the native kernel does not take the rows (fp32 here), every segment gathers its
    own keys from the slots: the same result as the gathered tensors'."""
    q, k, v, found, mask = _packed(dtype=torch.float32)
    ks, vs = _in_slots(k, v)
    calls = count_calls(monkeypatch, A, "attend_rows_native")
    got = A.attention_segments(q, ks, vs, found, scale=0.2, mask=mask)
    assert not calls
    assert torch.equal(got, A.attention_segments(q, k, v, found, scale=0.2, mask=mask))


def test_slot_rows_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"expected slots \[S, Hkv, D\] and a 1-D index"):
        A.SlotRows(torch.zeros(4, 2), torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("rep", [2, 3, 8, 12])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("case", ["plain", "window", "softcap", "slots"])
def test_heads_sharing_a_kv_head_equal_one_head_at_a_time(rep, d, case):
    """The kernel attends the query heads that share a kv head together (csrc/cpu_decode.c:
    attend_heads: each key and value row read once for up to 8 heads, 16 keys' dot products
    reduced at once): the same bits as the same heads over their own copy of the kv head
    (rep 1, one head at a time), with keys a window masks, a soft-cap, keys read in place, and
    spans of 1 to 40 keys (the 16-key blocks' tails)."""
    gen = torch.Generator().manual_seed(rep * d)
    lens = [1, 7, 16, 17, 40, 33]
    n, hkv, keys = len(lens), 2, sum(lens)
    ends = torch.tensor(lens).cumsum(0)
    spans = torch.stack([torch.arange(n), ends - torch.tensor(lens), ends], 1).contiguous()
    q = torch.randn(1, hkv * rep, n, d, generator=gen).bfloat16()
    k, v = (torch.randn(1, hkv, keys, d, generator=gen).bfloat16() for _ in range(2))
    keep = None
    if case == "window":  # each row reads only its last 5 keys
        keep = torch.zeros(n, keys, dtype=torch.uint8)
        for i, (_, k0, k1) in enumerate(spans.tolist()):
            keep[i, max(k0, k1 - 5):k1] = 1
    softcap = 5.0 if case == "softcap" else None
    wide_k, wide_v = (x.repeat_interleave(rep, dim=1).contiguous() for x in (k, v))
    if case == "slots":
        k, v = _in_slots(k, v)
    want, got = torch.empty_like(q), torch.empty_like(q)
    A.attend_rows_native(q, wide_k, wide_v, spans, keep, 0.125, softcap, want)
    A.attend_rows_native(q, k, v, spans, keep, 0.125, softcap, got)
    assert torch.equal(got, want)
    assert got.abs().sum() > 0


def test_rows_plan_drops_a_keep_that_masks_only_other_requests_keys():
    """Continuous batching's mask masks each decode row's view of the other requests' keys;
    the kernel reads only the row's own span, so the plan passes no keep matrix unless a key
    inside a span is masked (a window)."""
    *_, found, mask = _packed()
    spans, keep, _ = A._plan_rows(found, mask)
    assert keep is None and spans.shape[0] == 3
    *_, found, mask = _packed(window=3)
    spans, keep, _ = A._plan_rows(found, mask)
    assert keep is not None and keep.dtype == torch.uint8
