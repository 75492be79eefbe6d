"""Decode attention over the paged KV cache: one query token per sequence, split-KV.

Each program owns one (sequence, KV head, split): it loads the ``group`` query heads that
share the KV head as one ``[BLOCK_G, head_dim]`` tile, walks its share of the sequence's
tokens in tiles of ``BLOCK_N`` (looking up each token's block in the block table, so any
block size works, 1 included) and keeps an online softmax in exp2. With more than one
split, each program writes an unnormalised partial result and its log-sum-exp, and a small
second kernel merges the splits (flash-decoding), so that a few long sequences still
spread over every SM.

GQA packing: the group is padded to ``max(16, next_pow2(group))`` rows and both products
run on ``tl.dot``. Decode is bound by reading K/V, so the padded rows cost only idle tensor
core lanes, while every K/V tile is read once for the whole group. The elementwise
alternative (a ``[group, BLOCK_N, head_dim]`` product) needs group times the registers and
spills at group 8 with head_dim 128.
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
    num_sms,
)

LOG2E = 1.4426950408889634  # softmax runs in exp2; scores are scaled by scale*log2(e)
MIN_TILE = 16  # tl.dot needs every dimension >= 16 on the GPU
GPU_BLOCK_N = 64  # 64 tokens x 128 dims x 2 bytes = 16 KiB per K tile: one load in flight per warp
CPU_BLOCK_N = 16  # small tiles so the interpreter's short test sequences still span several
MIN_TOKENS_PER_SPLIT = 256  # below this a split's partial write and merge outweigh its reads
TARGET_WAVES = 2  # programs >= 2x SMs so the SMs stay busy while the last programs drain
MAX_SPLITS = 32  # the merge kernel holds all splits of one head in one tile


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Number of KV splits for a decode batch.

    Without splitting the grid has ``batch * num_kv_heads`` programs. Split only when that
    is below ``TARGET_WAVES * num_sms``, by just enough to reach it, and never into pieces
    shorter than ``MIN_TOKENS_PER_SPLIT`` tokens of the longest sequence; at most
    ``MAX_SPLITS``.
    """
    if min(batch, num_kv_heads, max_seq_len, num_sms) <= 0:
        raise ValueError(
            f"choose_num_splits needs positive arguments, got batch={batch}, "
            f"num_kv_heads={num_kv_heads}, max_seq_len={max_seq_len}, num_sms={num_sms}"
        )
    programs = batch * num_kv_heads
    wanted = -(-(TARGET_WAVES * num_sms) // programs)
    by_length = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    o_ptr,  # [B, H, D] output with one split, else fp32 partials [B, H, S, D]
    lse_ptr,  # fp32 [B, H, S], unused with one split
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    qk_scale,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # tiles never straddle splits
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    d_ok = d < head_dim
    q_mask = (g < group)[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = bt_ptr + seq * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0)
        in_block = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k_rows = block.to(tl.int64) * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = block.to(tl.int64) * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty split keeps zeros and lse = -inf
    out = acc / l_safe[:, None]
    o_ptrs = o_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os
    if NUM_SPLITS == 1:
        tl.store(o_ptrs + d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(o_ptrs + d[None, :] * stride_od, out, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g < group)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # fp32 [B, H, S, D]
    lse_ptr,  # fp32 [B, H, S], log2 units
    out_ptr,  # [B, H, D]
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_od,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [BLOCK_S]
    mask = s_ok[:, None] & (d < head_dim)[None, :]
    part = tl.load(
        part_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=mask,
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged K/V.

    Args:
        q: ``[B, H, D]`` queries (any strides).
        k_cache, v_cache: one layer's ``[num_blocks, block_size, n_kv_heads, D]`` views.
        block_tables: ``[B, max_blocks]`` block ids of each sequence, in order.
        seq_lens: ``[B]`` tokens to attend per sequence (the query's own token included;
            its K/V must already be stored). Each must be at least 1.
        scale: softmax scale, usually ``D ** -0.5``.
        num_splits: KV splits per sequence; ``None`` picks ``choose_num_splits``.
        max_seq_len: the largest ``seq_lens`` entry if the caller knows it (saves a device
            sync when ``num_splits`` is ``None``).

    Returns:
        ``[B, H, D]`` in ``q``'s dtype.
    """
    check_cache_views(k_cache, v_cache)
    check_same(k_cache, q=q)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    _, block_size, n_kv, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B, H, {head_dim}], got {tuple(q.shape)}")
    batch, num_heads, _ = q.shape
    if num_heads % n_kv != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {n_kv} KV heads")
    check_index("block_tables", block_tables, 2, q.device)
    check_index("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"must have one row per query ({batch})"
        )
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        num_splits = choose_num_splits(batch, n_kv, max(max_seq_len, 1), num_sms(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")

    group = num_heads // n_kv
    block_d = max(next_pow2(head_dim), MIN_TILE)
    block_n = GPU_BLOCK_N if q.device.type == "cuda" else CPU_BLOCK_N
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_splits == 1:
        o, lse = out, out  # lse is not touched with one split
        o_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (0, 0)
    else:
        o = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        o_strides = o.stride()
        lse_strides = lse.stride()[:2]
    kernel = kernel_for(_paged_decode_kernel, q.device)
    kernel[(batch, n_kv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        o,
        lse,
        *q.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        *o_strides,
        *lse_strides,
        scale * LOG2E,
        group,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(next_pow2(group), MIN_TILE),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=precision,
        num_warps=4,
    )
    if num_splits > 1:
        merge = kernel_for(_merge_splits_kernel, q.device)
        merge[(batch, num_heads)](
            o,
            lse,
            out,
            *o.stride()[:3],
            *lse.stride()[:2],
            *out.stride(),
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
