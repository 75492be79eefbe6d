"""Step time of tensor parallelism (TP 2) against one rank (TP 1), at equal cores.

    python bench/tp.py                        # tiny preset, fp32, CPU, 2 cores in all
    python bench/tp.py --cores 2 --prompt 512 --batch 16 --context 256 --repeats 7

- TP 1 runs one process with ``--cores`` torch threads; TP N runs N ranks (rank 0 in this
  process, the others spawned workers, gloo) with ``--cores / N`` threads each.
- prefill: one ``--prompt``-token prompt computed in one step (PD, nothing cached);
  decode: one step of ``--batch`` sequences holding ``--context`` tokens each.
- collectives: the time rank 0 spends inside all-reduce / all-gather per step. It includes
  waiting for the slower rank, so it bounds the communication cost from above.
- all-reduce alone: two processes doing nothing but gloo all-reduces of one step's hidden
  states (``[tokens, hidden]`` fp32), median per call, times the all-reduces per step.
- transfer: one request's KV (``--transfer-tokens`` tokens) sent from P to D in a 1P1D
  deployment in this process, at P/D sizes 1/1, 2/1, 1/2 and 2/2 (``MemPool.transfer``
  timed end to end: D allocates, every head slice moves, D commits).
- Each number is the median of ``--repeats`` runs after one warm-up run.

Prints a table; writes ``bench/results/tp.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minimemserve.config import EngineConfig
from minimemserve.engine import Engine
from minimemserve.llm import LLM
from minimemserve.parallel import LOOPBACK, HostStore
from minimemserve.presets import preset_dir
from minimemserve.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
NUM_BLOCKS = 1024  # 16k tokens of KV: room for the decode batch and every prefill repeat


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: tiny preset)")
    p.add_argument("--cores", type=int, default=2, help="torch threads in all, split over ranks")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="TP sizes to compare")
    p.add_argument("--prompt", type=int, default=512, help="prefill length")
    p.add_argument("--batch", type=int, default=16, help="decode batch")
    p.add_argument("--context", type=int, default=256, help="tokens per decoding sequence")
    p.add_argument("--transfer-tokens", type=int, default=1024, help="KV sent P -> D")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "tp.json"))
    return p.parse_args()


class CollectiveTimer:
    """Wraps rank 0's collectives and adds up the time spent in them."""

    def __init__(self, comm):
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "all_gather"):
            setattr(comm, name, self._timed(getattr(comm, name)))

    def _timed(self, fn):
        def run(x):
            t = time.perf_counter()
            out = fn(x)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out

        return run

    def take(self) -> tuple[float, int]:
        """Seconds and calls since the last take."""
        out, self.seconds, self.calls = (self.seconds, self.calls), 0.0, 0
        return out


def _timed_step(engine: Engine, timer: CollectiveTimer | None) -> tuple[float, float, int]:
    if timer:
        timer.take()
    t = time.perf_counter()
    engine.step()
    step = time.perf_counter() - t
    comm, calls = timer.take() if timer else (0.0, 0)
    return step, comm, calls


def _allreduce_peer(port: int, numel: int, iters: int) -> None:
    store = dist.TCPStore(LOOPBACK, port, 2, False)
    group = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    x = torch.ones(numel)
    for _ in range(iters + 1):
        group.allreduce(x).wait()


def allreduce_ms(numel: int, iters: int = 50) -> float:
    """Median milliseconds of one gloo all-reduce of ``numel`` fp32 between two processes."""
    store = HostStore(LOOPBACK, 60.0).store
    peer = mp.get_context("spawn").Process(target=_allreduce_peer, args=(store.port, numel, iters))
    peer.start()
    group = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    x, times = torch.ones(numel), []
    group.allreduce(x).wait()  # warm-up
    for _ in range(iters):
        t = time.perf_counter()
        group.allreduce(x).wait()
        times.append(time.perf_counter() - t)
    peer.join()
    return 1e3 * statistics.median(times)


