"""The block schedule under HF generate(): token -> layer -> micro-batch, with overlapped I/O.

generate() runs unchanged (logits processors, stopping criteria, sampling, streamers, pipeline);
two instance-level changes make its forward passes FlexGen's schedule:

1. `model.generate` (an instance attribute, the precedent transformers itself uses) gives each
   call a `BlockCache` (one cache per micro-batch, on its tiers) and runs a batch larger than
   the policy's block as consecutive blocks.
2. Every decoder layer's `forward` is an `OffloadedLayer`: it makes the layer's weights resident
   (waiting for the prefetch thread, which by then has usually finished), starts loading layer
   j+1, runs the wrapped forward (the FusedBlock, or HF's) once per micro-batch with that
   micro-batch's rows and cache view while the next micro-batch's cache is being read, and
   drops the weights again. Each token therefore reads every layer's weights once for the whole
   block, and the I/O of step n+1 overlaps the compute of step n (FlexGen's loop order).

Threads, not processes: disk reads (`os.preadv`) and torch kernels release the GIL, so one I/O
thread for weights and KV_READ_THREADS for the cache overlap the compute thread on the CPU. On
CUDA the loader copies through pinned buffers on a side stream and synchronises that stream before
handing the layer over, so the compute stream never waits on a copy it did not need.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_dsinfer import state
from hf_dsinfer.errors import DSInferError
from hf_dsinfer.hf import cache_args
from hf_dsinfer.kernels import crossovers
from hf_dsinfer.kernels.quant import Int4Weight
from hf_dsinfer.offload.cache import KV_READ_THREADS, BlockCache, attends_in_cache
from hf_dsinfer.offload.memory import ModelShape, check_budget, footprint
from hf_dsinfer.offload.packed import PackedInt4Linear
from hf_dsinfer.offload.policy import OffloadPolicy, format_bytes
from hf_dsinfer.offload.store import WeightStore

_KV_DIRS = itertools.count()


class OffloadEngine:
    """One offloaded model's weight store, I/O threads and timing counters."""

    def __init__(self, blocks: list[nn.Module], store: WeightStore, policy: OffloadPolicy,
                 device: torch.device, shape: ModelShape):
        self.blocks = blocks
        self.shape = shape
        self.store = store
        self.policy = policy
        self.device = device
        self.weight_io = ThreadPoolExecutor(1, "dsinfer-weights") if policy.overlap else None
        self.cache_io = (ThreadPoolExecutor(KV_READ_THREADS, "dsinfer-cache") if policy.overlap
                         else None)
        self._pending: dict[int, tuple[torch.Tensor, Future]] = {}  # prefetches in flight
        self._bound: dict[int, torch.Tensor] = {}  # layer -> the buffer its weights live in
        self._free: list[torch.Tensor] = []  # layer buffers not in use (at most two exist)
        self._params = [_param_slots(block, store) for block in blocks]
        self.packed = [[m for m in block.modules() if isinstance(m, PackedInt4Linear)]
                       for block in blocks]
        # load_s: weight reads (+ decode) on the I/O thread; wait_s: compute waiting for them;
        # compute_s: inside the layer forwards (includes waiting for the KV cache reads)
        # kv_read_s: KV cache reads (summed over the threads that read, so it can exceed the
        # wall time); kv_wait_s: compute waiting for them
        # kv_attend: decode layer steps that attended over the stored 4-bit codes
        self.stats = {"loads": 0, "load_s": 0.0, "wait_s": 0.0, "compute_s": 0.0,
                      "kv_read_s": 0.0, "kv_wait_s": 0.0, "kv_attend": 0}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        raise DSInferError(
            "a model with streamed offload cannot be copied or pickled (copy.deepcopy, pickle, "
            "torch.save of the module): its weights live in the offload store and I/O threads "
            "stream them in. Fix: instead of copying it, load a second model the same way "
            "(from_pretrained(path, dsinfer={'offload': ...})).")

    # -- weights --------------------------------------------------------------------------------
    def _timed_load(self, j: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        weights = self.store.load(j, buffer)
        with self._lock:
            self.stats["loads"] += 1
            self.stats["load_s"] += time.perf_counter() - start
        return weights

    def _take_buffer(self) -> torch.Tensor:
        return self._free.pop() if self._free else self.store.new_buffer()

    def acquire(self, j: int) -> None:
        """Bind layer j's weights (prefetched when overlapping) and start loading layer j+1."""
        start = time.perf_counter()
        pending = self._pending.pop(j, None)
        if pending is None:
            buffer = self._take_buffer()
            weights = self._timed_load(j, buffer)
        else:
            buffer, weights = pending[0], pending[1].result()
        self.stats["wait_s"] += time.perf_counter() - start
        self._bound[j] = buffer
        if self.weight_io is not None:
            nxt = (j + 1) % len(self.blocks)
            if nxt not in self._pending and nxt not in self._bound:
                spare = self._take_buffer()
                self._pending[nxt] = (spare, self.weight_io.submit(self._timed_load, nxt, spare))
        for name, tensor in weights.items():
            module, attr, _ = self._params[j][name]
            if isinstance(tensor, Int4Weight):
                module.bind(tensor)
            else:
                module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)

    def release(self, j: int) -> None:
        for module in self.packed[j]:
            module.dense = None
        for module, attr, placeholder in self._params[j].values():
            if placeholder is None:
                module.unbind()
            else:
                module._parameters[attr] = placeholder
        buffer = self._bound.pop(j, None)
        if buffer is not None:
            self._free.append(buffer)

    def drain(self) -> None:
        """Wait for and drop prefetched layers (end of a generate call)."""
        for buffer, future in self._pending.values():
            future.result()
            self._free.append(buffer)
        self._pending.clear()

    def close(self) -> None:
        self.drain()
        for pool in (self.weight_io, self.cache_io):
            if pool is not None:
                pool.shutdown(wait=True)
        self.store.close()

    @property
    def attends(self) -> bool:
        """Every layer's forward is a fused block that asks the cache to attend over its codes
        (FusedBlock.attends_in_cache): then reads ahead fetch codes, not dense K/V."""
        return all(getattr(getattr(block.forward, "inner", None), "attends_in_cache", False)
                   for block in self.blocks)

    def describe(self) -> str:
        """One line for `explain`: policy, bytes per tier, compute device."""
        tiers = ", ".join(f"{tier} {format_bytes(self.store.layer_bytes((tier,)) * len(self.blocks))}"
                          for tier in ("device", "cpu", "disk") if self.store.layer_bytes((tier,)))
        attention = ""
        if self.policy.compress_cache:
            attention = ("\noffload: decode attention over the stored 4-bit KV codes "
                         "(kv_attend counts the layer steps)"
                         if self.attends and attends_in_cache(self.policy, self.device) else
                         "\noffload: decode attention over the 4-bit KV cache decoded to dense "
                         "K/V (attention over the codes needs a CPU compute device, the native "
                         "kernels and fused blocks without ALiBi)")
        fetch = "" if self.store.fetch is None else f"\noffload: {self.store.fetch.describe()}"
        return (f"offload: {self.policy.describe()}\n"
                f"offload: decoder-layer weights as stored: {tiers}; compute on {self.device}; "
                f"{len(self.blocks)} layers run by OffloadedLayer (block schedule){attention}"
                f"{fetch}")

    def check_budget(self, batch: int, prompt_len: int, gen_len: int) -> None:
        """Before a generate() block starts: do its KV cache and activations fit the budget?"""
        per_use = sum(s.buffer_nbytes for s in self.store.slots if not s.bound)
        fp = footprint(self.shape, self.policy, self.device.type == "cuda", batch, prompt_len,
                       gen_len, per_use, self.attends)
        check_budget(fp, self.policy, f"generating {gen_len} tokens after {prompt_len} for "
                     f"{batch} sequences", "pass fewer sequences per block (micro_batch_size / "
                     "num_micro_batches), move the KV cache to disk (cache=(0, x, 100 - x)), turn "
                     "on compress_cache, or raise the budget. `hf-dsinfer plan` picks a policy "
                     "that fits.")

    def reset_stats(self) -> None:
        # a prefetch still in flight belongs to the period before the reset: let it count there
        # (otherwise it lands in the new period on one rank and not on another)
        for _, future in list(self._pending.values()):
            future.result()
        for key in self.stats:  # in place: a running BlockCache holds this dict
            self.stats[key] = 0 if key in ("loads", "kv_attend") else 0.0


