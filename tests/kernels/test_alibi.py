"""alibi: slopes and biases against BLOOM's build_alibi_tensor, Triton against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bloom import modeling_bloom

from hf_dsinfer.kernels import alibi
from tests.kernels.conftest import INTERPRET_TOL, assert_close_tol, requires_triton

HEAD_COUNTS = (1, 5, 6, 8, 12, 20)  # powers of two and not
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCH, TOKENS, HEADS = 2, 13, 6


def _padded_mask(tokens=TOKENS):
    mask = torch.ones(BATCH, tokens, dtype=torch.int64)
    mask[1, :3] = 0  # left padding
    return mask


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_slopes_match_bloom(heads):
    assert torch.equal(alibi.alibi_slopes(heads), modeling_bloom._get_alibi_slopes(heads, "cpu"))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_ref_matches_build_alibi_tensor(dtype):
    mask = _padded_mask()
    hf = modeling_bloom.build_alibi_tensor(mask, HEADS, dtype)  # [B * H, 1, S]
    out = alibi.alibi_bias(mask, HEADS, dtype, backend="ref")
    assert out.shape == (BATCH, HEADS, 1, TOKENS)
    assert torch.equal(out.reshape(BATCH * HEADS, 1, TOKENS), hf)


@requires_triton()
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_ref(dtype):
    mask = _padded_mask()
    assert_close_tol(alibi.alibi_bias(mask, HEADS, dtype, backend="triton"),
                     alibi.alibi_bias_ref(mask, HEADS, dtype), table=INTERPRET_TOL)


@requires_triton()
def test_triton_carries_the_cumsum_across_blocks_and_takes_bool_masks():
    mask = _padded_mask(tokens=300)  # longer than the kernel's 256-key block
    mask[0, 150:152] = 0  # a hole mid-row
    out = alibi.alibi_bias(mask.bool(), 5, torch.float32, backend="triton")
    assert torch.equal(out, alibi.alibi_bias_ref(mask, 5, torch.float32))
