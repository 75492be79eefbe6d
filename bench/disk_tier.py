"""The disk tier's bandwidth on this machine: blocks written through its queue and writer
thread until they are on disk, and read back with both checks (the bytes' digest and the
token path's hash), against a plain in-memory copy of the same bytes.

    python bench/disk_tier.py --dir /tmp/kv-bench [--blocks 32] [--repeats 3]

Prints one table (GB/s, median of the repeats) and writes ``disk_tier.json`` beside it. The
files go through the page cache: the read figure is what a restarted instance sees only when
the files are still cached; ``--drop-caches`` (root) measures the cold read as well."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from array import array
from pathlib import Path

import torch

from minimemserve.blocks.layout import KVLayout
from minimemserve.mempool.disk import DiskStore
from minimemserve.mempool.radix import TOKEN_TYPECODE

# (name, layout, dtype): the tiny preset's block and a Llama-2-7B block (8 MiB in fp16)
SHAPES = (
    ("tiny preset, fp32", KVLayout(num_layers=8, block_size=16, num_kv_heads=4, head_dim=64), 4),
    ("llama-2-7b, fp16", KVLayout(num_layers=32, block_size=16, num_kv_heads=32, head_dim=128), 2),
)
DTYPES = {4: torch.float32, 2: torch.float16}


def measure(directory: Path, layout: KVLayout, dtype, blocks: int, drop: bool) -> dict:
    """One round: write ``blocks`` blocks as one path, flush; read them back checked."""
    shutil.rmtree(directory, ignore_errors=True)
    store = DiskStore(directory, blocks, layout, dtype, "bench", queue_blocks=blocks)
    data = torch.randn(layout.pool_shape(blocks), dtype=torch.float32).to(dtype)
    path = array(TOKEN_TYPECODE, range(blocks * layout.block_size))
    ids = list(range(blocks))
    nbytes = blocks * layout.block_bytes(data.element_size())
    t0 = time.perf_counter()
    store.intake(blocks)
    store.write(ids, data, path)
    queued = time.perf_counter() - t0  # what the step pays
    store.flush()
    written = time.perf_counter() - t0
    if drop:
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=True)
    t0 = time.perf_counter()
    assert store.readable(ids, path) == blocks
    back = store.read(ids)
    read = time.perf_counter() - t0
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))
    copy = torch.empty_like(data)
    t0 = time.perf_counter()
    copy.copy_(data)
    memcpy = time.perf_counter() - t0
    store.close()
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "step_gbps": gb / queued,
        "write_gbps": gb / written,
        "read_checked_gbps": gb / read,
        "memcpy_gbps": gb / memcpy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a scratch directory (emptied)")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = {}
    for name, layout, size in SHAPES:
        runs = [
            measure(Path(args.dir), layout, DTYPES[size], args.blocks, args.drop_caches)
            for _ in range(args.repeats)
        ]
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    shutil.rmtree(args.dir, ignore_errors=True)
    keys = ("step_gbps", "write_gbps", "read_checked_gbps", "memcpy_gbps")
    print("block | MiB/block | queued (step pays) | written | read + checked | memcpy  (GB/s)")
    for name, r in rows.items():
        mib = r["bytes"] / args.blocks / 2**20
        print(f"{name} | {mib:.2f} | " + " | ".join(f"{r[k]:.2f}" for k in keys))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "disk_tier.json").write_text(json.dumps({"blocks": args.blocks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
