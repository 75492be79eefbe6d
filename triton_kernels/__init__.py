"""Triton kernels that read the aggregated KV pool in place, one kernel per file.

Every kernel takes one layer's K and V views of a pool tensor, each
``[num_blocks, block_size, n_kv_heads, head_dim]`` (``layer_views`` of either layout), and
reads them through their strides; block offsets are computed in int64. What the kernel
files share (checks, the CPU interpreter switch, the online-softmax step) is in ``common``.
"""

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
from triton_kernels.store_kv import launch_store_kv, store_kv

__all__ = [
    "DecodePlan",
    "PrefillPlan",
    "choose_num_splits",
    "interpreter_ready",
    "kernel_for",
    "launch_decode",
    "launch_prefill",
    "launch_store_kv",
    "paged_decode",
    "plan_decode",
    "plan_prefill",
    "prefix_prefill",
    "store_kv",
]
