"""silu_mul: SwiGLU's ``silu(gate) * up`` in one pass, against the unfused ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_reference import DEVICE, GPU

from triton_kernels import silu_mul

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (1e-2, 1e-2)}

CASES = [
    (1, 128, F32),
    (6, 300, F32),  # not a multiple of the column block
    (4, 1100, F16),  # two column blocks, the second partial
    pytest.param(3, 11008, BF16, marks=GPU),
    pytest.param(64, 13824, F16, marks=GPU),
]


@pytest.mark.parametrize("tokens,inter,dtype", CASES)
def test_silu_mul_matches_the_unfused_ops(tokens, inter, dtype):
    gen = torch.Generator(DEVICE).manual_seed(inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen, device=DEVICE) * 4).to(dtype)
    gate, up = gate_up.split([inter, inter], dim=-1)
    expect = F.silu(gate) * up
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(silu_mul(gate_up), expect, atol=atol, rtol=rtol)


def test_silu_mul_reads_strided_rows():
    wide = torch.randn(3, 300, device=DEVICE)
    gate_up = wide[:, :256]
    expect = F.silu(gate_up[:, :128]) * gate_up[:, 128:]
    torch.testing.assert_close(silu_mul(gate_up), expect, atol=1e-6, rtol=1e-5)


def test_silu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(torch.randn(8, 4, device=DEVICE).t())
    with pytest.raises(TypeError, match="unsupported dtype"):
        silu_mul(torch.randn(2, 8, device=DEVICE, dtype=torch.float64))
