"""How much memory a placement needs: one formula for the planner's constraints and the load- and
generate-time budget checks (the budget is a promise: the check runs before anything is read or
generated, and the tests hold the measured peak RSS to it).

Host RAM (a CPU compute device has only this one memory):
    resident   non-block weights (embeddings, final norm, lm_head)
               + L x the stored bytes of each layer's device/cpu tiers
    streamed   (1 + overlap) layers of per-use weights, dense, bound while a layer computes
               (the next one is loading meanwhile), plus their 4-bit codes read from disk
    kv         block x (prompt + gen) x L x per-token K/V bytes on the device/cpu tiers,
               plus the prefetched dense copy of one micro-batch's cache (a 4-bit cache on
               the CPU: the codes of two layers' reads, attention runs over them)
    work       per micro-batch activations (hidden, q/k/v, MLP intermediates, attention
               scores) and the whole block's hidden states between layers, logits
With a CUDA compute device the same terms split into device memory (device tiers, streamed
layers, work) and pinned host memory (cpu tiers, one staging buffer).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from hf_dsinfer.errors import DSInferError, OffloadBudgetError
from hf_dsinfer.kernels.quant import DEQUANT_CHUNK_ROWS
from hf_dsinfer.offload.cache import KV_READ_THREADS, attends_in_cache
from hf_dsinfer.offload.compression import compressed_nbytes
from hf_dsinfer.offload.policy import OffloadPolicy, format_bytes

DECODE_SCRATCH = 32 << 20  # allocator slack, decode temporaries of compressed tensors (16 MB)



@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory and cost models need to know about a decoder-only model."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    layer_numel: int  # parameters of one decoder layer
    other_numel: int  # parameters outside the decoder layers (tied ones counted once)
    dtype_bytes: int  # compute dtype
    param_shapes: tuple[tuple[int, ...], ...] = ()  # one layer's parameters, in order
    linear_params: tuple[bool, ...] = ()  # per parameter: an nn.Linear weight?

    @classmethod
    def from_model(cls, model: nn.Module, blocks: list[nn.Module], dtype: torch.dtype):
        from hf_dsinfer.offload.store import linear_weights

        config = model.config
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = _attr(text, ("hidden_size", "n_embd", "d_model"))
        heads = _attr(text, ("num_attention_heads", "n_head"))
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        layer = sum(p.numel() for p in blocks[0].parameters())
        total = sum(p.numel() for p in model.parameters())  # parameters() dedups tied ones
        dims = [max(p.shape) for p in blocks[0].parameters() if p.dim() == 2]
        return cls(len(blocks), hidden, heads, kv_heads, head_dim, max(dims + [hidden]),
                   _attr(text, ("vocab_size",)), layer, total - layer * len(blocks),
                   dtype.itemsize, tuple(tuple(p.shape) for p in blocks[0].parameters()),
                   tuple(linear_weights(blocks[0])))

    def kv_token_bytes(self, compress: bool, group: int) -> float:
        """K and V bytes of one token of one sequence in one layer."""
        values = 2 * self.kv_heads * self.head_dim
        if not compress:
            return values * self.dtype_bytes
        g = group if self.head_dim % group == 0 else self.head_dim
        return compressed_nbytes(values, g)

    def layer_bytes(self, compress: bool, group: int) -> float:
        return (compressed_nbytes(self.layer_numel, group) if compress
                else self.layer_numel * self.dtype_bytes)


def _attr(config, names: tuple[str, ...]) -> int:
    for name in names:
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise DSInferError(f"hf_dsinfer offload: {type(config).__name__} has none of {names}; "
                       "cannot size the model. Fix: use a decoder-only transformer config.")


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Peak bytes by memory and by term."""

    host: dict[str, float]
    device: dict[str, float]

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def device_total(self) -> float:
        return sum(self.device.values())


