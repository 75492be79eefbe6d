"""Triton kernels that read the aggregated KV pool in place, one kernel per file.

Every kernel takes one layer's K and V views of a pool tensor, each
``[num_blocks, block_size, n_kv_heads, head_dim]`` (``layer_views`` of either layout), and
reads them through their strides; block offsets are computed in int64.

Running on the CPU (Triton 3.9): ``@triton.jit`` decides between compiling and
interpreting when the decorator runs, reading ``TRITON_INTERPRET`` at that moment. This
holds for Triton's own library functions too (``tl.sum``, ``tl.max``, ``tl.cdiv`` are
``@jit`` functions decorated by ``import triton``), so CPU tensors need
``TRITON_INTERPRET=1`` set before the first ``import triton`` of the process. Our own
kernels do not depend on when their module was imported: ``kernel_for`` hands CUDA tensors
to the kernel as defined and CPU tensors to an interpreted copy of the same function. When
``triton`` was imported without the variable, a CPU launch raises a ``RuntimeError`` that
says so. With the variable set, CUDA launches are interpreted as well (slowly), so set it
only where there is no GPU. The interpreter has no bfloat16 (NumPy lacks it), so bf16
needs a CUDA device."""

from __future__ import annotations

import functools

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # one K/V row lives in registers; larger rows would spill


@functools.cache
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


def kernel_for(kernel, device: torch.device):
    """The launchable form of ``kernel`` for tensors on ``device``.

    CUDA tensors get the kernel as defined; CPU tensors get an interpreted copy of its
    Python function, whatever ``TRITON_INTERPRET`` was when the kernel was defined.
    """
    if device.type == "cuda" or not isinstance(kernel, JITFunction):
        return kernel
    if not interpreter_ready():
        raise RuntimeError(
            "Triton kernels on CPU tensors run in Triton's interpreter, which must be switched "
            "on before triton is first imported: set TRITON_INTERPRET=1 in the environment "
            "(or os.environ before any import of triton), or use CUDA tensors"
        )
    return _interpreted(kernel.fn)


def interpreter_ready() -> bool:
    """Whether this process imported triton with ``TRITON_INTERPRET=1`` (CPU launches work)."""
    return not isinstance(tl.sum, JITFunction)


def check_cache_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check one layer's K/V views: 4-D, same shape/dtype/device, contiguous head_dim."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, n_kv_heads, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head_dim (stride 1), got {t.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache on {v_cache.device}")
    check_dtype_device(k_cache)


def check_dtype_device(t: torch.Tensor) -> None:
    """Reject dtypes the kernels do not handle and bf16 on the CPU interpreter."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {t.dtype}; use one of {SUPPORTED_DTYPES}")
    if t.dtype == torch.bfloat16 and t.device.type != "cuda":
        raise TypeError("bfloat16 needs a CUDA device (the Triton interpreter has no bf16)")
    if t.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {t.shape[-1]} exceeds the supported {MAX_HEAD_DIM}")


def check_same(ref: torch.Tensor, **others: torch.Tensor) -> None:
    """Check that every tensor in ``others`` has ``ref``'s dtype and device."""
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} is {t.dtype}, expected {ref.dtype} like the KV cache")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device} like the KV cache")


def check_index(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    """Check an index tensor: integer dtype, ``dims`` dimensions, on ``device``."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU interpreter."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


from triton_kernels.paged_decode import choose_num_splits, paged_decode  # noqa: E402
from triton_kernels.prefix_prefill import prefix_prefill  # noqa: E402
from triton_kernels.store_kv import store_kv  # noqa: E402

__all__ = [
    "choose_num_splits",
    "interpreter_ready",
    "kernel_for",
    "paged_decode",
    "prefix_prefill",
    "store_kv",
]
