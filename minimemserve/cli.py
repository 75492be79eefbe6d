"""Command line: ``minimemserve bench``, ``sim``, ``serve``, ``generate``, ``explain``,
``instance``, ``keygen`` and ``preset``."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from minimemserve import explain, server
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.instance_spec import InstanceSpec
from minimemserve.disagg.launch import parse_address
from minimemserve.disagg.sessions import standalone_main
from minimemserve.errors import ConfigError, MiniMemServeError
from minimemserve.links import AUTO, kv_link, transport_names
from minimemserve.llm import LLM
from minimemserve.model.config import ModelConfig
from minimemserve.options import (
    BENCH_DESCRIPTION,
    PARALLEL_FLAGS,
    add_bench_arguments,
    add_deployment_arguments,
    add_engine_arguments,
    add_trace_arguments,
    deployment_options,
    engine_options,
    trace_path,
)
from minimemserve.presets import preset_dir
from minimemserve.recipes import Role
from minimemserve.sampling import SamplingParams
from minimemserve.sim import command as sim_command
from minimemserve.workloads.trace import load_trace

# The DeploymentSpec and EngineConfig fields ``generate`` takes as options.
GENERATE_FIELDS = ("model", "config", "device", "dtype")
GENERATE_ENGINE_FLAGS = ("block_size", "attention", "load_format", *PARALLEL_FLAGS)


def _generate(args: argparse.Namespace) -> int:
    engine = EngineConfig(**engine_options(args, GENERATE_ENGINE_FLAGS))
    llm = LLM.from_spec(deployment_options(args, GENERATE_FIELDS, engine))
    sampling = {f.name for f in fields(SamplingParams)}  # the options named like its fields
    params = SamplingParams(**{k: v for k, v in vars(args).items() if k in sampling})
    with llm:
        outs = llm.generate(args.prompt, params)
    for out in outs:
        m, n = out.metrics, len(out.token_ids)
        print(out.text)
        print(
            f"[{n} tokens, finish={out.finish_reason}, ttft={m.ttft * 1e3:.1f} ms, "
            f"latency={m.latency * 1e3:.1f} ms, cached={m.cached_tokens}]",
            file=sys.stderr,
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from minimemserve_lab.harness import driver  # lazy: the lab, imported only to run it

    return driver.main(args)


def _serve(args: argparse.Namespace) -> int:
    from minimemserve.server import app  # lazy: needs the optional serve extra (FastAPI)

    return app.main(args)


def _instance(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return standalone_main(_standalone_options(args))
    except (MiniMemServeError, ValueError, OSError) as e:  # a bad flag, key file or port
        raise SystemExit(f"minimemserve instance: {e}") from None


def _standalone_options(args: argparse.Namespace) -> InstanceSpec:
    host, port = parse_address(args.listen)
    if host in ("0.0.0.0", "::", "*"):
        raise ConfigError("--listen needs the address peers reach this host at, not a wildcard")
    if args.transport != AUTO and args.device.split(":")[0] not in (
        moves := kv_link(args.transport).devices
    ):
        raise ConfigError(
            f"--transport {args.transport} moves {'/'.join(moves).upper()} tensors only: "
            f"give a --device {moves[0]}"
        )
    sizes = {"num_blocks": args.num_blocks, "dram_blocks": args.dram_blocks}
    return InstanceSpec(
        role=args.role,
        model_dir=str(args.model or preset_dir("tiny")),
        host=host,
        port=port,
        key=rpc.ClusterKey.load(args.key),
        transport=args.transport,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        engine_overrides={k: v for k, v in sizes.items() if v is not None},
        once=args.once,
    )


def _keygen(args: argparse.Namespace) -> int:
    try:
        rpc.ClusterKey.generate().save(args.out)
    except OSError as e:
        raise SystemExit(f"minimemserve keygen: cannot write {args.out}: {e}") from None
    print(f"wrote {args.out} (owner-only); copy it to every host of the cluster")
    return 0


def _trace(args: argparse.Namespace) -> int:
    window, scales = args.trace_window, (args.time_scale, args.length_scale)
    trace = load_trace(trace_path(args), window, *scales)
    context = args.max_context or ModelConfig.from_hf(preset_dir("tiny")).max_position_embeddings
    n = trace.limited(context, args.max_output_tokens).write(args.out)
    print(
        f"wrote {n} requests to {args.out} ({len(trace.requests) - n} beyond the context "
        f"{context} left out): lengths / {args.length_scale}, times x {args.time_scale:g}, "
        f"{trace.block_tokens} tokens per hash id "
        f"(aiperf: --custom-dataset-type mooncake_trace --isl-block-size {trace.block_tokens})"
    )
    return 0


def _preset(args: argparse.Namespace) -> int:
    print(preset_dir(args.name))  # a dummy preset's dir needs --load-format dummy
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``minimemserve`` parser, one subparser per command."""
    ap = argparse.ArgumentParser(prog="minimemserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "bench",
        help="compare PD, PD-CC, 1P1D, 1P1D-CC (see `minimemserve bench -h`)",
        description=BENCH_DESCRIPTION,
    )
    add_bench_arguments(b).set_defaults(fn=_bench)
    s = sub.add_parser(
        "sim",
        help="the same comparison on a simulated GPU cluster (see `minimemserve sim -h`)",
        description=sim_command.DESCRIPTION,
    )
    sim_command.add_arguments(s).set_defaults(fn=sim_command.main)
    v = sub.add_parser("serve", help="serve the OpenAI HTTP API (needs the serve extra)")
    server.add_arguments(v).set_defaults(fn=_serve)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    add_deployment_arguments(g, GENERATE_FIELDS)
    add_engine_arguments(g, GENERATE_ENGINE_FLAGS)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(fn=_generate)
    x = sub.add_parser(
        "explain",
        help="print the pool calls of a two-turn conversation, two configurations side by side",
        description=explain.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_arguments(x).set_defaults(fn=explain.main)
    i = sub.add_parser("instance", help="start one instance that waits for a frontend (any host)")
    i.add_argument("--role", required=True, choices=[r.value for r in Role])
    i.add_argument("--listen", required=True, help="HOST:PORT peers and the frontend reach")
    i.add_argument("--key", required=True, help="cluster key file (minimemserve keygen)")
    i.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny preset)")
    i.add_argument(
        "--transport",
        default=AUTO,
        choices=transport_names(),
        help="KV transport to peers (auto: shm on this host, else nixl where both sides have "
        "an agent, else gloo)",
    )
    i.add_argument("--device", default="cpu")
    i.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    i.add_argument("--threads", type=int, default=1, help="torch threads")
    i.add_argument("--num-blocks", type=int, default=None, help="hbm blocks on this host")
    i.add_argument("--dram-blocks", type=int, default=None, help="dram blocks on this host")
    i.add_argument("--once", action="store_true", help="exit after serving one frontend")
    i.set_defaults(fn=_instance)
    k = sub.add_parser("keygen", help="write a new cluster key file")
    k.add_argument("--out", required=True, help="path of the new key file")
    k.set_defaults(fn=_keygen)
    t = sub.add_parser(
        "trace",
        help="write a window of a Mooncake-format trace, scaled as bench --trace scales it, "
        "for an external client (aiperf)",
    )
    add_trace_arguments(t)
    t.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="leave out the requests whose prompt and output exceed this many tokens, as bench "
        "--trace does (default: the tiny preset's context, serve's default model)",
    )
    t.add_argument(
        "--max-output-tokens", type=int, default=None, help="cap on each request's output"
    )
    t.add_argument("--out", required=True, help="the JSONL file to write")
    t.set_defaults(fn=_trace)
    p = sub.add_parser("preset", help="write (once) and print the path of a preset checkpoint")
    p.add_argument("--name", default="tiny")
    p.set_defaults(fn=_preset)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minimemserve`` console script."""
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
