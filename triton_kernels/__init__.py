"""Triton kernels that read the aggregated KV pool in place, one kernel per file.

Every kernel takes one layer's K and V views of a pool tensor, each
``[num_blocks, block_size, n_kv_heads, head_dim]`` (``layer_views`` of either layout), and
reads them through their strides; block offsets are computed in int64. What the kernel
files share (checks, the CPU interpreter switch, the online-softmax step) is in ``common``.
"""

from triton_kernels.add_rmsnorm import add_rmsnorm, launch_add_rmsnorm
from triton_kernels.common import interpreter_ready, kernel_for
from triton_kernels.paged_decode import (
    DecodePlan,
    choose_num_splits,
    launch_decode,
    paged_decode,
    plan_decode,
)
from triton_kernels.prefix_prefill import (
    PrefillPlan,
    launch_prefill,
    plan_prefill,
    prefix_prefill,
)
from triton_kernels.rope_store_kv import launch_rope_store_kv, rope_store_kv
from triton_kernels.silu_mul import launch_silu_mul, silu_mul
from triton_kernels.store_kv import launch_store_kv, store_kv

__all__ = [
    "DecodePlan",
    "PrefillPlan",
    "add_rmsnorm",
    "choose_num_splits",
    "interpreter_ready",
    "kernel_for",
    "launch_add_rmsnorm",
    "launch_decode",
    "launch_prefill",
    "launch_rope_store_kv",
    "launch_silu_mul",
    "launch_store_kv",
    "paged_decode",
    "plan_decode",
    "plan_prefill",
    "prefix_prefill",
    "rope_store_kv",
    "silu_mul",
    "store_kv",
]
