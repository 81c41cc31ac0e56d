"""The parity gate: prove, at injection time, that fused blocks compute what HF computes.

The model runs twice on the same probe, a left-padded prefill of 2 sequences followed by one
cached decode step, once with the HF forwards and once fused (for a model loaded sharded, once,
with unsharded reference blocks replaying the recorded calls: see run_parity_gate). Every block's output is captured
by a forward hook and compared at the non-padded positions; a block class passes when its
worst relative L2 error is within the tolerance for the model's dtype. Comparing per block
(not only the logits) says *which* class broke.

In the fused run each fused block is handed the hidden states its HF twin received (a forward
pre-hook), so each block's error is its own, not the sum of every earlier block's rounding. In
half precision those sums grow with depth and with the reference's own op order: SmolLM2-135M
in bf16 passed at 8.4e-3 on this CPU's torch kernels and failed at 4.7e-2 with the same fused
blocks once oneDNN was capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, as on a CPU without AVX-512),
while HF's own bf16 run is 6e-3 to 6e-2 from its fp32 run either way. A block that computes
the wrong thing still misses by > 1e-1 on its own input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from hf_dsinfer.hf import cache_args
from hf_dsinfer.injection.paths import PathRecord

# Relative L2 error ||fused - hf|| / ||hf|| of a block's output. fp32 differences come only from
# summation order (~1e-7); half precision rounds every op (~1e-3 .. 5e-3 per block measured on
# SmolLM2 in bf16); a real bug (wrong rotary dims, wrong head split) gives > 1e-1.
PARITY_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
PROBE_BATCH, PROBE_LEN, PROBE_PAD = 2, 7, 2
# MoE routing: a token whose k-th and (k+1)-th expert probabilities differ by less than this (in
# the HF run) may legally pick the other expert when the fused block's input differs by rounding;
# such a token is left out of the comparison from that block on (its residual stream diverges).
MOE_TIE_MARGIN = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclasses.dataclass
class ParityResult:
    block_class: str
    max_rel_err: float
    tolerance: float
    blocks_checked: int

    @property
    def passed(self) -> bool:
        return self.max_rel_err <= self.tolerance

    def summary(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return f"{verdict}: rel-err {self.max_rel_err:.1e} (tol {self.tolerance:.0e})"


def _probe_inputs(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (PROBE_BATCH, PROBE_LEN + 1), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, :PROBE_PAD] = 0  # left padding on the second row
    return ids, mask


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden states a decoder block was called with (first positional argument, or the
    `hidden_states` keyword), or None."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


@torch.no_grad()
def _run_probe(model: nn.Module, blocks: list, ids: torch.Tensor, mask: torch.Tensor,
               with_inputs: bool = False, inputs: dict[int, list] | None = None,
               record_inputs: dict[int, list] | None = None) -> dict[int, Any]:
    """Per block: the outputs of the prefill and of the decode step, concatenated on seq; with
    `with_inputs`, also each call's (args, kwargs) so a reference block can replay them.
    `record_inputs` (block index -> list) collects a copy of each call's hidden states; `inputs`
    (the same, from an earlier run) hands call k of block i the k-th recorded hidden states in
    place of its own (where the shapes agree)."""
    captured: dict[int, list] = {i: [] for i in range(len(blocks))}

    def hook(index):
        def record(_module, args, kwargs, output):
            out = (output[0] if isinstance(output, tuple) else output).detach().float().clone()
            captured[index].append((args, dict(kwargs), out) if with_inputs else out)
        return record

    def pre_hook(index):
        seen = [0]

        def swap(_module, args, kwargs):
            call, seen[0] = seen[0], seen[0] + 1
            if record_inputs is not None:
                hidden = _hidden_of(args, kwargs)
                record_inputs[index].append(None if hidden is None else hidden.detach().clone())
            if inputs is None or call >= len(inputs[index]) or inputs[index][call] is None:
                return None
            forced = inputs[index][call]
            if args and isinstance(args[0], torch.Tensor) and args[0].shape == forced.shape:
                return (forced.to(args[0].dtype), *args[1:]), kwargs
            hidden = kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.shape == forced.shape:
                return args, {**kwargs, "hidden_states": forced.to(hidden.dtype)}
            return None
        return swap

    handles = [f.block.register_forward_hook(hook(i), with_kwargs=True)
               for i, f in enumerate(blocks)]
    if inputs is not None or record_inputs is not None:
        handles += [f.block.register_forward_pre_hook(pre_hook(i), with_kwargs=True)
                    for i, f in enumerate(blocks)]
    try:
        prefill_and_step(model, ids, mask)
    finally:
        for handle in handles:
            handle.remove()
    if with_inputs:
        return captured
    return {i: torch.cat(outs, dim=1) for i, outs in captured.items()}


def _replay(ref: nn.Module, cache_arg: str, calls: list, config: Any) -> torch.Tensor:
    """A reference block's outputs for the recorded calls of its twin, with a cache of its own."""
    cache = DynamicCache(config=config)
    signature = inspect.signature(type(ref).forward)
    name = cache_args.parameter(type(ref).forward, cache_arg)
    outs = []
    for args, kwargs, _ in calls:
        bound = signature.bind(ref, *args, **kwargs)
        if name is not None and name in bound.arguments:
            bound.arguments[name] = cache
        out = type(ref).forward(*bound.args, **bound.kwargs)
        outs.append((out[0] if isinstance(out, tuple) else out).float())
    return torch.cat(outs, dim=1)


