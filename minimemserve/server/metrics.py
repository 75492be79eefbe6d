"""Prometheus metrics of the server, named as vLLM names its own (prefix ``minimemserve:``).

Request histograms and token counters are observed when a request ends, labelled by the
instance that did the work and its role (prefill-side times by the instance that computed
the prompt, decode-side ones by the instance that finished it), and by the served model's
name (``model_name``, as vLLM labels its metrics). Pool and queue gauges are read from a
snapshot of ``Serving.pool_stats()`` / ``Serving.load()`` the engine thread refreshes.

The prompt-cache counters share one denominator, as vLLM's do: ``prompt_tokens_total`` and
``prefix_cache_queries_total`` count each prompt's tokens once (the ``n`` choices of one
prompt are one query), and ``prefix_cache_hits_total`` the tokens of those prompts found
cached, as the responses' ``usage.prompt_tokens_details.cached_tokens`` report them: KV a
decode instance receives from the prefill instance is a transfer, not a hit."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..mempool import PoolAccountingError
from ..request import RequestOutput

P = "minimemserve:"
LABELS = ("model_name", "instance", "role")
# Seconds; from a fast decode step on a GPU to a long prefill on a CPU.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Pool counters exported as Prometheus counters: (metric name, pool counter, help).
POOL_COUNTERS = (
    ("kv_transfer_bytes", "sent_bytes", "KV bytes this instance sent to other instances."),
)
# Per tier of each pool's chain (``MemPool.stats()["counters"]["tiers"]``): the prompt tokens
# a match found there (out of the pool's one denominator, its queried tokens), blocks moved
# up to hbm from there, down from there, dropped from there, and bytes read and written.
TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens a match found in this tier (of the pool's queried tokens).",
    "promoted_blocks": "Blocks a match brought up from this tier to hbm.",
    "demoted_blocks": "Blocks eviction moved from this tier to the one below.",
    "dropped_blocks": "Blocks eviction dropped from this tier (the last, or no room below).",
    "read_bytes": "KV bytes read from this tier.",
    "written_bytes": "KV bytes written to this tier.",
}


@dataclass
class Snapshot:
    """What the gauges show: per instance its load and pool stats, and whether every pool's
    audit (``MemPool.check``: free + referenced + cached-only = total, index consistent) passed."""

    load: dict[str, dict] = field(default_factory=dict)
    pools: dict[str, dict] = field(default_factory=dict)
    audit_ok: bool = True
    taken_at: float = -math.inf  # time.monotonic() when it was read; never, by default
    period_s: float = 1.0  # how often the server refreshes it at present
    beyond_repair: str | None = None  # why the deployment will not recover on its own
    # per instance of a process deployment: blocks granted to peers' transfers that came back
    # uncommitted, by why (the sender aborted, the transfer expired, the sender died)
    returned: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, serving) -> Snapshot:
        """Audit every pool of ``serving`` and read its load (in the engine thread). A serving
        whose instances are other processes is surveyed: it waits on none of them."""
        broken = getattr(serving, "beyond_repair", lambda: None)()
        if (survey := getattr(serving, "survey", None)) is not None:
            reports = survey()
            load = {name: r["load"] for name, r in reports.items()}
            pools = {name: r["pool"] for name, r in reports.items()}
            ok = all(r["ok"] for r in reports.values())
            returned = {name: r.get("returned", {}) for name, r in reports.items()}
            now = time.monotonic()
            return cls(load, pools, ok, now, beyond_repair=broken, returned=returned)
        try:
            pools = {k: v["pool"] for k, v in serving.check_pools(require_idle=False).items()}
            ok = True
        except PoolAccountingError:
            pools, ok = serving.pool_stats(), False
        return cls(serving.load(), pools, ok, time.monotonic(), beyond_repair=broken)


class _PoolCollector:
    """Gauges and counters read from the latest :class:`Snapshot`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator:
        snap, model = self.metrics.snapshot, self.metrics.model_name
        role = {name: v.get("role", "") for name, v in snap.load.items()}
        reqs = {
            state: GaugeMetricFamily(
                f"{P}num_requests_{state}", f"Requests {state}.", labels=LABELS
            )
            for state in ("running", "waiting")
        }
        for name, v in snap.load.items():
            for state, g in reqs.items():
                g.add_metric([model, name, role[name]], v[state])
        pools = self._pools(snap, model, role)
        returned = CounterMetricFamily(
            f"{P}kv_grant_blocks_returned",
            "Blocks granted to a peer's transfer that came back uncommitted, by why: the "
            "sender aborted, the transfer expired, the sender died.",
            labels=(*LABELS, "reason"),
        )
        for name, counts in snap.returned.items():
            for reason, n in counts.items():
                returned.add_metric([model, name, role.get(name, ""), reason], n)
        audit = GaugeMetricFamily(
            f"{P}kv_pool_audit_ok",
            "1 when every pool's block accounting balanced at the last snapshot.",
            labels=("model_name",),
        )
        audit.add_metric([model], float(snap.audit_ok))
        yield audit
        yield from reqs.values()
        yield from pools
        yield returned

    @staticmethod
    def _pools(snap: Snapshot, model: str, role: dict[str, str]) -> list:
        """Each pool's blocks by tier and state, its counters, and each tier's counters
        (every tier of its chain, by name)."""
        usage = GaugeMetricFamily(
            f"{P}kv_cache_usage_perc",
            "Fraction of KV blocks referenced by requests.",
            labels=(*LABELS, "tier"),
        )
        blocks = GaugeMetricFamily(
            f"{P}kv_cache_blocks", "KV blocks by state.", labels=(*LABELS, "tier", "state")
        )
        counters = {
            m: CounterMetricFamily(f"{P}{m}", h, labels=LABELS) for m, _, h in POOL_COUNTERS
        }
        per_tier = {
            m: CounterMetricFamily(f"{P}kv_tier_{m}", h, labels=(*LABELS, "tier"))
            for m, h in TIER_COUNTERS.items()
        }
        for name, stats in snap.pools.items():
            labels = [model, name, role.get(name, "")]
            tiers = stats.get("counters", {}).get("tiers", {})
            for tier, c in tiers.items():
                for m, family in per_tier.items():
                    family.add_metric([*labels, tier], c.get(m, 0))
            for tier in tiers or ("hbm", "dram"):
                if (t := stats.get(tier)) and t.get("total"):
                    usage.add_metric([*labels, tier], t["referenced"] / t["total"])
                    for state in ("free", "referenced", "cached_only"):
                        blocks.add_metric([*labels, tier, state], t[state])
            for m, key, _ in POOL_COUNTERS:
                counters[m].add_metric(labels, stats.get("counters", {}).get(key, 0))
        return [usage, blocks, *counters.values(), *per_tier.values()]


