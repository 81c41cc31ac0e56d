"""transformers' continuous batching on an injected model: its errors reach the caller.

`generate_batch` runs the model in a ContinuousBatchingManager's background thread. An exception
there is logged, the requests in flight are marked failed (`GenerationOutput.error`, a string)
and `generate_batch` returns them with the tokens they had: 0 or 1 tokens and a log line, easy
to take for output. On an injected model (instance attributes and hooks only, removed by
`revert`; no transformers class is touched):

- `model.generate_batch` is HF's, then raises ContinuousBatchingError, chained to the exception
  the manager's thread caught, when a request failed, is missing, or ended before
  max_new_tokens without an end-of-sequence token;
- `model.init_continuous_batching` is HF's; inside generate_batch it keeps the manager it
  returns until generate_batch has read the exception the manager recorded;
- a forward pre-hook and hook mark each forward that carries a PagedAttentionCache on the fused
  blocks (`FusedBlock.paged.expected`), so a block that receives no cache in such a forward
  raises instead of attending within the packed row (injection.paged).

Managers used directly (`init_continuous_batching`, `transformers serve`) report failures per
request in `GenerationOutput.error`, as HF does; only `generate_batch` turns them into raising.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.generation.continuous_batching import (
    ContinuousBatchingManager,
    PagedAttentionCache,
)

from hf_dsinfer import hardware, state
from hf_dsinfer.errors import ContinuousBatchingError

_WRAPPED = ("generate_batch", "init_continuous_batching")
# transformers >= 5.24 runs the manager's thread in its caller's inference mode; before, the
# thread ran outside it and could not update a cache that warmup made in inference mode
THREAD_KEEPS_INFERENCE_MODE = "use_inference_mode" in inspect.signature(
    ContinuousBatchingManager._run_generation_loop).parameters
_ABSENT = object()


def _kv_heads(config: Any) -> int:
    """The model's KV heads, as transformers' paged cache counts them (its find_num_key_value_heads)."""
    for name in ("num_key_value_heads", "num_attention_heads"):
        if (value := getattr(config, name, None)) is not None:
            return int(value)
    raise ContinuousBatchingError("continuous batching: the config names no attention heads")


class ContinuousBatching:
    """What `install` put on one model; `uninstall` removes it."""

    def __init__(self, model: nn.Module, blocks: list[Any]):
        self.model = model
        self.blocks = blocks
        self.marked = False  # blocks' paged.expected, as last set
        self._mesh: DeviceMesh | None = None  # a tensor-parallel model's TP group, as HF takes it
        self._managers: list | None = None  # during generate_batch: the managers it made
        self.hf_generate_batch = type(model).generate_batch.__get__(model)
        self.hf_init_continuous_batching = type(model).init_continuous_batching.__get__(model)
        self._signature = inspect.signature(type(model).generate_batch)
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, always_call=True),
        ]
        model.generate_batch = self.generate_batch
        model.init_continuous_batching = self.init_continuous_batching

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._mark(False)
        for name in _WRAPPED:
            if self.model.__dict__.get(name) == getattr(self, name):
                delattr(self.model, name)

    # -- the paged-cache guard -----------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        paged = isinstance(kwargs.get("cache"), PagedAttentionCache)
        if paged != self.marked:
            self._mark(paged)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.marked:
            self._mark(False)

    def _mark(self, paged: bool) -> None:
        for fused in self.blocks:
            fused.paged.expected = paged
        self.marked = paged

    # -- the wrapped entry points --------------------------------------------------------------
    def init_continuous_batching(self, *args: Any, **kwargs: Any) -> Any:
        with self._tensor_parallel():
            manager = self.hf_init_continuous_batching(*args, **kwargs)
        if self._managers is not None:  # inside generate_batch, which reads its error
            self._managers.append(manager)
        _release_threads_on_start(manager)
        return manager

    @contextlib.contextmanager
    def _tensor_parallel(self) -> Iterator[None]:
        """A tensor-parallel model's manager runs transformers' own TP mode: TP rank 0 is the
        driver (it takes requests and broadcasts each step's schedule), the other ranks follow
        it step by step, so every rank runs the same forwards and their collectives pair up.
        transformers reads the TP group from `model._device_mesh` and sizes the paged cache by
        `num_key_value_heads / tp` when its tp_plan splits k_proj / v_proj: both are set for
        the manager's construction only, and the cache's heads checked against the blocks'."""
        report = state.get(self.model, "report")
        tp = None if report is None else report.tp
        if tp is None:
            yield
            return
        if tp.size != dist.get_world_size():
            raise ContinuousBatchingError(
                f"continuous batching on a tensor-parallel model: tp_size={tp.size} in a world of "
                f"{dist.get_world_size()} processes. transformers' continuous batching drives one "
                "TP group covering the world. Fix: launch exactly tp_size processes (no "
                "pipeline or expert parallelism beside it), or call generate().")
        full = _kv_heads(self.model.config)
        local = {f.spec.num_kv_heads for f in self.blocks}
        if local == {full // tp.size} and full % tp.size == 0:
            plan = {"layers.*.self_attn.k_proj": "colwise", "layers.*.self_attn.v_proj": "colwise"}
        elif local == {full}:
            plan = {}  # every rank keeps every KV head: the cache holds them all
        else:
            raise ContinuousBatchingError(
                f"continuous batching on a tensor-parallel model: the blocks hold {sorted(local)} "
                f"KV heads per rank out of {full}, and transformers' paged cache holds either all "
                f"of them or {full} / tp_size. Fix: a tp_size that divides the {full} KV heads, "
                "or call generate().")
        if self._mesh is None:
            self._mesh = DeviceMesh(self.model.device.type, list(tp.ranks))
        model = self.model
        saved = model.__dict__.get("_device_mesh", _ABSENT), model._tp_plan
        model._device_mesh, model._tp_plan = self._mesh, plan
        try:
            yield
        finally:
            if saved[0] is _ABSENT:
                del model._device_mesh
            else:
                model._device_mesh = saved[0]
            model._tp_plan = saved[1]

    def generate_batch(self, inputs: list[list[int]], *args: Any, **kwargs: Any) -> dict:
        """transformers' generate_batch; raises ContinuousBatchingError where it would return a
        failed, missing or cut-short request."""
        bound = self._signature.bind(self.model, inputs, *args, **kwargs).arguments
        self._managers = []
        try:
            results = self.hf_generate_batch(inputs, *args, **kwargs)
            managers = self._managers
        finally:
            self._managers = None
        fatal = next((m.background_thread_status.fatal_error for m in managers
                      if m.background_thread_status.fatal_error is not None), None)
        expected, max_new_tokens, eos = self._requested(inputs, bound)
        problems = result_problems(results, expected, max_new_tokens, eos)
        if problems or fatal is not None:
            raise ContinuousBatchingError(
                "generate_batch: " + "; ".join(problems or [f"the manager stopped: {fatal!r}"])
                + ". transformers' continuous batching manager caught the error in its thread "
                "(chained below, when it kept it) and would have returned these requests as "
                f"they were. Fix: {_fix(bound)}",
            ) from fatal
        return results

    def _requested(self, inputs: list, bound: dict) -> tuple[int, int | None, set[int]]:
        """(number of requests, max_new_tokens, end-of-sequence ids) as HF's generate_batch and
        add_requests resolve them."""
        config = bound.get("generation_config") or self.model.generation_config
        returns = getattr(config, "num_return_sequences", None) or 1
        max_new = bound.get("kwargs", {}).get("max_new_tokens") or config.max_new_tokens
        eos = config.eos_token_id
        eos = self.model.config.eos_token_id if eos is None else eos
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return len(inputs) * returns, max_new, {int(e) for e in eos}


def _release_threads_on_start(manager: Any) -> None:
    """The manager's `start` (an instance attribute) first releases the starting thread's
    OpenMP workers (hardware.release_openmp_threads): the manager computes on its own thread,
    whose parallel regions would otherwise each pay a wake-up beside the starter's idle pool.
    The starter's next parallel work makes a new pool."""
    start = manager.start

    def start_releasing(*args: Any, **kwargs: Any) -> Any:
        hardware.release_openmp_threads()
        return start(*args, **kwargs)

    manager.start = start_releasing


def _fix(bound: dict) -> str:
    if (torch.is_inference_mode_enabled() and bound.get("warmup", True)
            and not THREAD_KEEPS_INFERENCE_MODE):
        # warmup builds the manager's cache and buffers here, as inference tensors, and its
        # thread (which does not inherit inference mode) then updates them in place
        return ("under torch.inference_mode(), pass warmup=False (or call generate_batch "
                "outside inference mode): HF's warmup makes the cache in inference mode and the "
                "manager's thread cannot update it.")
    return "the chained exception names what failed in the forward."


def result_problems(results: dict, expected: int, max_new_tokens: int | None,
                    eos: set[int]) -> list[str]:
    """What is wrong with generate_batch's results: failed, missing, ended short."""
    problems = []
    failed = {rid: r.error for rid, r in results.items() if r.error is not None}
    if failed:
        rid, error = next(iter(failed.items()))
        problems.append(f"{len(failed)} of {expected} requests failed (first: {rid}: {error})")
    if len(results) < expected:
        problems.append(f"{expected - len(results)} of {expected} requests returned no result")
    if max_new_tokens is not None:
        short = {rid: len(r.generated_tokens) for rid, r in results.items()
                 if r.error is None and len(r.generated_tokens) < max_new_tokens
                 and not (r.generated_tokens and r.generated_tokens[-1] in eos)}
        if short:
            rid, n = next(iter(short.items()))
            problems.append(f"{len(short)} requests ended short without an end-of-sequence token"
                            f" (first: {rid}: {n} of max_new_tokens={max_new_tokens} tokens)")
    return problems


def install(model: nn.Module, blocks: list[Any]) -> ContinuousBatching | None:
    """Install on a model with HF's continuous batching (a *ForCausalLM); None on others."""
    if not all(callable(getattr(type(model), name, None)) for name in _WRAPPED):
        return None
    return ContinuousBatching(model, blocks)


def uninstall(installed: ContinuousBatching | None) -> None:
    if installed is not None:
        installed.uninstall()
