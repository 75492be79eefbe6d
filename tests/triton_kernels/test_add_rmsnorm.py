"""add_rmsnorm: the residual add and RMSNorm in one pass, against the model's unfused ops."""

from __future__ import annotations

import pytest
import torch
from kernel_reference import DEVICE, GPU

from minimemserve.model.layers import RMSNorm
from triton_kernels import add_rmsnorm

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (1e-2, 1e-2)}

# (tokens, hidden, dtype, with a residual)
CASES = [
    (1, 64, F32, True),
    (5, 96, F32, False),
    (7, 128, F16, True),
    (3, 80, F16, False),
    (16, 256, F32, True),
    pytest.param(9, 4096, BF16, True, marks=GPU),
    pytest.param(1, 5120, BF16, False, marks=GPU),
]


def _reference(x, residual, norm):
    s = x if residual is None else x + residual  # the model's add, rounded to the dtype
    return norm(s), s


@pytest.mark.parametrize("tokens,hidden,dtype,with_residual", CASES)
def test_add_rmsnorm_matches_the_unfused_ops(tokens, hidden, dtype, with_residual):
    gen = torch.Generator(DEVICE).manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype) * 3
    norm = RMSNorm(hidden, 1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen, device=DEVICE) + 0.5)
        ref_out, ref_sum = _reference(x, residual if with_residual else None, norm)
    res = residual.clone() if with_residual else None
    out, s = add_rmsnorm(x, res, norm.weight.detach(), 1e-5)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(s, ref_sum, atol=0, rtol=0)  # the add rounds as torch's does
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    if with_residual:
        assert s.data_ptr() == res.data_ptr()  # the sum overwrote the residual in place
    else:
        assert s is x


def test_add_rmsnorm_reads_strided_rows():
    """Rows of a wider tensor (a row stride above the hidden size)."""
    wide = torch.randn(4, 100, device=DEVICE)
    x, residual = wide[:, :64], torch.randn(4, 64, device=DEVICE)
    weight = torch.rand(64, device=DEVICE)
    expect = weight * RMSNorm(64, 1e-6).to(DEVICE)(x + residual)
    out, _ = add_rmsnorm(x, residual.clone(), weight, 1e-6)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_add_rmsnorm_rejects_bad_input():
    x = torch.randn(2, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        add_rmsnorm(x.t(), None, w, 1e-6)
    with pytest.raises(ValueError, match="weight is torch.float16"):
        add_rmsnorm(x, None, w.half(), 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        add_rmsnorm(x, torch.randn(3, 64, device=DEVICE), w, 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        add_rmsnorm(x, None, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        add_rmsnorm(x, None, w, 0.0)
    with pytest.raises(TypeError, match="unsupported dtype"):
        add_rmsnorm(x.double(), None, w.double(), 1e-6)
