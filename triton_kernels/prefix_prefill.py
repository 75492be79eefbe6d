"""Prefill attention with a cached prefix: new queries over paged prefix K/V plus new K/V.

One launch covers every sequence of the batch: program ``(m, b, h)`` takes query tile
``m`` of sequence ``b``'s new tokens (found through ``query_start_loc``) for query head
``h``. It first walks the sequence's cached prefix through its block table (all of it is
visible, so no mask beyond the length), then the new tokens' own K/V from the ``k``/``v``
inputs: tiles fully below the diagonal unmasked, the tiles on the diagonal with the causal
mask. The softmax is online, in exp2, with ``scale * log2(e)`` folded into the scores.

GQA: query heads map to their KV head ``h // group``; prefill is compute-bound, so each
query head keeps its own program (as FlashAttention does) and the ``group`` programs
reading one KV head share it through L2.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from triton_kernels import (
    check_cache_views,
    check_index,
    check_same,
    kernel_for,
    next_pow2,
)

LOG2E = 1.4426950408889634  # softmax runs in exp2; scores are scaled by scale*log2(e)
MIN_TILE = 16  # tl.dot needs every dimension >= 16 on the GPU


def _tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size, dtype and device.

    GPU: 128x64 tiles with 8 warps keep the tensor cores fed at head_dim <= 128 in 16-bit;
    head_dim 256 and fp32 halve both tiles so K/V stages still fit in shared memory. CPU
    (interpreter): 32x16, so short test sequences cover several tiles and a diagonal that
    spans two key tiles.
    """
    if device.type != "cuda":
        return 32, 16, 4, 1
    if head_dim > 128 or dtype == torch.float32:
        return 64, 32, 4, 2
    return 128, 64, 8, 2


@triton.jit
def _prefix_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    qsl_ptr,
    ctx_ptr,
    o_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    stride_btn,
    stride_ot,
    stride_oh,
    stride_od,
    qk_scale,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    diag_start = m_tile * BLOCK_M
    if diag_start < q_len:
        kv_head = head // group
        ctx_len = tl.load(ctx_ptr + seq)
        offs_m = diag_start + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_mask = (offs_m < q_len)[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr
            + (q_start + offs_m)[:, None] * stride_qt
            + head * stride_qh
            + d[None, :] * stride_qd,
            mask=q_mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

        # 1) the cached prefix, through the block table: every position is visible
        bt_row = bt_ptr + seq * stride_btb
        for n0 in range(0, ctx_len, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < ctx_len
            block = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0)
            in_block = pos % BLOCK_SIZE
            kv_mask = valid[:, None] & d_ok[None, :]
            k_rows = block.to(tl.int64) * stride_kcb + in_block * stride_kcs + kv_head * stride_kch
            k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = block.to(tl.int64) * stride_vcb + in_block * stride_vcs + kv_head * stride_vch
            v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # 2) new tokens strictly before this query tile: all visible, no mask
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        for n0 in range(0, diag_start, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            rows = (q_start + pos)[:, None]
            k = tl.load(k_base + rows * stride_kt + d[None, :] * stride_kd, mask=d_ok[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rows * stride_vt + d[None, :] * stride_vd, mask=d_ok[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # 3) the diagonal: new tokens inside this query tile, causal
        diag_end = tl.minimum(diag_start + BLOCK_M, q_len)
        for n0 in range(diag_start, diag_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < diag_end
            rows = (q_start + pos)[:, None]
            kv_mask = valid[:, None] & d_ok[None, :]
            k = tl.load(k_base + rows * stride_kt + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            causal = (pos[None, :] <= offs_m[:, None]) & valid[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rows * stride_vt + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            o_ptr
            + (q_start + offs_m)[:, None] * stride_ot
            + head * stride_oh
            + d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=q_mask,
        )


def prefix_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    Args:
        q: ``[T, H, D]`` queries of the new tokens of all sequences, concatenated.
        k, v: ``[T, n_kv_heads, D]`` K/V of the same new tokens (read from here, not from
            the cache).
        k_cache, v_cache: one layer's ``[num_blocks, block_size, n_kv_heads, D]`` views.
        block_tables: ``[B, max_blocks]``; only the first ``context_lens[b]`` positions of
            sequence ``b`` are read through it.
        query_start_loc: ``[B+1]`` cumulative new-token counts (``T`` at the end).
        context_lens: ``[B]`` cached prefix length of each sequence.
        scale: softmax scale.
        max_query_len: the longest new-token run if the caller knows it (saves a sync).

    Returns:
        ``[T, H, D]`` in ``q``'s dtype.
    """
    check_cache_views(k_cache, v_cache)
    check_same(k_cache, q=q, k=k, v=v)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    _, block_size, n_kv, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, H, {head_dim}], got {tuple(q.shape)}")
    num_tokens, num_heads, _ = q.shape
    if k.shape != (num_tokens, n_kv, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [{num_tokens}, {n_kv}, {head_dim}], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if num_heads % n_kv != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {n_kv} KV heads")
    check_index("block_tables", block_tables, 2, q.device)
    check_index("query_start_loc", query_start_loc, 1, q.device)
    check_index("context_lens", context_lens, 1, q.device)
    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or block_tables.shape[0] != batch:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}, block_tables "
            f"{tuple(block_tables.shape)} and context_lens ({batch},) disagree on the batch"
        )
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    block_m, block_n, num_warps, num_stages = _tiles(head_dim, q.dtype, q.device)
    kernel = kernel_for(_prefix_prefill_kernel, q.device)
    kernel[(triton.cdiv(max_query_len, block_m), batch, num_heads)](
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        *out.stride(),
        scale * LOG2E,
        num_heads // n_kv,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(next_pow2(head_dim), MIN_TILE),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
