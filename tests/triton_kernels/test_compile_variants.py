"""Serving compiles each kernel once per shape class, whatever the steps look like.

A step changes the batch, the prefill/decode mix, the block table's width, the split count
and where the decodes start in the step's tables. None of that may reach a kernel's compile
key. On the CPU the launches of a varied run (interpreted) are fed to Triton's own
specialisation, the binder a CUDA launch goes through (built here for sm_90), and the
distinct keys are counted; launch options (warps, stages) are left out, as they follow the
head size and dtype, fixed for a run. On CUDA the compiled-kernel caches are counted too.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
from kernel_reference import DEVICE, GPU
from triton.runtime.jit import JITFunction, create_function_from_signature

from minimemserve.attention.base import SeqSlice
from minimemserve.attention.triton_backend import TritonAttention, upload_metadata
from minimemserve.blocks.layout import KVLayout
from triton_kernels import launch_decode, paged_decode, plan_decode
from triton_kernels.paged_decode import _merge_splits_kernel, _paged_decode_kernel
from triton_kernels.prefix_prefill import _prefix_prefill_kernel
from triton_kernels.store_kv import _store_kv_kernel

KERNELS = {
    "store": _store_kv_kernel,
    "prefill": _prefix_prefill_kernel,
    "decode": _paged_decode_kernel,
    "merge": _merge_splits_kernel,
}
H200_SMS = 132


class CompileKeys:
    """Records the compile key a CUDA launch of ``kernel`` would look up, launch by launch."""

    def __init__(self, kernel):
        if isinstance(kernel, JITFunction):
            jit = kernel
        else:  # an interpreted kernel keeps its decorator's arguments
            opts = kernel.kwargs
            jit = JITFunction(
                kernel.fn,
                do_not_specialize=opts.get("do_not_specialize"),
                do_not_specialize_on_alignment=opts.get("do_not_specialize_on_alignment"),
            )
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        self._bind = create_function_from_signature(jit.signature, jit.params, backend)
        self.keys: set[str] = set()

    def __call__(self, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        _, specialization, _ = self._bind(*args, **kwargs)
        self.keys.add(str(specialization))


@pytest.fixture
def compile_keys():
    """One ``CompileKeys`` per kernel, hooked in front of every launch for the test."""
    recorders = {name: CompileKeys(k) for name, k in KERNELS.items()}
    for name, k in KERNELS.items():
        k.add_pre_run_hook(recorders[name])
    yield recorders
    for name, k in KERNELS.items():
        k.pre_run_hooks.remove(recorders[name])


def varied_run(dtype, block_size, head_dim, group, steps, longest, seed=0):
    """Steps of random shape through the backend, then forced split counts and row offsets
    at the kernel level. Outputs are not checked here: the case matrices do that."""
    rng = random.Random(seed)
    layout = KVLayout(2, block_size, 2, head_dim)
    heads, num_blocks = 2 * group, 4 * triton.cdiv(longest, block_size) + 64
    gen = torch.Generator(DEVICE).manual_seed(seed)
    pool = torch.randn(layout.pool_shape(num_blocks), generator=gen, device=DEVICE).to(dtype)
    backend = TritonAttention(pool, layout, heads, head_dim**-0.5)
    backend.num_sms = H200_SMS  # so that longer decodes are split as on an H200
    ids = list(range(1, num_blocks))

    def seq(ctx, new):
        return SeqSlice(rng.sample(ids, triton.cdiv(ctx + new, block_size)), ctx, new)

    def random_step():
        n_pre = rng.randint(0, 3)
        prefills = [
            seq(rng.choice([0, rng.randint(1, 90)]), rng.randint(2, 40)) for _ in range(n_pre)
        ]
        return prefills + [
            seq(rng.randint(0, longest - 1), 1) for _ in range(rng.randint(not n_pre, 6))
        ]

    # first the table widths Triton would specialise on (1 and 16 blocks), then random steps
    fixed = [[seq(0, 3)], [seq(0, 2), seq(0, 1)], [seq(5, 9), seq(16 * block_size - 1, 1)]]
    for step in range(steps):
        md = backend.prepare(fixed[step] if step < len(fixed) else random_step())
        tokens = md.num_prefill_tokens + md.num_decodes
        q = torch.randn(tokens, heads, head_dim, device=DEVICE).to(dtype)
        k, v = torch.randn(2, tokens, 2, head_dim, device=DEVICE).to(dtype)
        backend.forward(q, k, v, step % 2, md)

    k_cache, v_cache = backend.views[0]
    # every length fits the narrowest table below, so no lookup leaves its row
    lens = torch.randint(1, 3 * block_size + 1, (5,), dtype=torch.int32, device=DEVICE)
    for width, splits, offset in ((3, 1, 0), (5, 2, 1), (4, 7, 3), (6, 16, 2)):
        tables = torch.randint(1, num_blocks, (5, width), dtype=torch.int32, device=DEVICE)
        batch = 5 - offset
        q = torch.randn(batch, heads, head_dim, device=DEVICE).to(dtype)
        plan = plan_decode(k_cache, batch, heads, 3 * block_size, num_splits=splits)
        launch_decode(plan, q, k_cache, v_cache, tables, lens, torch.empty_like(q), 0.1, offset)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA test counts the real caches")
def test_a_varied_run_asks_for_one_variant_per_kernel(compile_keys):
    varied_run(torch.float32, 16, 64, 2, steps=8, longest=300)
    counts = {name: len(r.keys) for name, r in compile_keys.items()}
    assert counts == dict.fromkeys(KERNELS, 1), counts


@pytest.mark.skipif(DEVICE.type != "cpu", reason="runs with the interpreter's hooks")
def test_the_count_sees_a_new_shape_class(compile_keys):
    """A different head size is a different kernel: the counter is not blind."""
    for head_dim in (64, 128):
        k_cache = torch.zeros(2, 16, 1, head_dim)
        q = torch.zeros(1, 2, head_dim)
        one = torch.ones(1, 1, dtype=torch.int32)
        paged_decode(q, k_cache, k_cache, one, one[0], 0.1, num_splits=1)
    assert len(compile_keys["decode"].keys) == 2


def test_packed_metadata_keeps_every_field_aligned():
    """One buffer, each field at a 16-byte boundary with its own dtype, shape and values."""
    layout = KVLayout(1, 16, 2, 64)
    backend = TritonAttention(torch.zeros(layout.pool_shape(8)), layout, 4, 0.125)
    slices = [SeqSlice([1, 2, 3], 7, 30), SeqSlice([4], 2, 1), SeqSlice([5, 6], 17, 1)]
    md = backend.prepare(slices)
    packed = upload_metadata(md, torch.device("cpu"))
    base = packed.positions.untyped_storage().data_ptr()
    for name in ("positions", "slot_mapping", "query_start_loc", "context_lens", "seq_lens"):
        a, b = getattr(md, name), getattr(packed, name)
        assert torch.equal(a, b) and a.dtype == b.dtype, name
        assert b.untyped_storage().data_ptr() == base, f"{name} is not in the packed buffer"
        assert b.data_ptr() % 16 == 0, name
    assert torch.equal(packed.block_tables, md.block_tables)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=GPU)])
def test_a_varied_cuda_run_compiles_each_kernel_once(dtype, compile_keys):
    """The real caches: a shape class no other test uses (block size 8, group 3) gets
    exactly one compiled kernel each, over steps of every shape and split count."""
    dev = torch.cuda.current_device()
    before = {n: set(k.device_caches[dev][0]) for n, k in KERNELS.items()}
    varied_run(dtype, 8, 64, 3, steps=24, longest=5000, seed=1)
    torch.cuda.synchronize()
    new = {n: len(set(k.device_caches[dev][0]) - before[n]) for n, k in KERNELS.items()}
    assert new == dict.fromkeys(KERNELS, 1), new
    assert {n: len(r.keys) for n, r in compile_keys.items()} == dict.fromkeys(KERNELS, 1)
