"""SwiGLU's gate: ``silu(gate) * up`` of a fused gate/up projection, in one pass.

The projection's output ``[T, 2 * inter]`` holds gate then up in each row. Each program
reads ``BLOCK`` columns of both halves of one row and writes ``[T, inter]``. Roundings
follow the unfused ops (``silu`` rounded to the dtype, then the product rounded), both
computed in fp32.

``silu_mul`` checks its input; ``launch_silu_mul`` is the unchecked launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels.common import check_dtype, kernel_for

BLOCK = 1024  # columns per program: a decode row of Llama-2-7B (11008) is 11 programs
NUM_WARPS = 4


@triton.jit
def _silu_mul_kernel(
    gu_ptr,
    out_ptr,
    stride_gu,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = gu_ptr + row * stride_gu + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu's own rounding
    out = act.to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul`` without the checks."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    kernel_for(_silu_mul_kernel, gate_up.device)[(rows, triton.cdiv(inter, BLOCK))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, inter]`` of ``gate_up`` ``[T, 2 * inter]`` (gate first),
    rows contiguous."""
    check_dtype(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2 * inter] with contiguous rows, got {tuple(gate_up.shape)} "
            f"strides {gate_up.stride()}"
        )
    return launch_silu_mul(gate_up)
