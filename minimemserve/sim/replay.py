"""A simulated cluster's workload: how a replay sends sessions' turns into it and collects
their records (:class:`Replay`, mixed into ``cluster.SimCluster``, whose engine, routing
and clock it drives), in one of :data:`ARRIVALS`, and stopping a run once it is certainly
unstable."""

from __future__ import annotations

import collections
import functools
from array import array
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from minimemserve.errors import ConfigError
from minimemserve.request import RequestOutput
from minimemserve.workloads.results import greedy_params, record, stability, stopped_record
from minimemserve.workloads.sessions import Session, build_prompt, poisson_arrivals, total_turns

# How a replay sends turns: "closed", each when its session's turn before it finished (the
# bench's steady state); "open", each at its own arrival time (a finite run); "paced", each at
# its own arrival time or, if later, when its session's turn before it ended (a finite run of
# users who wait for each answer).
ARRIVALS = ("closed", "open", "paced")


def open_arrivals(
    sessions: Sequence[Session], rate: float, seed: int
) -> list[tuple[int, int, float]]:
    """A finite run's schedule, as a benchmark_serving-style client sends a dataset: every
    turn of ``sessions`` in order (a session's turns one after another), as ``(session index,
    turn, arrival)`` with Poisson arrivals at ``rate`` sessions/s times the turns a session
    has on average, so the offered load in sessions/s is ``rate`` as in a closed replay."""
    turns = [(si, k) for si, s in enumerate(sessions) for k in range(len(s.turns))]
    per_session = len(turns) / max(len(sessions), 1)
    times = poisson_arrivals(rate * per_session, len(turns), seed)
    return [(si, k, t) for (si, k), t in zip(turns, times)]