def measure(model_dir: Path, size: int, args: argparse.Namespace) -> dict:
    """Prefill and decode step times (and rank 0's collective time) at TP ``size``."""
    torch.set_num_threads(max(1, args.cores // size))
    cfg = EngineConfig(
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=max(args.prompt, args.batch),
        max_num_seqs=args.batch,
        tensor_parallel_size=size,
    )
    engine = Engine(model_dir, config="PD", engine_config=cfg)
    timer = CollectiveTimer(engine.tp.comm) if size > 1 else None
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    rows = {"prefill": [], "decode": []}
    try:
        for _ in range(args.repeats + 1):  # the first is a warm-up
            engine.add_request(torch.randint(3, 8000, (args.prompt,), generator=g).tolist(), one)
            rows["prefill"].append(_timed_step(engine, timer))
        many = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.repeats + 2)
        for _ in range(args.batch):
            engine.add_request(torch.randint(3, 8000, (args.context,), generator=g).tolist(), many)
        while not all(r.prefilled for r in engine.requests.values()):
            engine.step()  # the prompts are prefilled (a few per step)
        for _ in range(args.repeats + 1):
            rows["decode"].append(_timed_step(engine, timer))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()
    out = {}
    for phase, samples in rows.items():
        samples = samples[1:]
        out[phase] = {
            "step_ms": 1e3 * statistics.median(s[0] for s in samples),
            "collective_ms": 1e3 * statistics.median(s[1] for s in samples),
            "collectives_per_step": samples[-1][2],
        }
    return out


TRANSFER_SIZES = ((1, 1), (2, 1), (1, 2), (2, 2))  # (prefill TP, decode TP)


def transfer_ms(model_dir: Path, p_tp: int, d_tp: int, args: argparse.Namespace) -> dict:
    """Median milliseconds and bytes of one P -> D transfer at sizes ``p_tp`` / ``d_tp``."""
    torch.set_num_threads(max(1, args.cores // max(p_tp, d_tp)))
    llm = LLM(
        model_dir,
        config="1P1D",
        tensor_parallel_size=p_tp,
        decode_tensor_parallel_size=d_tp,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=args.transfer_tokens,
    )
    pool, times = llm.pools[0], []
    send = pool.transfer

    def timed(dst, blocks):
        t = time.perf_counter()
        out = send(dst, blocks)
        times.append(time.perf_counter() - t)
        return out

    pool.transfer = timed
    g = torch.Generator().manual_seed(1)
    two = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2)  # decoded on D
    with llm:
        for _ in range(args.repeats + 1):
            llm.generate(
                [torch.randint(3, 8000, (args.transfer_tokens,), generator=g).tolist()], two
            )
        sent = pool.stats()["counters"]["sent_bytes"] / (args.repeats + 1)
    return {"ms": 1e3 * statistics.median(times[1:]), "bytes": sent}


def main() -> None:
    """Run every size, print the table, write the JSON."""
    args = parse_args()
    model_dir = Path(args.model) if args.model else preset_dir("tiny")
    results = {size: measure(model_dir, size, args) for size in args.sizes}
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    alone = {
        "prefill": allreduce_ms(args.prompt * hidden),
        "decode": allreduce_ms(args.batch * hidden),
    }
    base = results[args.sizes[0]]
    print(f"prompt {args.prompt}, decode {args.batch} x {args.context} tokens, {args.cores} cores")
    print(
        "| TP | threads/rank | phase | step ms | speedup | rank 0 in collectives ms/step "
        "| calls/step | all-reduce alone ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size, res in results.items():
        for phase, r in res.items():
            speed = base[phase]["step_ms"] / r["step_ms"]
            threads = max(1, args.cores // size)
            ms, comm = f"{r['step_ms']:.1f}", f"{r['collective_ms']:.2f}"
            calls = r["collectives_per_step"]
            pure = f"{calls * alone[phase]:.2f}" if calls else "-"
            cells = [size, threads, phase, ms, f"{speed:.2f}x", comm, calls, pure]
            print("| " + " | ".join(map(str, cells)) + " |")
    moves = {f"{p}/{d}": transfer_ms(model_dir, p, d, args) for p, d in TRANSFER_SIZES}
    print(f"\ntransfer of {args.transfer_tokens} tokens of KV, P -> D in one process")
    print("| P TP / D TP | ms | MB | GB/s | vs 1/1 |")
    print("|---|---|---|---|---|")
    for name, m in moves.items():
        rate, rel = m["bytes"] / m["ms"] / 1e6, m["ms"] / moves["1/1"]["ms"]
        print(f"| {name} | {m['ms']:.2f} | {m['bytes'] / 1e6:.1f} | {rate:.2f} | {rel:.2f}x |")
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    doc = {"args": vars(args), "meta": meta, "results": results, "allreduce_ms": alone}
    doc["transfer"] = moves
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