def footprint(shape: ModelShape, policy: OffloadPolicy, cuda: bool, batch: int, prompt_len: int,
              gen_len: int, per_use_dense: float | None = None,
              fused: bool = True) -> Footprint:
    """Peak memory of `policy` on `shape` for one block of `batch` sequences.

    `per_use_dense` overrides the dense bytes of one layer's per-use weights (the exact store
    knows it; the planner uses the percentages). `fused`: the layers are fused blocks, which
    attend over a 4-bit cache's codes where `attends_in_cache` allows (the planner assumes so;
    the engine knows)."""
    b = shape.dtype_bytes
    stored = shape.layer_bytes(policy.compress_weights, policy.group_size)
    w_dev, w_cpu, _ = (p / 100 for p in policy.weights)
    if per_use_dense is None and shape.param_shapes:  # the store's exact split
        from hf_dsinfer.offload.store import per_use_dense_bytes

        per_use_dense = per_use_dense_bytes(list(shape.param_shapes), policy, b,
                                            list(shape.linear_params), not cuda)
    if per_use_dense is None:  # by the percentages
        resident_dense = 0.0 if policy.compress_weights else (w_dev + w_cpu)
        per_use_dense = (1 - resident_dense) * shape.layer_numel * b
    in_flight = 2 if policy.overlap else 1
    codes = stored * (policy.weights[2] / 100) if policy.compress_weights else 0.0  # disk reads
    streamed = in_flight * (per_use_dense + codes) + DECODE_SCRATCH
    mb = min(batch, policy.micro_batch_size)
    seq = prompt_len + gen_len
    kv_token = shape.kv_token_bytes(policy.compress_cache, policy.group_size)
    c_dev, c_cpu, _ = (p / 100 for p in policy.cache)
    kv_all = batch * seq * shape.num_layers * kv_token
    kv_read = 2 * mb * seq * 2 * shape.kv_heads * shape.head_dim * b  # prefetched + concatenated
    work = _workspace(shape, batch, mb, max(prompt_len, 1))
    others = shape.other_numel * b
    if not cuda and fused and attends_in_cache(policy, torch.device("cpu")):
        # decode attends over the stored codes: the codes read from disk for the layer
        # attending and for the next one, read ahead (RAM tiers give views); nothing dense
        kv_read = 2 * batch * seq * kv_token * policy.cache[2] / 100
    elif not cuda:
        # decode runs the whole block at once: its K/V assembled, the next layer's read ahead,
        # and the raw copies of the file reads in flight: one per reader thread, each of one
        # micro-batch, over at most two layers (at least a whole block's worth, as before)
        block_kv = batch * seq * 2 * shape.kv_heads * shape.head_dim * b
        micro = -(-batch // mb)
        kv_read = 2 * block_kv + max(1, min(KV_READ_THREADS, 2 * micro) / micro) * block_kv
    if not cuda:
        host = {"non-block weights": others, "resident layers": shape.num_layers * stored
                * (w_dev + w_cpu), "streamed layers": streamed, "kv cache": kv_all * (c_dev + c_cpu),
                "kv read": kv_read, "activations": work,
                "prefill dequantized layer": _prefill_dequantized(shape, policy)}
        return Footprint(host, {})
    host = {"cpu-tier layers": shape.num_layers * stored * w_cpu,
            "pinned staging": per_use_dense, "kv cache": kv_all * c_cpu}
    device = {"non-block weights": others, "device-tier layers": shape.num_layers * stored * w_dev,
              "streamed layers": streamed, "kv cache": kv_all * c_dev, "kv read": kv_read,
              "activations": work}
    return Footprint(host, device)


def _prefill_dequantized(shape: ModelShape, policy: OffloadPolicy) -> float:
    """Packed 4-bit linears of one layer dequantized for a prefill (PackedInt4Linear), plus the
    temporaries of dequantizing one chunk of rows of the largest: torch's dequantization (where
    the native kernel does not run) holds ~12 bytes per weight (fp32 codes, products, sums)."""
    from hf_dsinfer.offload.store import is_packed

    shapes = [s for s, lin in zip(shape.param_shapes, shape.linear_params)
              if is_packed(s, lin, policy, True)]
    chunk = max((min(s[0], DEQUANT_CHUNK_ROWS) * s[1] for s in shapes), default=0)
    return sum(math.prod(s) for s in shapes) * shape.dtype_bytes + chunk * 12


def _workspace(shape: ModelShape, batch: int, mb: int, prompt: int) -> float:
    b = shape.dtype_bytes
    per_micro = mb * prompt * (4 * shape.hidden + 2 * shape.ffn) * b
    scores = mb * shape.heads * prompt * prompt * 4  # eager attention materialises fp32 scores
    block_hidden = 3 * batch * prompt * shape.hidden * b  # layer input, output, concatenation
    logits = 3 * batch * shape.vocab * 4
    return per_micro + scores + block_hidden + logits


def check_budget(fp: Footprint, policy: OffloadPolicy, when: str, fix: str) -> None:
    """Raise OffloadBudgetError naming the biggest terms when the footprint exceeds a budget."""
    for memory, total, parts, budget in (
            ("memory (host RAM)", fp.host_total, fp.host, policy.memory),
            ("device_memory", fp.device_total, fp.device, policy.device_memory)):
        if budget is None or total <= budget:
            continue
        terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in
                          sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0)
        raise OffloadBudgetError(
            f"hf_dsinfer offload: {when} needs {format_bytes(total)} of {memory}, the budget is "
            f"{format_bytes(budget)} ({terms}). Fix: {fix}")
