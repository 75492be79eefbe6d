"""How much disaggregation can gain, estimated from a run's own records.

Colocated PD under ``prefill_first`` spends a share ρ of its busy time in prefill steps, and
every decode on an instance waits for them: its time per output token is about
d(B_PD) / (1 − ρ), with d(B) the time of a decode step of batch B. A layout of x prefill
instances out of n removes that stall, but its prefill instances must do the same prefill work:
ρ ≈ (x/n)·U_P with U_P their utilisation, and its decode instances run larger batches,
d(B_D). So the JCT of a disaggregated layout over PD's is estimated at about

    estimate = (1 − (x/n)·U_P) × d(B_D) / d(B_PD),

and no lower than ``floor`` = (1 − x/n) × d(B_D) / d(B_PD) whatever the load (U_P ≤ 1).
It is an estimate, not a bound: it takes PD's stall as its busy-time share of prefill.
:func:`bound` computes every term from the runs of a comparison, each seed's over the same
steady window as the ratio (the work done from the first steady session's start to the last
session's: busy time and row-weighted decode batches), :func:`ttft_share` the share of a
layout's JCT that is TTFT (caching touches TTFT only, so a caching gain on JCT is at most
that share of its TTFT gain)."""

from __future__ import annotations

from collections.abc import Sequence

from minimemserve.sim.profiles import StepShape

from .sweep import interval

BOUND_TERMS = ("rho", "u_p", "b_pd", "b_d", "d_ratio", "estimate", "stall", "floor")


def decode_step_s(step_model, batch: float, context: float) -> float:
    """Seconds of a decode step of ``batch`` rows (rounded, at least 1) each attending to
    ``context`` tokens."""
    b = max(1, round(batch))
    return step_model.step_time(StepShape((), (max(1, round(context)),) * b, b))


def _terms(new: dict, base: dict, step_model) -> dict[str, float] | None:
    """One seed's terms over each run's steady window: ``new`` a disaggregated run's
    ``load``, ``base`` PD's."""
    new, base = new["window"], base["window"]
    roles, pd = new["roles"], base["roles"].get("colocated")
    if "prefill" not in roles or "decode" not in roles or pd is None:
        return None
    x = roles["prefill"]["instances"]
    n = x + roles["decode"]["instances"]
    u_p = roles["prefill"]["busy_s"] / (x * new["seconds"]) if new["seconds"] else 0.0
    d = roles["decode"]
    d_ratio = decode_step_s(step_model, d["decode_batch"], d["decode_context"]) / decode_step_s(
        step_model, pd["decode_batch"], pd["decode_context"]
    )
    return {
        "rho": base["prefill_share"],
        "u_p": u_p,
        "b_pd": pd["decode_batch"],
        "b_d": d["decode_batch"],
        "d_ratio": d_ratio,
        "estimate": (1 - x / n * u_p) * d_ratio,
        "stall": (1 - base["prefill_share"]) * d_ratio,
        "floor": (1 - x / n) * d_ratio,
    }


def bound(new_runs: Sequence[dict], base_runs: Sequence[dict], step_model) -> dict | None:
    """Each term of the estimate (:data:`BOUND_TERMS`: ρ, U_P, both decode batches, their step
    time ratio, the estimate, the stall estimate (1 − ρ)·d(B_D)/d(B_PD) and the floor at U_P = 1)
    over the seeds, mean and 95 % interval; None unless ``new`` is disaggregated and ``base``
    colocated."""
    seeds = [_terms(a["load"], b["load"], step_model) for a, b in zip(new_runs, base_runs)]
    if not seeds or None in seeds:
        return None
    return {k: interval([s[k] for s in seeds]) for k in BOUND_TERMS}


def ttft_share(runs: Sequence[dict]) -> dict:
    """Mean TTFT over mean JCT of a point's runs (its steady window), over the seeds."""
    return interval([r["steady"]["ttft_mean"] / r["steady"]["jct_mean"] for r in runs])


def respects(ratio: dict, b: dict, term: str = "estimate") -> bool:
    """Whether a simulated ratio's 95 % interval reaches the interval of its ``term``
    ("estimate", or "floor": U_P = 1): each within its own interval, no other slack."""
    return ratio["mean"] + ratio["ci95"] >= b[term]["mean"] - b[term]["ci95"]
