"""``minimemserve sim``: its options and the simulated cluster they describe
(:func:`setup_from_args`). What each option runs (a simulation, a rate sweep, the paper's
evaluation, the roofline's checks) is the lab's: ``minimemserve_lab.sim_jobs``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from minimemserve.options import add_engine_arguments, add_workload_arguments
from minimemserve.presets import preset_dir

from .profiles import TRANSFER_MODES, FittedStepModel, HardwareProfile, fit_cpu_steps
from .replay import ARRIVALS
from .runner import (
    CPU_INSTANCES,
    DEFAULT_GPUS,
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    DEFAULT_TP,
    SimSetup,
    cpu_setup,
    gpu_setup,
)

DESCRIPTION = (
    "Run the engine's scheduling, MemPool and recipes on a simulated cluster in virtual time "
    "and compare configurations as `minimemserve bench` does."
)


def add_paper_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``minimemserve sim --paper``."""
    p.add_argument(
        "--paper",
        action="store_true",
        help="the paper's evaluation: every configuration's load sweep on its three workloads "
        "(steady windows, three seeds, stability), its 19 gains at matched loads for every "
        "layout with their estimates, a verdict per number by one rule on its designated "
        "layout, each verdict again under six changes to the cost profile, and finite runs "
        "past the knees; scheduler prefill_first unless --scheduler says otherwise",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="--paper: every workload and configuration on a smaller plan (a fifth of the "
        "sessions, fewer rates, no re-runs with more sessions); its points are not the full run's",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="--paper: runs simulated at once, each in a process (default: cores)",
    )
    p.add_argument(
        "--audit",
        metavar="FILE",
        default=None,
        help="--paper: derive every point, knee, cell and verdict of a written sim_paper.json "
        "again from its recorded runs alone; exits 1 naming each difference",
    )


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``minimemserve sim`` to ``p``; returns ``p``."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="llama2-7b|llama2-13b|llama2-70b|llama3-70b, a shape JSON or an HF checkpoint dir",
    )
    p.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help="a100-80g|a800|h100|h800|h200, a profile JSON, or 'cpu' (this machine, the "
        "fitted step model, the bench's tiny-preset layout)",
    )
    p.add_argument("--gpus", type=int, default=DEFAULT_GPUS)
    p.add_argument("--tp", type=int, default=DEFAULT_TP, help="tensor parallelism per instance")
    add_workload_arguments(p)  # as `minimemserve bench`; xPyD configs repeat to fill the GPUs
    p.add_argument("--transfer-mode", choices=TRANSFER_MODES, default="by_request_aggregated")
    p.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="closed",
        help="closed: a turn is sent when its session's previous turn finished (steady state); "
        "open: a finite run, every turn sent at its own Poisson arrival time whatever finished, "
        "its prompt built from the answers before it (not steady state); paced: open, but a "
        "turn waits for its session's previous turn to end (a user who waits for the answer)",
    )
    add_engine_arguments(p, ("handoff", "dram_blocks", "disk_blocks"))  # tiers: capacities
    p.add_argument(
        "--cpu-model",
        default=None,
        help="fitted CPU step model JSON (--hardware cpu; default: fit now, ~1 min)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        help="comma-separated rates: a rate sweep plot (with --trace: loads, multiples of the "
        "trace's request rate, and each config's highest load within the SLO)",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        help="gpu_steps_7b.json[,gpu_steps_13b.json] (bench/gpu_steps.py): fit the --hardware "
        "profile's terms to these steps, print measured vs predicted and the held-out error",
    )
    p.add_argument("--write", default=None, help="--calibrate: where the fitted profile goes")
    add_paper_arguments(p)
    p.add_argument(
        "--cache-curve",
        default=None,
        help="with --trace: MemPool alone replays the trace at each capacity (comma-separated "
        "tokens, e.g. 1e4,1e5,1e6,3e6,1e7,5e7) and unlimited; writes cache_curve.json and a plot "
        "(with --max-context: only the requests that fit it at length scale 32)",
    )
    p.add_argument(
        "--fig10",
        nargs="?",
        const="all",
        default=None,
        metavar="POLICIES",
        help="with --trace: Mooncake's Fig. 10 (10 caching instances of Llama-3-70B on 8 x "
        "A800, 3M-token DRAM tiers, one-token outputs) under each routing policy, or under "
        "the comma-separated POLICIES",
    )
    p.add_argument(
        "--tiers",
        nargs="?",
        type=float,
        const=1.0,
        default=None,
        metavar="SCALE",
        help="with --trace: Fig. 10's cluster (prompt_tree, one-token outputs) with each pool "
        "at HBM only, + 3M tokens of DRAM, + 30M tokens of disk below it; hit rate by tier "
        "(every capacity, HBM's too, times SCALE: for a window of the trace)",
    )
    p.add_argument(
        "--anchors",
        action="store_true",
        help="print the roofline against published GPU measurements",
    )
    return p


def setup_from_args(args: argparse.Namespace) -> SimSetup:
    """The :class:`SimSetup` the options describe (fits the CPU model when none is given),
    its pools with the tiers below hbm ``--dram-blocks`` and ``--disk-blocks`` ask for."""
    setup = _setup(args)
    tiers = {"dram_blocks": args.dram_blocks, "disk_blocks": args.disk_blocks}
    if not any(tiers.values()):
        return setup
    setup = setup.with_deployment(engine=replace(setup.engine_config, **tiers))
    if args.hardware != "cpu":  # tier moves priced at the profile's links (CPU: not priced)
        setup.topology = replace(setup.topology, tiers=HardwareProfile.load(args.hardware).tiers)
    setup.describe = setup.describe | tiers
    return setup


def _setup(args: argparse.Namespace) -> SimSetup:
    scheduler = args.scheduler or "chunked"
    if args.hardware != "cpu":
        return gpu_setup(
            args.model,
            args.hardware,
            args.gpus,
            args.tp,
            args.policy,
            args.transfer_mode,
            scheduler=scheduler,
            handoff=args.handoff,
        )
    if args.cpu_model:
        fitted = FittedStepModel.load(args.cpu_model)
    else:
        fitted = fit_cpu_steps(
            preset_dir("tiny"), progress=not args.no_progress, concurrent=CPU_INSTANCES
        )
        print(f"wrote {fitted.save(Path(args.out) / 'sim_cpu_steps.json')}")
    model_dir = args.model if Path(args.model).is_dir() else None
    return cpu_setup(fitted, model_dir, args.policy, scheduler=scheduler, handoff=args.handoff)


def main(args: argparse.Namespace) -> int:
    """Run ``minimemserve sim`` with parsed ``args``; returns the exit status. Every job, the
    plain comparison too, is the lab's (``minimemserve_lab.sim_jobs``)."""
    from minimemserve_lab import sim_jobs  # lazy: the lab, imported only to run its jobs

    return sim_jobs.main(args)
