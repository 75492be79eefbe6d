"""Decode runs: a simulated instance's quiet decode steps booked ahead as one run and stepped
only when something reaches the instance (mixed into ``SimCluster``; see docs/simulator.md).

A step of decodes alone that ends no request changes its instance and nothing else. So an
instance whose batch is such decodes books them as one *run* (:class:`DecodeRun`) and steps
them only when something reaches it (a request, a transfer or its calls, a peer's offer or pool
call: :meth:`DecodeRuns.catch_up`), a request is routed once the run has evicted from a pool the
prompt trees follow, or the run's last step ends: the records are those of stepping one by one
(tests/sim check it), at a fraction of the cost."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from .profiles import StepShape

# A ``cluster.SimInstance`` and its ``SimEngine`` (not imported: the cluster imports this).
SimInstance = SimEngine = Any
# A run's new blocks are listed by step up to this many (else found by bisection).
LISTED_GROWTHS = 256


@dataclass
class DecodeRun:
    """Quiet decode steps booked ahead (``SimCluster._start_run``): their ``batch``, the
    shape of the first (every row attends to one more token each step after), each step's
    KV tokens read in all and seconds, the times the steps begin and end (``times[k]`` to
    ``times[k + 1]``), how many steps it may reach (``limit``: only its last may end a
    request, and their blocks are there) and the first that evicts (1-based)."""

    batch: list
    first: StepShape
    growths: list[int]  # each row's first step that takes a new block (see _run_limit)
    left: list[int]  # each row's steps until its request ends (its last, if within limit)
    contexts: list[int]
    seconds: list[float]
    times: list[float]
    limit: int
    evicts: int  # the first step that evicts a cached block (past limit: none)

    @property
    def priced(self) -> int:
        """Steps priced so far."""
        return len(self.seconds)


def _run_limit(batch, block_size: int, free: int, available: int) -> tuple[int, int, list, list]:
    """How many decode steps of ``batch``, from the one under way, may run as one, the first
    of them that evicts, each row's first step that takes a new block (step k computes token
    ``num_computed + k - 1``, past its blocks' room once) and the step that ends it (its
    length reached): through the first step that may end a request (1 when a stand-in token
    could be a stop token, or a row has not sampled yet), and before the one that needs more
    new blocks than ``available``; the step that needs more than ``free`` evicts."""
    firsts: list[int] = []
    left: list[int] = []
    for r, _ in batch:  # (no min or max per row: this runs per row per run)
        p = r.params
        if p.stop_token_ids or not r.prefilled:
            return 1, 1, firsts, left
        end, cap = p.max_tokens + r.num_prompt, r.max_total_tokens
        left.append((end if end < cap else cap) - len(r.tokens))
        first = len(r.blocks) * block_size - r.num_computed + 1
        firsts.append(first if first > 2 else 2)
    limit = max(1, min(left))

    def needed(step: int) -> int:  # new blocks through ``step``
        return sum((step - g) // block_size + 1 for g in firsts if g <= step)

    total = needed(limit)
    growths: list[int] = []  # the step of each new block, in order: the b-th exceeds b

    def first_past(blocks: int) -> int:  # the first step whose blocks exceed ``blocks``
        if total <= blocks:
            return limit + 1
        if total <= LISTED_GROWTHS:
            if not growths:
                growths.extend(sorted(k for g in firsts for k in range(g, limit + 1, block_size)))
            return growths[blocks]
        lo, hi = 1, limit  # needed(lo) <= blocks < needed(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if needed(mid) <= blocks else (lo, mid)
        return hi

    return min(limit, first_past(available) - 1), first_past(free), firsts, left


def _growth_order(firsts: list[int], steps: int, block_size: int) -> list[tuple[int, int]]:
    """``(step, row)`` of each block that steps 2 to ``steps`` of a batch whose rows first
    take one at steps ``firsts`` take (a row's blocks run out every ``block_size`` steps), in
    the order stepping takes them."""
    out = []
    for i, k in enumerate(firsts):
        while k <= steps:
            out.append((k, i))
            k += block_size
    out.sort()
    return out


class DecodeRuns:
    """The decode runs of a ``SimCluster`` (a mixin: it reads the cluster's clock, bookings,
    instances and step counts)."""

    run_ahead = True
    RUN_STEPS = 4  # steps a run prices first; each time they all pass, it prices twice as many

    def _quiet_batch(self, inst: SimInstance) -> list | None:
        """The batch of ``inst``'s step under way, of decodes alone, if every request here is
        in it, nothing arrives, is parked or moves, and what waits cannot start
        (:meth:`_waits_alone`); else None."""
        eng, sched = inst.engine, inst.engine.scheduler
        plan = eng._pending
        if plan is None or plan.failed or plan.done or eng.handoffs or inst.incoming:
            return None
        if inst.sending or inst.beside or inst.asked or sched.parked:
            return None
        if sched.waiting and not self._waits_alone(eng):
            return None
        if len(plan.batch) != len(sched.running):
            return None
        return plan.batch  # decodes alone (the caller's shape says so), prefilled: _run_limit

    @staticmethod
    def _waits_alone(eng: SimEngine) -> bool:
        """Whether the first waiting request of ``eng`` (it did not start with the step under
        way) stays waiting through a run without touching the pool: admission fails for
        what does not change in a run (the running requests, the budget, the kind of step)
        or for blocks, of which a run only takes; it touches the pool only when a caching
        recipe matches a prompt on arrival."""
        sched = eng.scheduler
        if len(sched.running) >= sched.max_num_seqs or sched.waiting[0].blocks:
            return True
        return not eng.recipe.caches

    def _start_run(self, inst: SimInstance, shape: StepShape, seconds: float) -> bool:
        """Book ``inst``'s step just begun and those after it as a run when its batch is
        quiet (:meth:`_quiet_batch`): all but its last step end no request, and their blocks
        are there to take (:func:`_run_limit`)."""
        batch = self._quiet_batch(inst)
        if batch is None:
            return False
        pool = inst.pool
        bounds = _run_limit(batch, pool.block_size, pool.num_free(), pool.num_available())
        limit, evicts, firsts, left = bounds
        if limit == 1:
            return False
        times = [self.now, self.now + seconds]
        contexts = [sum(shape.decodes)]
        inst.run = DecodeRun(batch, shape, firsts, left, contexts, [seconds], times, limit, evicts)
        self._price(inst, inst.run, self.RUN_STEPS)
        return True

    def _price(self, inst: SimInstance, run: DecodeRun, steps: int) -> None:
        """Price up to ``steps`` more steps of ``run`` and book the end of its last: step
        ``k``'s rows each attend to ``k`` more tokens than the first's."""
        rows, base, first = len(run.batch), run.contexts[0], run.first.decodes
        ks = range(run.priced, min(run.limit, run.priced + steps))
        contexts = [base + k * rows for k in ks]
        if self.decode_times is not None:
            seconds = self.decode_times(rows, contexts)
        else:
            seconds = [self.step_time(StepShape((), tuple(d + k for d in first), rows)) for k in ks]
        run.contexts.extend(contexts)
        run.seconds.extend(seconds)
        end = run.times[-1]
        for s in seconds:
            end += s
            run.times.append(end)
        self.at(end, self._run_passes, (inst, run))

    def _touched(self, inst: SimInstance) -> bool:
        """Whether ``inst``'s run changed what its cached prefixes look like by now: it evicted
        (its first evicting step has begun), or the pool has a tier below hbm, whose onload
        room every block it takes shrinks."""
        if (run := inst.run) is None:
            return False
        if len(inst.pool.tiers) > 1 and inst.pool.index.num_blocks:
            return True
        return run.evicts <= run.priced and run.times[run.evicts - 1] <= self.now

    def catch_up(self, inst: SimInstance) -> None:
        """Something reaches ``inst`` now: step its run to where stepping one by one would be
        (every step that ended by now done, the next under way, its end booked)."""
        if (run := inst.run) is not None:
            done = min(bisect.bisect_right(run.times, self.now) - 1, run.priced - 1)
            self._land(inst, run, done)
            self.at(inst.step_ends, self._end_step, (inst,))

    def _run_passes(self, inst: SimInstance, run: DecodeRun) -> None:
        """The last step priced of ``run`` ends, nothing having reached ``inst`` (else this is
        an old booking): price on, or end the run's last step as stepping would."""
        if inst.run is not run:
            return
        if run.priced < run.limit:
            self._price(inst, run, run.priced)
            return
        self._land(inst, run, run.priced - 1)
        self._end_step(inst)

    def _land(self, inst: SimInstance, run: DecodeRun, done: int) -> None:
        """Leave ``inst`` as stepping would have after ``done`` steps of ``run``, the next one
        under way: those steps counted, their blocks taken in turn. Their tokens, and those of
        the step under way, are made when it ends (:attr:`SimInstance.owed`: nothing reads
        them before), where only the requests it ends go through the engine's postprocess."""
        inst.run = None
        self.run_steps += done
        rows = len(run.batch)
        self._count_steps(inst, run.seconds[:done], rows, run.contexts[:done])
        sched, batch, pool = inst.engine.scheduler, run.batch, inst.pool
        growths = _growth_order(run.growths, done + 1, pool.block_size)
        if len(growths) <= pool.num_free():  # no eviction: taken at once, in stepping's order
            for (_, i), block in zip(growths, pool.alloc_mem(len(growths))):
                batch[i][0].blocks.append(block)
        else:
            for k, i in growths:
                r = batch[i][0]
                sched._alloc_to(r, r.num_computed + k)
        inst.owed = (done + 1, [i for i, n in enumerate(run.left) if n == done + 1])
        self._count(inst, run.seconds[done], rows, run.contexts[done])
        inst.step_began, inst.step_ends = run.times[done], run.times[done + 1]