class Replay:
    """A replay of sessions on a ``SimCluster`` (the cluster's ``at``, ``settle``,
    ``frontend``, ``entry``, ``instances``, ``catch_up`` and ``answer_of`` are its own)."""

    # the cluster's (not imported: the cluster imports this)
    instances: list[Any]
    by_name: dict[str, Any]
    entry: list[Any]
    frontend: Any
    now: float

    def replay(
        self,
        sessions: Sequence[Session],
        rate: float,
        seed: int,
        config: str = "",
        progress: bool = True,
        params_for=greedy_params,
        arrivals: str = "closed",
        schedule: Sequence[tuple[int, int, float]] | None = None,
        stop_unstable: bool = False,
        window: tuple[int, int] | None = None,
    ) -> list[dict]:
        """Replay ``sessions`` in virtual time; returns ``minimemserve bench``'s records.
        ``arrivals="closed"`` replays as the bench does: Poisson session arrivals at ``rate``, a
        turn sent when the previous one finished, its prompt the history plus the output.
        ``"open"`` is a finite run (:func:`open_arrivals`): every turn sent at its own arrival
        time whether or not the turns before it finished, its prompt built from the answers
        the engine will give them (:func:`stand_in_answer`); a ``schedule`` of ``(session
        index, turn, arrival)`` gives those times instead (a trace's timestamps). ``"paced"``
        is the same finite run with users who wait for each answer: a turn is sent at its own
        arrival time or, if later, when its session's turn before it ended (finished, failed
        or was rejected).

        ``stop_unstable``: once virtual time reaches the arrival window's end (the last session
        start), take ``stability``'s verdict (final by then) with every unfinished request as
        still in system; if unstable, end the run there (:attr:`stopped`), those requests'
        records marked ``"stopped"`` (:func:`stopped_record`).

        A closed replay's ``window`` (two session indices) marks every instance's counters
        when each of those sessions starts (:attr:`marks`: what the work between them is
        measured from)."""
        if arrivals not in ARRIVALS:
            raise ConfigError(f"arrivals must be one of {ARRIVALS}, got {arrivals!r}")
        if schedule is not None and arrivals == "closed":
            raise ConfigError("a schedule of arrival times needs arrivals='open' or 'paced'")
        self._records: list[dict] = []
        # request id -> (session index, turn, arrival, prompt tokens)
        self._inflight: dict[str, tuple[int, int, float, int]] = {}
        self._ended: dict[str, RequestOutput] = {}  # finished, reported once transfers land
        self.stopped = False
        self._sessions, self._config, self._params_for = sessions, config, params_for
        self._follows = arrivals == "closed"  # a finished turn sends the next
        # paced: each session's turns not sent yet, in order, with their own arrival times
        self._paced: dict[int, collections.deque[tuple[int, float]]] | None = None
        self._bar = tqdm(
            total=total_turns(sessions),
            disable=not progress,
            unit="req",
            desc=f"{config or 'sim'} turns",
        )
        starts = []
        if self._follows:
            for si, t in enumerate(poisson_arrivals(rate, len(sessions), seed)):
                self.at(t, self._submit, (si, 0, ()))
                starts.append(t)
            for si in window or ():
                self.at(starts[si], self._mark)
        else:
            timed = schedule or open_arrivals(sessions, rate, seed)
            starts = self._book_finite(timed, paced=arrivals == "paced")
        with self._bar:
            if stop_unstable and starts:
                self.settle(until=max(starts))
                self._stop_if_unstable()
            self.settle()
        if self._inflight:
            raise RuntimeError(f"{len(self._inflight)} requests never finished in the simulation")
        return self._records

    def _mark(self) -> None:
        """Every instance caught up to now (:meth:`catch_up`), its counters noted in
        ``marks``: (time, {name: :meth:`SimInstance.counters`}), every step begun by now
        counted."""
        for inst in self.instances:
            self.catch_up(inst)
        self.marks.append((self.now, {i.name: i.counters() for i in self.instances}))

    def _book_finite(self, timed: Sequence[tuple[int, int, float]], paced: bool) -> list[float]:
        """Book a finite run's turns, ``(session index, turn, arrival)``: each at its arrival
        or, ``paced``, each session's first, the others kept in order for :meth:`_pace`; the
        arrival times of the sessions' first turns."""
        self._history: dict[int, list[int]] = {}
        if paced:
            self._paced = collections.defaultdict(collections.deque)
            for si, k, t in sorted(timed, key=lambda turn: turn[:2]):
                self._paced[si].append((k, t))
            timed = [(si, *turns.popleft()) for si, turns in self._paced.items()]
        starts = []
        for si, k, t in timed:
            self.at(t, self._submit_open, (si, k))
            if k == 0:
                starts.append(t)
        return starts

    def _submit_open(self, si: int, k: int) -> None:
        """A finite run's turn ``k`` of session ``si``: sent now, its history the turns before
        it with the answers the engine gives them."""
        session = self._sessions[si]
        history = self._history.pop(si, ())
        if k + 1 < len(session.turns) and session.chain_outputs:
            prompt = build_prompt(session, k, history)
            answer = self.answer_of(f"{session.id}/{k}", session.turns[k].max_tokens)
            self._history[si] = [*prompt, *answer]
        self._submit(si, k, history)

    def _submit(self, si: int, k: int, history: Sequence[int]) -> None:
        session = self._sessions[si]
        # as int64 tokens once: routing, validation and the request take them without a copy
        prompt = array("q", build_prompt(session, k, history))
        rid, params = f"{session.id}/{k}", self._params_for(session.turns[k])
        for entry in self.entry:  # the prompt trees as they are now
            if self._touched(entry):
                self.catch_up(entry)
        try:
            checked = self.validate(prompt, params)  # the engine takes it as it is
        except ValueError as exc:
            rec = record(self._config, session, k, self.now, None, len(prompt), f"rejected: {exc}")
            self._records.append(rec)
            self._bar.update(len(session.turns) - k if self._follows else 1)
            self._pace(si)
            return
        self._inflight[rid] = (si, k, self.now, len(prompt))
        send = functools.partial(self._send, checked, params, rid, self.now)
        self.frontend.submit(rid, prompt, params.max_tokens, session.id, send)

    def _send(self, checked, params, rid: str, arrival: float, route) -> None:
        """``rid`` reaches the instance ``route`` names now, or once the cached prefix pushed
        there has landed (the push booked it last from its sender)."""
        enqueue = functools.partial(
            self._enqueue, self.by_name[route.instance], checked, params, rid, arrival
        )
        if route.transfer_from is None:
            self.at(self.now, enqueue)
        else:
            self.by_name[route.transfer_from].pool.last.done.append(enqueue)

    def _enqueue(self, inst: Any, prompt, params, rid: str, arrival: float) -> None:
        self.catch_up(inst)
        inst.engine.add_request(prompt, params, rid, arrival)
        self.dirty[inst] = None

    def _collect(self, out: RequestOutput) -> None:
        self._ended.pop(out.request_id, None)
        si, k, arrival, _ = self._inflight.pop(out.request_id)
        session = self._sessions[si]
        rec = record(self._config, session, k, arrival, out)
        self._records.append(rec)
        self._bar.update(1)
        if not self._follows:
            self._pace(si)
            return
        if rec["error"] is not None:
            self._bar.update(len(session.turns) - k - 1)
        elif k + 1 < len(session.turns):
            self._submit(si, k + 1, [*out.prompt_token_ids, *out.token_ids])

    def _pace(self, si: int) -> None:
        """A paced run's turn of session ``si`` ended now: its next turn goes at its own
        arrival time, or now if that has passed."""
        if self._paced is not None and (turns := self._paced.get(si)):
            k, t = turns.popleft()
            self.at(max(t, self.now), self._submit_open, (si, k))

    def _stop_if_unstable(self) -> None:
        """The arrival window ends now: its records with every unfinished request still in
        system decide ``stability``; if unstable, the run ends here (its bookings dropped)."""
        unfinished = self._unfinished_records()
        if stability([*self._records, *unfinished])["stable"]:
            return
        self._records.extend(unfinished)
        self._bar.update(len(unfinished))
        self._inflight.clear()
        self._ended.clear()
        self._events.clear()
        self.stopped = True

    def _unfinished_records(self) -> list[dict]:
        """A record of each request in flight: those that finished (their report waits for
        transfers) as they finished, the others :func:`stopped_record`s with what their
        engine measured so far."""
        reqs = {}
        for inst in self.instances:
            reqs.update(inst.engine.requests)
            reqs.update((r.request_id, r) for r in inst.incoming)
        out = []
        for rid, (si, k, arrival, prompt_tokens) in self._inflight.items():
            session = self._sessions[si]
            if (done := self._ended.get(rid)) is not None:
                out.append(record(self._config, session, k, arrival, done))
                continue
            metrics = reqs[rid].metrics if rid in reqs else None
            out.append(stopped_record(self._config, session, k, arrival, prompt_tokens, metrics))
        return out