def _param_slots(block: nn.Module, store: WeightStore) -> dict[str, tuple[nn.Module, str, Any]]:
    """name -> (owning module, attribute, meta placeholder) for the per-use (non-bound) slots."""
    out = {}
    for slot in store.slots:
        if slot.bound:
            continue
        path, _, attr = slot.name.rpartition(".")
        module = block.get_submodule(path) if path else block
        placeholder = None if slot.packed else nn.Parameter(
            torch.empty(slot.shape, dtype=slot.dtype, device="meta"), requires_grad=False)
        out[slot.name] = (module, attr, placeholder)
    return out


# -- the decoder-layer wrapper ---------------------------------------------------------------------
class OffloadedLayer:
    """Installed as `block.forward`: weights in, micro-batch loop, weights out."""

    def __init__(self, engine: OffloadEngine, index: int, block: nn.Module, inner):
        self.engine = engine
        self.index = index
        self.block = block
        self.inner = inner  # the forward that was installed before (FusedBlock or HF's)
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]
        self._arg_names = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = dict(zip(self._arg_names, args))
        named.update(kwargs)
        self.engine.acquire(self.index)
        try:
            self.calls += 1
            return self._run(named)
        finally:
            self.engine.release(self.index)

    def _run(self, named: dict[str, Any]) -> Any:
        cache_arg = next((n for n in cache_args.NAMES if isinstance(named.get(n), BlockCache)), None)
        if cache_arg is None:  # a forward outside our generate(): the whole batch at once
            return self.inner(**named)
        cache: BlockCache = named[cache_arg]
        if self._whole_block(named["hidden_states"]):
            return self._run_whole_block(named, cache)
        batch = named["hidden_states"].shape[0]
        self._materialize_packed(named["hidden_states"], min(cache.rows))
        outs, start = [], 0
        for m, rows in enumerate(cache.rows):
            self._prefetch_next_cache(cache, m)
            part = {k: _rows(k, v, start, start + rows, batch) for k, v in named.items()}
            part[cache_arg] = cache.view(m)
            part["hidden_states"] = part["hidden_states"].to(self.engine.device)
            outs.append(self._park(self._compute(part)))
            start += rows
        return _merge(outs)

    def _materialize_packed(self, hidden: torch.Tensor, rows: int) -> None:
        """Prefill: packed 4-bit linears are dequantized once for all micro-batches (release()
        drops the dense copies with the codes)."""
        if rows * hidden.shape[1] <= crossovers.rows().int4_codes_max_rows(hidden.dtype):
            return
        for module in self.engine.packed[self.index]:
            module.materialize(hidden.dtype)

    def _whole_block(self, hidden: torch.Tensor) -> bool:
        """Decode steps on a CPU compute device run the whole block in one call: micro-batches
        exist to bound device memory (FlexGen's GPU), and on the CPU each one would stream the
        layer's weights from RAM again for a few rows. Prefill keeps the micro-batches (their
        activations are what the budget bounds)."""
        return self.engine.device.type == "cpu" and hidden.shape[1] == 1  # [B, 1, H]

    def _run_whole_block(self, named: dict[str, Any], cache: BlockCache) -> Any:
        """The block's rows at once; each micro-batch's cache is updated and read by the
        BlockCache itself, and the next layer's caches are read ahead meanwhile."""
        io = self.engine.cache_io
        if io is not None and self.index + 1 < len(cache.layers):
            cache.layers[self.index + 1].prefetch_block(io)
        self._materialize_packed(named["hidden_states"], named["hidden_states"].shape[0])
        return self._compute(named)

    def _compute(self, named: dict[str, Any]) -> Any:
        start = time.perf_counter()
        out = self.inner(**named)
        self.engine.stats["compute_s"] += time.perf_counter() - start
        return out

    def _prefetch_next_cache(self, cache: BlockCache, m: int) -> None:
        io = self.engine.cache_io
        if io is None:
            return
        if m + 1 < len(cache.rows):
            cache.layers[self.index].prefetch_micro(m + 1, io)
        elif self.index + 1 < len(cache.layers):
            cache.layers[self.index + 1].prefetch_micro(0, io)

    def _park(self, out):
        """Activations on the CPU tier (CUDA compute): hidden states wait on the host between
        layers; the last layer hands the final norm a device tensor."""
        policy, device = self.engine.policy, self.engine.device
        last = self.index == len(self.engine.blocks) - 1
        if policy.activations[1] == 100 and device.type == "cuda" and not last:
            first = out[0] if isinstance(out, tuple) else out
            parked = first.to("cpu", non_blocking=False)
            return (parked, *out[1:]) if isinstance(out, tuple) else parked
        return out


