"""Fused blocks under transformers' continuous batching: packed rows over the paged KV cache.

transformers' ContinuousBatchingManager (`generate_batch`, `init_continuous_batching`,
`transformers serve --continuous-batching`) calls the model on every scheduled request at once,
packed into one row: prefill chunks under a token budget and one-token decode steps side by side.
A decoder block then gets hidden_states [1, T, H], position_ids [1, T] (each token's position in
its own request), no dense cache, the attention mask of its layer type [1, 1, T, K]
(additive: 0 where query i may read key j, dtype min elsewhere) and, as keyword arguments:

    cache                       the PagedAttentionCache
    cu_seq_lens_q               [R + 1] query offsets of the R requests in the row
    cu_seq_lens_k, max_length_k {layer type: ...} key offsets / longest key run, per layer type
    read_index, write_index     [per cache allocator] physical slots to read / to write
    block_table                 flash attention's decode fast path (CUDA), else None

HF's attention functions hand these to `cache.update(k, v, layer_idx, kwargs)`, which writes the
T new keys and values at `write_index` and returns every key and value the T queries may read,
[1, Hkv, K, D], in the order of the mask's columns. A fused block does the same, through the
same public method: its projections, norms, rotary, MLP (or MoE) and output projection run on the
packed row as on any [1, T] input (they are per token), and its attention is kernels.attention
over the returned keys with that mask, exactly as for a dense cache with a 4-D mask. Chunked
prefill, decode steps in the same row and prefix sharing (a request reading pages another one
wrote) need nothing more: the read indices and the mask already say which keys each query reads.

A call the fused attention does not take goes to the block's HF forward, which is right under
continuous batching wherever HF's own generate_batch is (`FusedBlock.paged` counts both kinds,
`explain` prints them): no mask (flash attention, whose varlen and block-table kernels read the
cache themselves) and ALiBi positions (the bias would have to follow each request's key offsets).

transformers' BloomModel and GPTJModel do not pass these arguments on to their blocks: their
blocks attend within the packed row only, and HF's own generate_batch returns wrong tokens for
them. An injected model never does: hf.continuous_batching marks each forward that
carries a paged cache, and a block that receives none in such a forward raises.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

import torch

from hf_dsinfer.errors import ContinuousBatchingError
from hf_dsinfer.hf import cache_args
from hf_dsinfer.injection import policy as P
from hf_dsinfer.kernels.attention import SlotRows

if TYPE_CHECKING:
    from hf_dsinfer.injection.fused import FusedBlock

# the keyword arguments `cache.update` reads (the cache itself: hf.cache_args.paged_cache)
UPDATE_ARGS = ("cu_seq_lens_k", "max_length_k", "read_index", "write_index", "block_table")


@dataclasses.dataclass
class PagedStats:
    """One block's continuous-batching calls: fused, and sent to the HF forward (per reason)."""

    calls: int = 0
    segmented: int = 0  # of those, attended per request (`segments`)
    in_place: int = 0  # of those, keys read where the cache keeps them (`read_in_place`)
    deferred: dict[str, int] = dataclasses.field(default_factory=dict)
    refused: int = 0  # calls of a forward with a paged cache that reached the block without it
    # set by hf.continuous_batching for the span of a forward that carries a paged
    # cache: a call of this block without one is then a model that does not pass it on
    expected: bool = False


def layout_why(fused: FusedBlock) -> str | None:
    """Why no continuous-batching call of this block runs fused (None: calls with a mask do)."""
    if fused.policy.positions == P.ALIBI:
        return "ALiBi positions (the bias would follow each request's key offsets): HF forward"
    if fused.policy.mla is not None:
        return "multi-head latent attention (its paged latent cache is not read fused): HF forward"
    return None


def call_why(fused: FusedBlock, named: dict[str, Any]) -> str | None:
    """Why this continuous-batching call goes to the HF forward (None: it runs fused)."""
    if (why := layout_why(fused)) is not None:
        return why
    if named.get("block_table") is not None:
        return "flash attention's block-table decode (it reads the cache itself): HF forward"
    if named.get("attention_mask") is None:
        return "no attention mask (flash attention's varlen kernel): HF forward"
    return None


def cache_of(fused: FusedBlock, named: dict[str, Any]) -> Any:
    """The PagedAttentionCache this block call carries (None: not a continuous-batching call)."""
    return cache_args.paged_cache(named, fused.policy.cache_arg)