def prefill_and_step(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The probe: prefill all but the last token into a DynamicCache, then one cached decode step
    with the last token. It runs the base model (the decoder stack every head shares): heads
    such as BLOOM's or GPT-J's question answering do not pass a cache on, and their outputs are
    not compared anyway."""
    base = getattr(model, "base_model", model)
    cache = DynamicCache(config=model.config)
    base(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True,
         **{cache_args.KEYWORD: cache})
    base(input_ids=ids[:, -1:], attention_mask=mask, use_cache=True,
         **{cache_args.KEYWORD: cache})


def run_parity_gate(model: nn.Module, blocks: dict[str, Any],
                    references: dict[str, tuple[str, nn.Module]] | None = None
                    ) -> dict[str, ParityResult]:
    """Per block class, the worst relative error of the fused blocks against HF on the probe.
    `blocks`: path -> FusedBlock. The probe's calls count neither as use nor as paths taken.

    Two modes, one comparison:
    - whole weights: the model runs the probe with HF's forwards, then fused, and every block's
      outputs are compared;
    - `references` (class name -> (path, an unsharded HF block)): for a model loaded sharded
      (tensor parallelism), where HF's forward cannot run on the local slices. The sharded model
      runs the probe once, each referenced block's calls are recorded, and the reference
      replays them (parallel/parity.py builds it from the checkpoint). Every rank runs the same
      probe on the same all-reduced outputs, so every rank reaches the same verdict."""
    fused_blocks = list(blocks.values())
    ids, mask = _probe_inputs(model)
    valid = mask.bool()  # [B, S]: compare only real tokens
    dtype = next(model.parameters()).dtype
    tolerance = PARITY_TOLERANCE.get(dtype, 3e-2)
    with _uncounted(fused_blocks), _eval(model):
        if references is not None:
            paths = [path for path, _ in references.values()]
            calls = _run_probe(model, [blocks[p] for p in paths], ids, mask, with_inputs=True)
            results = {}
            for i, (name, (path, ref)) in enumerate(references.items()):
                want = _replay(ref, blocks[path].policy.cache_arg, calls[i], model.config)
                got = torch.cat([out for _, _, out in calls[i]], dim=1)
                results[name] = ParityResult(name, _rel_err(got[valid], want[valid]),
                                             tolerance, 1)
            return results
        reference, fused, margins = _hf_then_fused(model, fused_blocks, ids, mask)
    results: dict[str, ParityResult] = {}
    tied = torch.zeros_like(valid)  # tokens past a routing near-tie in an earlier MoE block
    for i, f in enumerate(fused_blocks):
        moe = getattr(f, "moe", None)
        if moe is not None:
            tied |= margins[id(moe)].to(tied.device) < MOE_TIE_MARGIN.get(dtype, 1e-2)
        err = _rel_err(fused[i][valid & ~tied], reference[i][valid & ~tied])
        name = type(f.block).__name__
        prev = results.get(name)
        worst = max(err, prev.max_rel_err) if prev else err
        count = prev.blocks_checked + 1 if prev else 1
        results[name] = ParityResult(name, worst, tolerance, count)
    return results


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def _hf_then_fused(model: nn.Module, blocks: list, ids: torch.Tensor, mask: torch.Tensor):
    """(HF outputs, fused outputs, routing margins per MoE) of every block on the probe; in the
    fused run each block gets the hidden states HF's run gave it (the module docstring says
    why)."""
    states = [f.enabled for f in blocks]
    moes = [m for f in blocks if (m := getattr(f, "moe", None)) is not None]
    try:
        for f in blocks:
            f.enabled = False
        for m in moes:
            m.margins = []  # the HF run records each token's routing margin
        hidden: dict[int, list] = {i: [] for i in range(len(blocks))}
        reference = _run_probe(model, blocks, ids, mask, record_inputs=hidden)
        margins = {id(m): torch.cat(m.margins, dim=1) for m in moes}  # [B, S] per MoE block
        for f in blocks:
            f.enabled = True
        fused = _run_probe(model, blocks, ids, mask, inputs=hidden)
    finally:
        for f, state in zip(blocks, states):
            f.enabled = state
        for m in moes:
            m.margins = None
    return reference, fused, margins


@contextlib.contextmanager
def _uncounted(blocks: list):
    """The probe does not count as use: calls and paths taken are restored afterwards."""
    moes = [m for f in blocks if (m := getattr(f, "moe", None)) is not None]
    saved = [(f.calls, f.paths) for f in blocks]
    moe_calls = [m.calls for m in moes]
    for f in blocks:
        f.paths = PathRecord()
    try:
        yield
    finally:
        for f, (calls, paths) in zip(blocks, saved):
            f.calls, f.paths = calls, paths
        for m, calls in zip(moes, moe_calls):
            m.calls = calls


@contextlib.contextmanager
def _eval(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
