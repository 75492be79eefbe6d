"""The jobs of ``minimemserve sim`` (its options: ``minimemserve.sim.command``): a
simulation or a rate sweep of the configurations, the paper's evaluation and its audit, the
trace studies, the calibration and the roofline's checks."""

from __future__ import annotations

import argparse

from minimemserve.errors import ConfigError
from minimemserve.options import trace_path
from minimemserve.sim.command import setup_from_args
from minimemserve.workloads.results import DEFAULT_SESSIONS

from . import calibration, paper, trace_replay
from .compare import run_sim, sweep
from .roofline import anchors
from .trace_curve import cache_curve, parse_capacities


def _trace(args: argparse.Namespace) -> int:
    """``--trace``: Fig. 10, or the configurations replayed by the trace's timestamps at each
    load of ``--sweep`` (multiples of the trace's request rate; default 1 / --time-scale)."""
    progress = not args.no_progress
    if args.tiers is not None:
        if not 0 < args.tiers <= 1:
            raise ConfigError(f"--tiers SCALE must be in (0, 1], got {args.tiers}")
        trace_replay.tiers_study(
            trace_path(args), args.out, args.trace_window, progress, scale=args.tiers
        )
        return 0
    if args.fig10:
        policies = trace_replay.FIG10_ALL
        if args.fig10 != "all":
            policies = tuple(p.strip() for p in args.fig10.split(",") if p.strip())
        trace_replay.fig10_study(trace_path(args), args.out, args.trace_window, progress, policies)
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    loads = [1.0 / args.time_scale]
    if args.sweep:
        try:
            loads = [float(x) for x in args.sweep.split(",")]
        except ValueError:
            raise ConfigError(f"--sweep takes comma-separated loads, got {args.sweep!r}") from None
    if not all(0 < x < float("inf") for x in loads):
        raise ConfigError(f"loads must be finite and > 0, got {loads}")
    policy = args.policy or "prompt_tree"
    trace_replay.layouts_study(
        trace_path(args), args.out, configs, loads, args.trace_window, policy, progress
    )
    return 0


def _audit(path: str) -> int:
    """``sim --paper --audit FILE``: prints each difference; 1 if any."""
    differences = paper.audit(path)
    for line in differences:
        print(line)
    said = f"{len(differences)} differences" if differences else "every number follows"
    print(f"audit of {path}: {said}")
    return 1 if differences else 0


def main(args: argparse.Namespace) -> int:
    """Run ``minimemserve sim`` with parsed ``args``; returns the exit status."""
    if args.anchors:
        anchors()
        return 0
    if args.calibrate:
        calibration.calibrate(args.calibrate.split(","), args.hardware, args.write)
        return 0
    if args.cache_curve:
        if not args.trace:
            raise ConfigError("--cache-curve needs --trace FILE (or --trace mooncake)")
        caps = parse_capacities(args.cache_curve)
        window, progress = args.trace_window, not args.no_progress
        limits = {"max_context": args.max_context, "max_output_tokens": args.max_output_tokens}
        cache_curve(trace_path(args), caps, args.out, window, progress, **limits)
        return 0
    if args.trace:
        return _trace(args)
    if args.paper and args.audit:
        return _audit(args.audit)
    if args.paper:
        paper.reproduce(
            args.scheduler or "prefill_first",
            args.out,
            quick=args.quick,
            progress=not args.no_progress,
            jobs=args.jobs,
        )
        return 0
    setup = setup_from_args(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    kw = dict(
        max_turns=args.max_turns,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
    )
    if args.sweep:
        try:
            rates = [float(r) for r in args.sweep.split(",")]
        except ValueError:
            raise ConfigError(f"--sweep takes comma-separated rates, got {args.sweep!r}") from None
        res = sweep(
            setup,
            configs,
            args.workload,
            args.sessions or DEFAULT_SESSIONS,
            rates,
            args.seed,
            args.out,
            not args.no_progress,
            arrivals=args.arrivals,
            **kw,
        )
        print("wrote " + ", ".join(res["files"]))
        return 0
    run_sim(
        setup,
        configs,
        workload=args.workload,
        num_sessions=args.sessions or DEFAULT_SESSIONS,
        rate=args.rate,
        seed=args.seed,
        out_dir=args.out,
        progress=not args.no_progress,
        arrivals=args.arrivals,
        **kw,
    )
    return 0