def defer_why(fused: FusedBlock, named: dict[str, Any]) -> str | None:
    """Why this continuous-batching call goes to the HF forward (counted), or None: it is not
    one, or it runs fused. Raises when a forward carrying a paged cache reached this block
    without it."""
    if cache_of(fused, named) is None:
        if fused.paged.expected:
            fused.paged.refused += 1
            raise _not_passed_error(fused)
        return None
    why = call_why(fused, named)
    if why is not None and not torch.compiler.is_compiling():  # mutated counters recompile
        fused.paged.deferred[why] = fused.paged.deferred.get(why, 0) + 1
    return why


def defers(fused: FusedBlock, named: dict[str, Any]) -> bool:
    """True: this call is a continuous-batching call that the HF forward computes."""
    return defer_why(fused, named) is not None


def update(fused: FusedBlock, cache: Any, k: torch.Tensor, v: torch.Tensor,
           named: dict[str, Any]
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]] | None]:
    """Write the row's new k, v [1, Hkv, T, D] into the paged cache and return the keys and
    values its queries may read, [1, Hkv, K, D] with K the mask's last dimension, and the
    requests' segments of the row (see `segments`; None: attend over the whole row)."""
    kwargs = {name: named[name] for name in UPDATE_ARGS if name in named}  # update edits it
    direct = None if torch.compiler.is_compiling() else read_in_place(
        cache, k, v, fused.spec.layer_idx, kwargs)
    keys, values = direct or cache.update(k, v, fused.spec.layer_idx, kwargs)
    mask = named["attention_mask"]
    if keys.shape[2] != mask.shape[-1]:
        raise ContinuousBatchingError(
            f"continuous batching: the paged cache returned {keys.shape[2]} keys for layer "
            f"{fused.spec.layer_idx} but its attention mask has {mask.shape[-1]} columns "
            f"(mask {tuple(mask.shape)}). The cache's read indices and the mask disagree, so "
            "attention would mix requests. Fix: report this with your transformers version.")
    if torch.compiler.is_compiling():  # a traced call attends over the whole row
        return keys, values, None
    fused.paged.calls += 1  # as FusedBlock.calls, counted outside a trace only
    cu_k = kwargs.get("cu_seq_lens_k")  # cache.update picked this layer type's offsets
    found = segments(mask, named.get("cu_seq_lens_q"), cu_k)
    if found is not None:
        fused.paged.segmented += 1
    if isinstance(keys, SlotRows):
        if found is None:  # attention over the whole row: the keys as HF's update returns them
            keys, values = keys.rows(), values.rows()
        else:
            fused.paged.in_place += 1
    return keys, values, found


# Per cache allocator (held weakly): True once a call of HF's own update showed that its token
# views and read index are what read_in_place reads; False when they were not.
_verified: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_in_place(cache: Any, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                  kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """HF's index-based `cache.update` for a full-attention layer, without its gather: the new
    k, v [1, Hkv, T, D] written at the write index as HF writes them, and the keys / values the
    queries may read returned as SlotRows over the layer's cache (HF's read index, left in
    place) instead of `index_select` copies of every key of the batch, made for each layer of
    every forward (HF's update was 9% of a served SmolLM2's generation thread at 16 clients,
    py-spy; without the copies `generate_batch` ran 7-8% faster: docs/performance.md). kwargs
    get the layer type's key offsets, as from `cache.update`. None (nothing done): another
    cache or allocator (sliding windows, flash's block table), no key to read, or HF's update
    did not match at its first call for this allocator: that call ran HF's `update` and checked
    that the slots it wrote and the rows it returned are the ones read here, so a transformers
    whose cache differs runs its own update (this reads its attributes, not a public API)."""
    if kwargs.get("block_table") is not None or "read_index" not in kwargs:
        return None
    try:
        allocator = cache.layer_to_allocator[layer_idx]
        views = allocator._kv_token_views[layer_idx]
        slot_index, layer_type = allocator.index, allocator.layer_type
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    if type(allocator).__name__ != "FullAttentionCacheAllocator":
        return None
    read, write = kwargs["read_index"][slot_index], kwargs["write_index"][slot_index]
    if read.numel() == 0:
        return None  # HF returns the new k, v themselves: no gather to skip
    k_slots, v_slots = views
    verdict = _verified.get(allocator)
    if verdict is None:  # first call: HF's update, then is it what we would have done?
        keys, values = cache.update(k, v, layer_idx, kwargs)
        new_k, new_v = (x.squeeze(0).transpose(0, 1) for x in (k, v))
        verdict = bool(
            torch.equal(k_slots.index_select(0, write), new_k)
            and torch.equal(v_slots.index_select(0, write), new_v)
            and torch.equal(SlotRows(k_slots, read).rows(), keys)
            and torch.equal(SlotRows(v_slots, read).rows(), values))
        _verified[allocator] = verdict
        return keys, values  # HF's own result for this call
    if not verdict:
        return None
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][layer_type].to(torch.int32)
    kwargs["max_length_k"] = kwargs["max_length_k"][layer_type]
    k_slots.index_copy_(0, write, k.squeeze(0).transpose(0, 1))
    v_slots.index_copy_(0, write, v.squeeze(0).transpose(0, 1))
    read = read.to(torch.int64)  # one index tensor for both (HF's is int64 already)
    return SlotRows(k_slots, read), SlotRows(v_slots, read)


