"""4-bit linears of an offloaded model that compute on their codes (CPU compute device).

A compressed nn.Linear weight is stored (in RAM or in the disk tier) as the project's own 4-bit
format, an Int4Weight of `quantize_int4(..., portable=True)`: row-major codes [out, in // 2]
(low nibble = even input column) and per-group scales and mins [out, in // group] in the
compute dtype, W = q * scale + min. Those bytes mean the same on every CPU, with or without the
native kernels (torch's private int4 layout does not: it differs between avx2 and avx512
builds of its dispatch, and a store read on another CPU, or code reading that layout itself,
gave garbage). A decode step multiplies by the codes as they were read, through the project's
CPU int4 path (kernels/quant.py: linear_int4_cpu): the native kernel where it runs (half a
byte per weight), else torch's dequantize + matmul. A prefill (more rows than the tier's
kernels on codes take: int4_codes_max_rows, kernels/crossovers.py) dequantizes the whole layer
once for all its micro-batches (materialize).

`PackedInt4Linear` replaces such an nn.Linear in its parent; the offload engine binds its codes
(`bind`) while the layer runs and drops them after (`unbind`). It subclasses QuantizedLinear so
that the fused blocks call its `matmul`, and HF forwards call it like any linear.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_dsinfer.injection.quantize import QuantizedLinear
from hf_dsinfer.kernels.linear import linear_cpu
from hf_dsinfer.kernels.quant import (
    DEQUANT_CHUNK_ROWS,
    Int4Weight,
    dequantize_int4_rows,
    linear_int4_cpu,
    quantize_int4,
)

# Suffixes of a packed weight's tensors in a layer file: Int4Weight's packed, scales, mins
PARTS = ("int4", "scales", "mins")


def pack_weight(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """[out, in] weight -> min-max 4-bit groups along `in`, in the portable row-major format."""
    return quantize_int4(weight, group_size, portable=True)


def from_parts(parts: tuple[torch.Tensor, ...], group_size: int) -> Int4Weight:
    """The Int4Weight of stored tensors (PARTS order), e.g. views of a layer file as read."""
    codes, scales, mins = parts
    return Int4Weight(codes, scales, mins, group_size, symmetric=False)


class PackedInt4Linear(QuantizedLinear):
    """y = x @ W.T + b with W bound as a portable Int4Weight (see the module docstring)."""

    def __init__(self, linear: nn.Linear, group_size: int):
        # QuantizedLinear's buffers and weight tuple are not used (codes come and go): only the
        # type, which the fused blocks route to matmul, and the methods overridden below
        nn.Module.__init__(self)
        self.group_size = group_size
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight_codes: Int4Weight | None = None
        self.dense: torch.Tensor | None = None  # [out, in] while a prefill runs

    def bind(self, weight: Int4Weight) -> None:
        self.weight_codes = weight

    def unbind(self) -> None:
        self.weight_codes = None
        self.dense = None

    def materialize(self, dtype: torch.dtype) -> None:
        """Dequantize the whole weight once, for the many-row matmuls of a prefill (all its
        micro-batches share it): one pass over the layer instead of one per micro-batch,
        DEQUANT_CHUNK_ROWS output rows at a time so that the fp32 temporaries of torch's
        dequantization (where the native kernel does not run) stay those of one chunk."""
        n = self.out_features
        dense = torch.empty(n, self.in_features, dtype=dtype)  # [out, in]
        for start in range(0, n, DEQUANT_CHUNK_ROWS):
            stop = min(start + DEQUANT_CHUNK_ROWS, n)
            dense[start:stop] = dequantize_int4_rows(self.weight_codes, dtype, start, stop)
        self.dense = dense

    @property
    def quantized(self):
        raise NotImplementedError("PackedInt4Linear: its codes are bound by the offload engine "
                                  "only while its layer runs (weight_codes)")

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        if self.weight_codes is None:
            raise RuntimeError("PackedInt4Linear: called while its offloaded codes are not "
                               "loaded (outside the offloaded layer's forward)")
        bias = self.bias if with_bias else None
        if self.dense is not None:  # many rows (prefill): the dense linears' CPU kernels
            return linear_cpu(x, self.dense, bias)
        return linear_int4_cpu(x, self.weight_codes, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits=4, "
                f"group_size={self.group_size}, offloaded")


def swap_in_packed(block: nn.Module, names: list[str], group_size: int) -> None:
    """Replace the nn.Linear owning each weight name in `block` by a PackedInt4Linear."""
    for name in names:
        path = name.rpartition(".")[0]
        parent_path, _, attr = path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        linear = getattr(parent, attr)
        if isinstance(linear, nn.Linear):
            setattr(parent, attr, PackedInt4Linear(linear, group_size))
