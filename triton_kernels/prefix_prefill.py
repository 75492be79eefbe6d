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

The block table's row stride (the widest sequence of the step) is a runtime argument Triton
does not specialise on, so serving compiles the kernel once per (model, dtype, block size).
``plan_prefill`` fixes a step's launch once, ``launch_prefill`` runs it per layer unchecked,
and ``prefix_prefill`` checks its inputs and does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels.common import (
    LOG2E,
    block_d,
    check_cache_views,
    check_index,
    check_same,
    check_scale,
    dot_precision,
    kernel_for,
    online_softmax_step,
    pipeline_stages,
)

GPU_MAX_STAGES = 2  # the Q tile already holds a third of the budget; two K/V stages fit beside it
CPU_TILES = (32, 16)  # interpreter (BLOCK_M, BLOCK_N): short test runs span several tiles
# Arguments that change between steps: never specialised, so they never cause a compile.
PREFILL_RUNTIME_ARGS = ("stride_btb",)


@dataclass(frozen=True)
class PrefillTiles:
    """Query and key tiles and launch options of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillTiles:
    """Tiles for a head size, dtype and device.

    GPU: 128x64 tiles keep the tensor cores fed at 16-bit and head_dim <= 128; head_dim 256
    or fp32 halve both (fp32 at 256 quarters them) so that the Q tile plus two K/V stages
    stay within ``SMEM_BUDGET``. Warps follow the head size: a 128x128 fp32 accumulator on 4
    warps (128 registers a thread) spills, so heads wider than 64 get 8. CPU (interpreter):
    32x16, so short test sequences cover several tiles and a diagonal spanning two key tiles.
    """
    if device.type != "cuda":
        return PrefillTiles(*CPU_TILES, num_warps=4, num_stages=1)
    elem = torch.empty((), dtype=dtype).element_size()
    bd = block_d(head_dim)
    if elem == 2 and bd <= 128:
        block_m, block_n = 128, 64
    elif elem == 2 or bd <= 128:
        block_m, block_n = 64, 32
    else:
        block_m, block_n = 32, 16
    stages = pipeline_stages(2 * block_n * bd * elem, block_m * bd * elem, GPU_MAX_STAGES)
    return PrefillTiles(block_m, block_n, 4 if bd <= 64 else 8, stages)


@triton.jit(do_not_specialize=PREFILL_RUNTIME_ARGS)
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
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
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
        first_tok = q_start.to(tl.int64)  # token offsets in int64: T * stride passes 2**31
        kv_head = head // GROUP
        ctx_len = tl.load(ctx_ptr + seq)
        offs_m = diag_start + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_mask = (offs_m < q_len)[:, None] & d_ok[None, :]
        q_tok = (first_tok + offs_m)[:, None]
        q = tl.load(
            q_ptr + q_tok * stride_qt + head * stride_qh + d[None, :] * stride_qd,
            mask=q_mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

        # 1) the cached prefix, through the block table: every position is visible
        bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
        for n0 in range(0, ctx_len, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < ctx_len
            block = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0)
            block = block.to(tl.int64)
            in_block = pos % BLOCK_SIZE
            kv_mask = valid[:, None] & d_ok[None, :]
            k_rows = block * stride_kcb + in_block * stride_kcs + kv_head * stride_kch
            k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_M, BLOCK_N]
            v_rows = block * stride_vcb + in_block * stride_vcs + kv_head * stride_vch
            v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

        # 2) new tokens strictly before this query tile: all visible, no mask
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        for n0 in range(0, diag_start, BLOCK_N):
            tok = (first_tok + n0 + tl.arange(0, BLOCK_N))[:, None]
            k_ptrs = k_base + tok * stride_kt + d[None, :] * stride_kd
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            v_ptrs = v_base + tok * stride_vt + d[None, :] * stride_vd
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

        # 3) the diagonal: new tokens inside this query tile, causal
        diag_end = tl.minimum(diag_start + BLOCK_M, q_len)
        for n0 in range(diag_start, diag_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < diag_end
            tok = (first_tok + pos)[:, None]
            kv_mask = valid[:, None] & d_ok[None, :]
            k_ptrs = k_base + tok * stride_kt + d[None, :] * stride_kd
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            causal = (pos[None, :] <= offs_m[:, None]) & valid[None, :]
            s = tl.where(causal, s, float("-inf"))
            v_ptrs = v_base + tok * stride_vt + d[None, :] * stride_vd
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

        out = acc / l_i[:, None]
        tl.store(
            o_ptr + q_tok * stride_ot + head * stride_oh + d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=q_mask,
        )


@dataclass(frozen=True)
class PrefillPlan:
    """One prefill batch's launch, fixed for a step and shared by all its layers."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_query_len: int
    tiles: PrefillTiles
    precision: str


def plan_prefill(
    k_cache: torch.Tensor, batch: int, num_heads: int, max_query_len: int
) -> PrefillPlan:
    """Tiles and grid of a prefill batch over ``k_cache``'s layout."""
    _, block_size, n_kv, head_dim = k_cache.shape
    return PrefillPlan(
        batch=batch,
        num_heads=num_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        block_size=block_size,
        max_query_len=max_query_len,
        tiles=prefill_tiles(head_dim, k_cache.dtype, k_cache.device),
        precision=dot_precision(k_cache.dtype),
    )


def launch_prefill(
    plan: PrefillPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Run a planned prefill, unchecked: sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]`` of ``q``/``k``/``v`` and of ``out``."""
    if plan.batch == 0 or plan.max_query_len == 0:
        return
    t = plan.tiles
    kernel = kernel_for(_prefix_prefill_kernel, q.device)
    kernel[(triton.cdiv(plan.max_query_len, t.block_m), plan.batch, plan.num_heads)](
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
        BLOCK_SIZE=plan.block_size,
        GROUP=plan.num_heads // plan.num_kv_heads,
        HEAD_DIM=plan.head_dim,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_D=block_d(plan.head_dim),
        DOT_PRECISION=plan.precision,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )


def _check_shapes(q, k, v, k_cache) -> tuple[int, int, int]:
    """``(tokens, heads, head_dim)`` of ``q``, after checking k and v against the cache."""
    n_kv, head_dim = k_cache.shape[2:]
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
    return num_tokens, num_heads, head_dim


def _check_batch(q, block_tables, query_start_loc, context_lens) -> int:
    """The batch size the three index tensors agree on."""
    check_index("block_tables", block_tables, 2, q.device)
    check_index("query_start_loc", query_start_loc, 1, q.device)
    check_index("context_lens", context_lens, 1, q.device)
    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or block_tables.shape[0] != batch:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)}, block_tables "
            f"{tuple(block_tables.shape)} and context_lens ({batch},) disagree on the batch"
        )
    return batch


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
    check_scale(scale)
    num_tokens, num_heads, head_dim = _check_shapes(q, k, v, k_cache)
    batch = _check_batch(q, block_tables, query_start_loc, context_lens)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    plan = plan_prefill(k_cache, batch, num_heads, max_query_len)
    launch_prefill(
        plan, q, k, v, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, scale
    )
    return out
