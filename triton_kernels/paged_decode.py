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

One compiled variant per shape class: everything that changes from step to step (the split
count, the first row of the batch in the block table and lengths, the block table's row
stride) is a runtime argument Triton does not specialise on, so serving compiles each
kernel once per (model, dtype, block size). The launch is split in two: ``plan_decode``
(once per step: split count, tiles, partial buffers) and ``launch_decode`` (once per layer,
no checks); ``paged_decode`` does both after checking its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels.common import (
    LOG2E,
    MIN_TILE,
    block_d,
    check_cache_views,
    check_index,
    check_same,
    check_scale,
    dot_precision,
    kernel_for,
    next_pow2,
    num_sms,
    online_softmax_step,
    pipeline_stages,
)

MIN_TOKENS_PER_SPLIT = 256  # below this a split's partial write and merge outweigh its reads
TARGET_WAVES = 2  # programs >= 2x SMs so the SMs stay busy while the last programs drain
MAX_SPLITS = 32  # the merge kernel holds all splits of one head in one tile
GPU_BLOCK_NS = (64, 32, 16)  # token tiles tried, largest first, until two K/V stages fit
GPU_MAX_STAGES = 3  # loads in flight per program; decode only streams K/V
GPU_WARPS = 4  # a [16, head_dim] query tile needs no more
CPU_BLOCK_N = 16  # small tiles so the interpreter's short test sequences still span several
# Arguments that change between steps: never specialised, so they never cause a compile.
DECODE_RUNTIME_ARGS = ("row_offset", "num_splits", "stride_btb")
MERGE_RUNTIME_ARGS = ("num_splits",)


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
    wanted = triton.cdiv(TARGET_WAVES * num_sms, batch * num_kv_heads)
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeTiles:
    """Token tile and launch options of the decode kernel for one head size and dtype."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> DecodeTiles:
    """The largest token tile whose K and V tiles fit ``SMEM_BUDGET`` twice (two stages in
    flight), with as many stages as fit up to ``GPU_MAX_STAGES``.

    At 16-bit and head_dim 128 that is 64 tokens x 3 stages (32 KiB a stage); head_dim 256
    or fp32 halve the tile, fp32 at 256 quarters it. The interpreter takes ``CPU_BLOCK_N``.
    """
    if device.type != "cuda":
        return DecodeTiles(CPU_BLOCK_N, GPU_WARPS, 1)
    elem = torch.empty((), dtype=dtype).element_size()
    for block_n in GPU_BLOCK_NS:  # the smallest tile stays if none fits twice
        stage = 2 * block_n * block_d(head_dim) * elem  # one K and one V tile
        stages = pipeline_stages(stage, 0, GPU_MAX_STAGES)
        if stages >= 2:
            break
    return DecodeTiles(block_n, GPU_WARPS, stages)


@triton.jit(do_not_specialize=DECODE_RUNTIME_ARGS)
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,  # [B, H, D], written directly with one split
    part_ptr,  # fp32 [B, H, num_splits, D] partial outputs, contiguous; unused with one split
    lse_ptr,  # fp32 [B, H, num_splits] log-sum-exp in log2 units; unused with one split
    row_offset,  # this batch's first row in the block table and lengths
    num_splits,
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
    stride_od,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = row_offset + seq
    seq_len = tl.load(seq_lens_ptr + row)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N  # tiles never straddle
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    d_ok = d < HEAD_DIM
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    bt_row = bt_ptr + row.to(tl.int64) * stride_btb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0)
        block = block.to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_ok[None, :]
        k_rows = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        v_rows = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty split (or seq_len 0) keeps zeros
    out = acc / l_safe[:, None]
    if num_splits == 1:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        num_heads = tl.num_programs(1) * GROUP
        slot = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + slot, lse, mask=g < GROUP)


@triton.jit(do_not_specialize=MERGE_RUNTIME_ARGS)
def _merge_splits_kernel(
    part_ptr,  # fp32 [B, H, num_splits, D], contiguous
    lse_ptr,  # fp32 [B, H, num_splits], log2 units
    out_ptr,  # [B, H, D]
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    MAX_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    s = tl.arange(0, MAX_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + first + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # [MAX_S]
    part = tl.load(
        part_ptr + (first + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [MAX_S, BLOCK_D]
    total = tl.sum(w, 0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@dataclass(frozen=True)
class DecodePlan:
    """One decode batch's launch, fixed for a step and shared by all its layers.

    ``partials``/``lse`` are the split buffers (one element each with a single split); every
    layer overwrites them, which is safe because launches run in stream order.
    """

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_splits: int
    tiles: DecodeTiles
    precision: str
    partials: torch.Tensor
    lse: torch.Tensor


def plan_decode(
    k_cache: torch.Tensor,
    batch: int,
    num_heads: int,
    max_seq_len: int,
    num_splits: int | None = None,
    sms: int | None = None,
) -> DecodePlan:
    """Split count, tiles and split buffers for ``batch`` decodes over ``k_cache``'s layout.

    ``num_splits`` ``None`` picks ``choose_num_splits`` for ``sms`` SMs (the device's count
    when ``None``).
    """
    _, block_size, n_kv, head_dim = k_cache.shape
    device = k_cache.device
    if num_splits is None:
        sms = num_sms(device) if sms is None else sms
        num_splits = choose_num_splits(max(batch, 1), n_kv, max(max_seq_len, 1), sms)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits == 1:
        partials = lse = torch.empty(1, dtype=torch.float32, device=device)
    else:
        shape = (batch, num_heads, num_splits)
        partials = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        lse = torch.empty(shape, dtype=torch.float32, device=device)
    return DecodePlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        block_size=block_size,
        num_splits=num_splits,
        tiles=decode_tiles(head_dim, k_cache.dtype, device),
        precision=dot_precision(k_cache.dtype),
        partials=partials,
        lse=lse,
    )


def launch_decode(
    plan: DecodePlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    row_offset: int = 0,
) -> None:
    """Run a planned decode, unchecked: rows ``row_offset + i`` of ``block_tables`` and
    ``seq_lens`` belong to query ``i`` of ``q`` ``[B, H, D]``; writes ``out`` ``[B, H, D]``."""
    if plan.batch == 0:
        return
    t = plan.tiles
    group = plan.num_heads // plan.num_kv_heads
    bd = block_d(plan.head_dim)
    kernel = kernel_for(_paged_decode_kernel, q.device)
    kernel[(plan.batch, plan.num_kv_heads, plan.num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        plan.partials,
        plan.lse,
        row_offset,
        plan.num_splits,
        *q.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        *out.stride(),
        scale * LOG2E,
        BLOCK_SIZE=plan.block_size,
        GROUP=group,
        HEAD_DIM=plan.head_dim,
        BLOCK_G=max(next_pow2(group), MIN_TILE),
        BLOCK_N=t.block_n,
        BLOCK_D=bd,
        DOT_PRECISION=plan.precision,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    if plan.num_splits > 1:
        merge = kernel_for(_merge_splits_kernel, q.device)
        merge[(plan.batch, plan.num_heads)](
            plan.partials,
            plan.lse,
            out,
            plan.num_splits,
            *out.stride(),
            HEAD_DIM=plan.head_dim,
            MAX_S=MAX_SPLITS,
            BLOCK_D=bd,
            num_warps=4,
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
            its K/V must already be stored). A padding row has length 0 and gets zeros.
        scale: softmax scale, usually ``D ** -0.5``.
        num_splits: KV splits per sequence; ``None`` picks ``choose_num_splits``.
        max_seq_len: the largest ``seq_lens`` entry if the caller knows it (saves a device
            sync when ``num_splits`` is ``None``).

    Returns:
        ``[B, H, D]`` in ``q``'s dtype.
    """
    check_cache_views(k_cache, v_cache)
    check_same(k_cache, q=q)
    check_scale(scale)
    n_kv, head_dim = k_cache.shape[2:]
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
    if num_splits is None and max_seq_len is None and batch:
        max_seq_len = int(seq_lens.max().item())
    plan = plan_decode(k_cache, batch, num_heads, max_seq_len or 1, num_splits)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    launch_decode(plan, q, k_cache, v_cache, block_tables, seq_lens, out, scale)
    return out
