"""What the kernel files share: input checks, the launchable form of a kernel for a device,
the shared-memory budget of a program, and the online-softmax step of both attention
kernels.

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
needs a CUDA device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # one K/V row lives in registers; larger rows would spill
LOG2E = 1.4426950408889634  # softmax runs in exp2; scores are scaled by scale*log2(e)
MIN_TILE = 16  # tl.dot needs every dimension >= 16 on the GPU
# Shared memory one program may fill with its pipelined K/V tiles (and its Q tile): two
# programs then fit in a Hopper SM's 228 KiB with room left for the layout conversions and
# reductions, and one fits an A100's 164 KiB.
SMEM_BUDGET = 96 * 1024


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


def check_dtype(t: torch.Tensor) -> None:
    """Reject dtypes the kernels do not handle and bf16 on the CPU interpreter."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {t.dtype}; use one of {SUPPORTED_DTYPES}")
    if t.dtype == torch.bfloat16 and t.device.type != "cuda":
        raise TypeError("bfloat16 needs a CUDA device (the Triton interpreter has no bf16)")


def check_dtype_device(t: torch.Tensor) -> None:
    """``check_dtype``, and a head size (last dimension) the attention kernels hold."""
    check_dtype(t)
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


def check_scale(scale: float) -> None:
    """A softmax scale must be a positive finite number."""
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


def block_d(head_dim: int) -> int:
    """The tile width holding one head: a power of two, at least ``MIN_TILE``."""
    return max(next_pow2(head_dim), MIN_TILE)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact products for fp32 (the reference dtype of the
    tests); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pipeline_stages(stage_bytes: int, fixed_bytes: int, most: int) -> int:
    """How many pipelined stages of ``stage_bytes`` fit in ``SMEM_BUDGET`` beside
    ``fixed_bytes`` (at least 1, at most ``most``)."""
    return max(1, min(most, (SMEM_BUDGET - fixed_bytes) // stage_bytes))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (queried once per device); 1 for the CPU
    interpreter."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into a running softmax-weighted sum.

    ``s`` ``[M, N]`` holds the tile's scores in log2 units (``-inf`` where a key is not
    visible), ``v`` ``[N, D]`` its values; ``m_i``/``l_i`` ``[M]`` are the running maximum and
    normaliser, ``acc`` ``[M, D]`` the unnormalised fp32 output. Every row must have seen a
    finite score by the end of its first tile. Returns the new ``(acc, m_i, l_i)``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # the rescale rides in the MMA's accumulator input instead of a separate multiply-add
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i
