"""Weight-only quantization of the fused blocks' linear layers (ZeroQuant int8, FlexGen-style
4-bit group-wise), applied at load after the parity gate has checked the unquantized blocks.

Each quantized nn.Linear (or transformers Conv1D) is replaced in its parent by a
`QuantizedLinear` holding the packed weight as buffers, so the bf16 weight is freed (the model's
memory footprint shows the compression) and any HF code path that still calls the submodule
(e.g. `output_attentions=True` deferring to the HF forward) computes with the same int weights.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hf_dsinfer.config import QuantConfig
from hf_dsinfer.errors import QuantizationError
from hf_dsinfer.kernels import _dispatch
from hf_dsinfer.kernels.quant import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8Weight,
    linear_int4,
    linear_int8,
    quantize_int4,
    quantize_int8,
)

_QUANT_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                "cuda": (torch.float16, torch.bfloat16, torch.float32)}


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + b with W stored as int8 or packed int4 buffers."""

    def __init__(self, qweight: Int8Weight | Int4Weight, bias: torch.Tensor | None,
                 backend: str | None):
        super().__init__()
        self.bits = 8 if isinstance(qweight, Int8Weight) else 4
        self.backend = backend
        self._fields = [f for f, v in zip(qweight._fields, qweight) if isinstance(v, torch.Tensor)]
        self._static = {f: v for f, v in zip(qweight._fields, qweight)
                        if not isinstance(v, torch.Tensor)}
        for name in self._fields:
            self.register_buffer(name, getattr(qweight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.out_features = qweight.scales.shape[0]
        self._cached: Int8Weight | Int4Weight | None = None
        self._cached_from: tuple[torch.Tensor, ...] = ()  # the buffers _cached was built from

    @property
    def quantized(self) -> Int8Weight | Int4Weight:
        """The weight as the kernels take it, built once per set of buffers (a decode step calls
        every linear; rebuilding the tuple each time cost microseconds per call)."""
        buffers = self._buffers  # not getattr: nn.Module's __getattr__ is slow per buffer
        tensors = tuple(buffers[f] for f in self._fields)
        cached = self._cached
        if cached is not None and all(a is b for a, b in zip(self._cached_from, tensors)):
            return cached
        values = {**self._static, **dict(zip(self._fields, tensors))}
        kind = Int8Weight if self.bits == 8 else Int4Weight
        self._cached = kind(**{f: values.get(f) for f in kind._fields})
        self._cached_from = tensors
        return self._cached

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        op = linear_int8 if self.bits == 8 else linear_int4
        return op(x, self.quantized, bias, backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        group = f", group_size={self._static.get('group_size')}" if self.bits == 4 else ""
        return f"bits={self.bits}, out_features={self.out_features}{group}"


def check_quant_supported(quant: QuantConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise when no quantized path exists for this device/dtype (never run silently in full
    precision instead)."""
    supported = _QUANT_DTYPES  # the int8 and int4 kernels cover the same device/dtype pairs
    names = ", ".join(f"{d}: {[str(t).removeprefix('torch.') for t in ts]}"
                      for d, ts in supported.items())
    if dtype not in supported.get(device.type, ()):
        raise QuantizationError(
            f"quant={{'bits': {quant.bits}}}: no int{quant.bits} weight-only path for "
            f"{device.type} with {dtype}. Supported (device: activation dtypes): {names}. "
            "Fix: load the model on one of those, or drop `quant`."
        )
    if device.type == "cuda" and not _dispatch.triton_available():
        raise QuantizationError(
            f"quant={{'bits': {quant.bits}}} on CUDA needs the Triton kernels. "
            "Fix: `pip install triton`."
        )


def resolve_group_size(quant: QuantConfig, in_features: list[int]) -> int | None:
    """The int4 group size: the configured one (validated), or else the smallest that divides
    every layer. Smallest, because accuracy comes first: on SmolLM2 from its Q4_1 GGUF (blocks
    of 32) group 64 cost far more perplexity than group 32 (docs/performance.md, "Behind the code")."""
    if quant.bits == 8:
        return None
    fits = [g for g in INT4_GROUP_SIZES if all(n % g == 0 for n in in_features)]
    if quant.group_size in fits or (quant.group_size is None and fits):
        return quant.group_size or min(fits)
    sizes = sorted(set(in_features))
    fix = (f"pass group_size={min(fits)} (fits: {fits})" if fits
           else "use quant={'bits': 8} for this model")
    raise QuantizationError(
        f"quant bits=4: group_size={quant.group_size or 'auto'} must divide every quantized "
        f"layer's input size, got input sizes {sizes}; supported group sizes are "
        f"{INT4_GROUP_SIZES}. Fix: {fix}."
    )


def quantize_linear(module: nn.Module, conv1d: bool, quant: QuantConfig, group_size: int | None,
                    backend: str | None) -> QuantizedLinear:
    weight = module.weight.detach()
    weight = weight.t().contiguous() if conv1d else weight  # [out, in]
    if quant.bits == 8:
        q = quantize_int8(weight, equalize=True)
    else:
        q = quantize_int4(weight, group_size, symmetric=quant.symmetric)
        if quant.act_bits == 8:
            q = q._replace(act_bits=8)
    return QuantizedLinear(q, module.bias, backend)


@dataclasses.dataclass
class QuantSummary:
    bits: int
    group_size: int | None
    layers: int
    bytes_before: int
    bytes_after: int
    act_bits: int = 16

    def describe(self) -> str:
        group = f" g{self.group_size}" if self.group_size else ""
        acts = (" with 8-bit activations (W4A8: the activations quantized per row and group)"
                if self.act_bits == 8 else "")
        return (f"int{self.bits}{group} weights{acts} in {self.layers} linears: "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def block_group_size(blocks: list, quant: QuantConfig) -> int | None:
    return resolve_group_size(quant, [n for f in blocks for n in f.linear_in_features()])


def quantize_blocks(blocks: list, quant: QuantConfig) -> QuantSummary:
    """Replace every linear of the fused blocks by a QuantizedLinear, in place."""
    group = block_group_size(blocks, quant)
    summary = QuantSummary(quant.bits, group, 0, 0, 0, quant.act_bits)
    for fused in blocks:
        for parent, name, module in fused.linear_slots():
            q = quantize_linear(module, fused.policy.conv1d, quant, group, fused.backend)
            summary.bytes_before += _nbytes(module)
            summary.bytes_after += _nbytes(q)
            summary.layers += 1
            setattr(parent, name, q)
        fused.bind()
    return summary