# the last (mask, query offsets, key offsets) checked, and its segments: every layer of one
# type gets the same mask object in one forward, so the check runs once per forward and type.
# The mask is held, so a later forward's mask cannot take its id. One tuple, read once and
# replaced whole, so two managers' threads never see each other's halves.
_last_checked: tuple[Any, list[int], list[int], Any] = (None, [], [], None)


def segments(mask: torch.Tensor, cu_q: Any, cu_k: Any
             ) -> list[tuple[int, int, int, int]] | None:
    """(q0, q1, k0, k1) per request of the packed row: its queries q0:q1 and the keys k0:k1
    that the cache returned for it (transformers' `cu_seq_lens_q` / `cu_seq_lens_k`), when the
    mask [1, 1, T, K] lets each request's queries read its own keys only; None when it does not
    (or the offsets are missing or do not cover the row): then attention runs over the whole
    row with the mask, as HF's does. Attending per segment computes the same softmax over the
    same unmasked keys, and skips the T x K block products of other requests' keys. One request
    is one segment: its keys stay in the cache (read_in_place) and a causal block attends
    without the mask (kernels.attention.causal_segments)."""
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        return None
    qs, ks = cu_q.tolist(), cu_k.tolist()
    global _last_checked
    last = _last_checked
    if last[0] is mask and last[1] == qs and last[2] == ks:
        return last[3]
    found = _block_diagonal(mask, qs, ks)
    _last_checked = (mask, qs, ks, found)
    return found


# the last query offsets checked by decode_only and the verdict: every layer of a forward gets the
# same tensor (held, so a later forward's cannot take its id); one tuple, replaced whole
_last_decode_only: tuple[Any, int, bool] = (None, 0, False)


def decode_only(named: dict[str, Any], t: int) -> bool:
    """True: the packed row of this continuous-batching call holds one token of each of t
    requests (cu_seq_lens_q is 0, 1, ..., t): decode steps only, no prefill chunk."""
    cu_q = named.get("cu_seq_lens_q")
    if not isinstance(cu_q, torch.Tensor) or cu_q.dim() != 1 or cu_q.numel() != t + 1:
        return False
    global _last_decode_only
    last = _last_decode_only
    if last[0] is cu_q and last[1] == t:
        return last[2]
    found = bool(torch.equal(cu_q.cpu(), torch.arange(t + 1, dtype=cu_q.dtype)))
    _last_decode_only = (cu_q, t, found)
    return found


def _block_diagonal(mask: torch.Tensor, qs: list[int], ks: list[int]
                    ) -> list[tuple[int, int, int, int]] | None:
    t, k = mask.shape[-2], mask.shape[-1]
    if (mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or len(qs) != len(ks)
            or len(qs) < 2 or qs[0] != 0 or ks[0] != 0 or qs[-1] != t or ks[-1] != k
            or qs != sorted(qs) or ks != sorted(ks)):
        return None
    found = [(q0, q1, k0, k1) for q0, q1, k0, k1 in zip(qs, qs[1:], ks, ks[1:]) if q1 > q0]
    if not found:
        return None
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] > torch.finfo(mask.dtype).min
    own = torch.zeros_like(allowed)
    for q0, q1, k0, k1 in found:
        own[q0:q1, k0:k1] = True
    if bool((allowed & ~own).any()):  # a query may read another request's key
        return None
    return found


def _not_passed_error(fused: FusedBlock) -> ContinuousBatchingError:
    model = type(fused.block).__name__.removesuffix("Block").removesuffix("DecoderLayer")
    return ContinuousBatchingError(
        f"continuous batching: the model's forward received transformers' paged KV cache but "
        f"did not pass it on to its decoder block {type(fused.block).__name__} "
        f"(layer {fused.spec.layer_idx}): this transformers version's {model} model code does "
        "not support continuous batching, and its blocks could only attend within the packed "
        "row (HF's own generate_batch returns wrong tokens for it). Fix: use model.generate() "
        "for this family.")