def _rows(name: str, value: Any, start: int, stop: int, batch: int) -> Any:
    """The micro-batch rows of one layer argument (batch-major tensors only)."""
    if isinstance(value, tuple):  # position_embeddings (cos, sin)
        return tuple(_rows(name, v, start, stop, batch) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or batch == stop - start:
        return value
    if value.shape[0] == batch:
        return value[start:stop]
    if name == "alibi" and value.shape[0] % batch == 0:  # [B * heads, 1, S]
        per = value.shape[0] // batch
        return value[start * per: stop * per]
    return value


def _merge(outs: list[Any]) -> Any:
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=0)
    merged = []
    for items in zip(*outs):
        tensors = all(isinstance(x, torch.Tensor) for x in items)
        merged.append(torch.cat(items, dim=0) if tensors else items[0])
    return tuple(merged)


# -- generate() ------------------------------------------------------------------------------------
def offload_generate(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model.generate` of an offloaded model: one BlockCache per block of the batch."""
    engine: OffloadEngine = state.get(model, "engine")
    generate = functools.partial(type(model).generate, model)
    if cache_args.model_cache(kwargs) is not None:
        return generate(*args, **kwargs)  # the caller's own cache: no micro-batching
    if args:
        kwargs["inputs"], args = args[0], args[1:]
    batch_inputs = _batch_tensors(kwargs)
    batch = next(iter(batch_inputs.values())).shape[0] if batch_inputs else 1
    block = engine.policy.block_size
    outputs = []
    for start in range(0, batch, block):
        part = {**kwargs, **{k: v[start:start + block] for k, v in batch_inputs.items()}}
        outputs.append(_generate_block(model, engine, generate, args, part))
    return outputs[0] if len(outputs) == 1 else _join_blocks(model, outputs, kwargs)


def _batch_tensors(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    lead = next((kwargs[k] for k in ("inputs", "input_ids", "inputs_embeds")
                 if isinstance(kwargs.get(k), torch.Tensor)), None)
    if lead is None:
        return {}
    return {k: v for k, v in kwargs.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == lead.shape[0]}


def _generate_block(model, engine: OffloadEngine, generate, args, kwargs: dict[str, Any]):
    rows = _micro_rows(_block_batch(kwargs), engine.policy.micro_batch_size)
    prompt, total = _lengths(model, kwargs)
    engine.check_budget(sum(rows), prompt, total - prompt)
    cache = BlockCache(len(engine.blocks), rows, engine.policy, engine.device,
                       _kv_folder(engine.policy), total, engine.stats, engine.attends)
    try:
        return generate(*args, **cache_args.with_cache(kwargs, cache))
    finally:
        engine.drain()
        cache.close()


def _block_batch(kwargs: dict[str, Any]) -> int:
    tensors = _batch_tensors(kwargs)
    return next(iter(tensors.values())).shape[0] if tensors else 1


def _micro_rows(batch: int, micro: int) -> list[int]:
    return [min(micro, batch - s) for s in range(0, batch, micro)]


def _kv_folder(policy: OffloadPolicy) -> Path | None:
    if policy.cache[2] == 0:
        return None
    import os

    folder = Path(policy.offload_dir) / "kv" / f"{os.getpid()}_{next(_KV_DIRS)}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _lengths(model, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, prompt + new tokens) of a generate() call; RAM cache segments are
    preallocated for the total (and grow if a call runs longer)."""
    config = kwargs.get("generation_config") or model.generation_config
    lead = next(iter(_batch_tensors(kwargs).values()), None)
    prompt = lead.shape[1] if lead is not None and lead.dim() > 1 else 1
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    total = prompt + new if new else kwargs.get("max_length", config.max_length or prompt + 20)
    return prompt, max(total, prompt + 1)


def _join_blocks(model, outputs: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise DSInferError(
            "hf_dsinfer offload: a batch larger than the policy's block "
            "(micro_batch_size x num_micro_batches) runs as several blocks, and their "
            "return_dict_in_generate outputs cannot be joined. Fix: pass at most one block of "
            "sequences per generate() call, or raise num_micro_batches.")
    config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    pad = pad if pad is not None else (config.eos_token_id or 0)
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    width = max(o.shape[1] for o in outputs)
    padded = [torch.nn.functional.pad(o, (0, width - o.shape[1]), value=int(pad))
              for o in outputs]
    return torch.cat(padded, dim=0)
