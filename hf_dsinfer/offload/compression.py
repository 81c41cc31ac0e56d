"""FlexGen's 4-bit group-wise compression for offloaded weights and KV cache.

    scale = (max - min) / 15,  q = round((x - min) / scale) in [0, 15],  x ~ q * scale + min
    two codes per byte, scale and min in fp16, one pair per group of `group_size` values.

The codes come from `hf_dsinfer.kernels.kv_quant` (reference on CPU, Triton on CUDA), so weights
and cache share one implementation. A weight [out, in] is grouped along its last (input) dim,
viewed as [-1, group_size]; FlexGen groups weights along the output dim. Both are min-max groups
of 64 consecutive values of one row or column; the input dim is contiguous here, so a group is
one contiguous run and compressing needs no transpose. Tensors whose size is not a multiple of
the group (biases of odd size, norms) are kept dense: they are a fraction of a percent of a layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_dsinfer.kernels.kv_quant import KVInt4, quantize_kv_int4

CHUNK_GROUPS = 1 << 16  # groups decoded per step in `decompress`


class CompressedTensor(NamedTuple):
    codes: KVInt4  # packed [n_groups, group // 2] uint8, scales / mins [n_groups, 1] fp16
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.codes[:3])


def compress(tensor: torch.Tensor, group_size: int) -> CompressedTensor:
    codes = quantize_kv_int4(tensor.reshape(-1, group_size), group_size)
    return CompressedTensor(codes, tuple(tensor.shape))


def decompress(item: CompressedTensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense tensor in `dtype` (written into `out` when given), CHUNK_GROUPS groups at a time.

    Same numerics as `dequantize_kv_int4` (q * scale + min in fp32, one rounding to `dtype`),
    but each nibble plane is written straight into its strided half of the output, with no
    stacked [.., 2] intermediate: faster on CPU (docs/performance.md, "Behind the code"), and the fp32 temporaries
    stay ~16 MB (the memory budget counts them)."""
    codes = item.codes
    groups, half = codes.packed.shape
    if out is None:
        out = torch.empty(item.shape, dtype=dtype, device=codes.packed.device)
    pairs = out.view(groups, half, 2)  # [G, g/2, (even, odd)]
    for start in range(0, groups, CHUNK_GROUPS):
        rows = slice(start, start + CHUNK_GROUPS)
        packed = codes.packed[rows]
        scales, mins = codes.scales[rows].float(), codes.mins[rows].float()  # [G, 1]
        pairs[rows, :, 0] = torch.addcmul(mins, (packed & 0xF).float(), scales)
        pairs[rows, :, 1] = torch.addcmul(mins, (packed >> 4).float(), scales)
    return out


def compressed_nbytes(numel: int, group_size: int) -> int:
    """Bytes of a compressed tensor of `numel` values: codes + fp16 scale and min per group."""
    return numel // 2 + 4 * (numel // group_size)


def packed_nbytes(numel: int, group_size: int, scale_bytes: int) -> int:
    """Bytes of a packed 4-bit weight (a portable Int4Weight): codes + scale and min per group,
    `scale_bytes` each."""
    return numel // 2 + 2 * scale_bytes * (numel // group_size)
