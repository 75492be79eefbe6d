"""RMSNorm fused with the residual add before it: one read of each row, one write of each.

A pre-norm Llama layer adds a block's output to the residual stream and normalises the sum
for the next block. ``add_rmsnorm`` does both in one pass per row: the sum is rounded to the
model's dtype (as the separate add would round it) and written back over ``residual``, then
normalised in fp32 and scaled by the weight, HF's order of roundings, so the result matches
``weight * rmsnorm(x + residual)`` of the unfused ops up to fp32 summation order.

``add_rmsnorm`` checks its inputs; ``launch_add_rmsnorm`` is the unchecked launch for a
caller that checked them once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels.common import check_dtype, kernel_for, next_pow2

MAX_HIDDEN = 16384  # one row lives in registers (fp32): 64 KiB spread over 16 warps
MIN_COLS_PER_WARP = 256  # a warp keeps 8 fp32 columns per thread in flight at least
MAX_WARPS = 16


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,  # read, then overwritten with x + residual (when HAS_RESIDUAL)
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row offsets in int64: rows * stride passes 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the add's rounding
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / n_cols
    normed = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # HF casts before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm`` without the checks."""
    rows, n_cols = x.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out, x if residual is None else residual
    res = x if residual is None else residual  # unread without a residual
    block = next_pow2(n_cols)
    kernel_for(_add_rmsnorm_kernel, x.device)[(rows,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(MAX_WARPS, max(1, block // MIN_COLS_PER_WARP)),
    )
    return out, res


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(s), s)`` for ``s = x + residual`` (``s = x`` without a residual).

    ``x`` and ``residual`` are ``[T, hidden]`` with contiguous rows; ``s`` is written over
    ``residual`` in place (and is ``x`` itself without one). ``weight`` is ``[hidden]`` in
    ``x``'s dtype. The sum is rounded to the dtype, the norm runs in fp32.
    """
    check_dtype(x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, hidden] with contiguous rows, got {tuple(x.shape)}")
    if not 0 < x.shape[1] <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {x.shape[1]}")
    others = {"weight": weight} if residual is None else {"weight": weight, "residual": residual}
    for name, t in others.items():
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")
    if weight.shape != (x.shape[1],) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} with contiguous rows")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    return launch_add_rmsnorm(x, residual, weight, eps)