class ServerMetrics:
    """Every metric of one server, in its own registry, labelled with ``model_name`` (the
    served model's id). ``roles`` maps instance to role."""

    def __init__(self, model_name: str, roles: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.roles = dict(roles or {})
        self.snapshot = Snapshot()
        self._siblings: set[str] = set()  # requests whose prompt another one's count covers

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)

        def count(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, (*LABELS, *extra), registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival at the server to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival at the server to the last token.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens of finished requests.")
        self.cache_queries = count("prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.cache_hits = count("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.generation_tokens = count("generation_tokens", "Tokens generated.")
        self.finished = count("request_success", "Requests ended.", ("finished_reason",))
        self.registry.register(_PoolCollector(self))

    def _labels(self, instance: str) -> tuple[str, str, str]:
        return self.model_name, instance, self.roles.get(instance, "")

    def share_prompt(self, request_id: str) -> None:
        """``request_id`` is one more choice of a prompt another request counts (``n`` > 1):
        its prompt tokens and cache hits are not counted again when it ends."""
        self._siblings.add(request_id)

    def observe_output(self, out: RequestOutput) -> None:
        """Count one ended request (called in the engine thread)."""
        m = out.metrics
        prefill = self._labels(m.prefill_instance)
        last = self._labels(m.decode_instance or m.prefill_instance)
        if m.queue_time is not None:
            self.queue.labels(*prefill).observe(m.queue_time)
        if out.request_id in self._siblings:
            self._siblings.discard(out.request_id)
        else:
            self.prompt_tokens.labels(*prefill).inc(len(out.prompt_token_ids))
            self.cache_queries.labels(*prefill).inc(len(out.prompt_token_ids))
            self.cache_hits.labels(*prefill).inc(m.cached_tokens)
        self.generation_tokens.labels(*last).inc(len(out.token_ids))
        self.finished.labels(*last, out.finish_reason).inc()

    def observe_timing(
        self, out: RequestOutput, ttft: float | None, e2e: float, gaps: list[float]
    ) -> None:
        """The server-side timings of one choice: TTFT, end to end, and inter-token gaps."""
        m = out.metrics
        prefill = self._labels(m.prefill_instance)
        last = self._labels(m.decode_instance or m.prefill_instance)
        if ttft is not None:
            self.ttft.labels(*prefill).observe(ttft)
        self.e2e.labels(*last).observe(e2e)
        for g in gaps:
            self.itl.labels(*last).observe(g)
