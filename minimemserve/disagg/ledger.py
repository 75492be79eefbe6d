"""The frontend's ledger of a process deployment's requests: each one in flight (where it
runs, its streamed tokens, its reruns) until its output arrives, hand-offs between
instances, requests lost with an instance (re-run or ended, by the ``Frontend``'s rule), and
aborts (an instance answers one between its steps, with the request's output or where it
handed it on). The request's transitions are the ``Frontend``'s; this follows it over RPC."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InstanceDied, MiniMemServeError, RemoteError, TransferError
from ..request import Request, RequestOutput, TokenDelta, logprobs_fit
from ..scheduler.frontend import Frontend
from . import rpc

logger = logging.getLogger(__name__)

# How long an abort waits for an instance's answer (given between its steps). One that does
# not answer in time drops the request when it reads the abort; until it reports progress
# again (tokens, outputs), later aborts are only sent to it, so a stopped instance does not
# hold up the frontend once per abort.
ABORT_WAIT_S = 2.0


@dataclass
class Inflight:
    """A request the frontend sent (as submitted: the instances hold its progress), where it
    is, and what of it was streamed, until its output arrives."""

    req: Request
    where: str = ""
    answer_from: str = ""  # the instance whose answer to its Submit has not come yet
    reported_by: str = ""  # another instance that streamed it: handed there, notice to come
    reruns: int = 0
    streamed: int = 0  # output tokens taken by take_deltas() so far
    pending: dict[int, tuple[int, Any]] = field(default_factory=dict)  # position -> (token, lp)

    def end(self, reason: str, error: str | None = None) -> RequestOutput:
        """The output of the request ended here, with no token from an instance."""
        self.req.finish_reason, self.req.error = reason, error
        self.req.metrics.finish_time = time.perf_counter()
        return self.req.to_output(None)


class Ledger:
    """Requests in flight through one frontend's ``node``. ``names`` lists the deployment's
    instances and ``dead`` those that died (name -> why, kept by the membership);
    ``resubmit(rid, f)`` routes and sends a request again (returns where). Outputs are taken
    with :meth:`take_done`."""

    def __init__(
        self,
        node: rpc.RpcNode,
        frontend: Frontend,
        names: Iterable[str],
        dead: dict[str, str],
        vocab_size: int,
        resubmit: Callable[[str, Inflight], str],
    ) -> None:
        self.node = node
        self.frontend = frontend
        self.names = list(names)
        self.vocab_size = vocab_size  # to check what arrives
        self.resubmit = resubmit
        self.dead = dead  # instance name -> why it died (the membership's)
        # dead because they ended their session: a request one never answered never ran there
        # (an instance answers a Submit as it reads it, and its session ends only after
        # frontend_timeout_s without a frame from the frontend, that Submit included)
        self.sessionless: set[str] = set()
        self.inflight: dict[str, Inflight] = {}
        self.done: list[RequestOutput] = []
        self.stalled: dict[str, float] = {}  # instance -> when it left an abort unanswered
        self.progress: dict[str, float] = {}  # instance -> when it last reported on a request

    def take_done(self) -> list[RequestOutput]:
        """The requests that ended since the last call."""
        out, self.done = self.done, []
        return out

    def moved(self, handed: Iterable[str], holder: str, to: str) -> None:
        """``holder`` says it handed ``handed`` on to ``to`` (before the notice came)."""
        for rid in handed:
            if (f := self.inflight.get(rid)) is not None and f.where == holder:
                f.where = to

    def lost(self, name: str, error: str) -> None:
        """Instance ``name`` died: re-run or end every request it held. One whose Submit it
        has not answered is left to that answer (a refusal means it never started there); one
        a live instance streamed runs there (handed on before the notice could come)."""
        for rid, f in list(self.inflight.items()):
            if f.where != name or f.answer_from == name:
                continue
            if f.reported_by and f.reported_by not in self.dead:
                self._arrived(rid, f, f.reported_by)
            else:
                self.recover(rid, f, error)

    def on_output(self, sender: str, msg: rpc.Output) -> None:
        """A request ended on an instance: it joins :attr:`done`."""
        out = msg.output
        self.progress[sender] = time.monotonic()
        if self.inflight.pop(out.request_id, None) is not None:
            self.done.append(out)
            self.frontend.report(outputs=[out])

    def on_tokens(self, sender: str, msg: rpc.Tokens) -> None:
        """Stream positions from P and D may arrive out of order: keep them by position. Tokens
        from another instance than the one the request is believed on show that it was handed
        there (its hand-off notice may come a prefill step later, or never: P died); the
        ledger follows it there once the notice comes or P dies (until then P may still hold
        it, in the step that handed it on)."""
        self.progress[sender] = time.monotonic()
        for d in msg.deltas:
            f = self.inflight.get(d.request_id)
            if f is None:
                continue  # ended meanwhile (aborted, or re-run elsewhere)
            n = len(d.token_ids)
            if not (
                0 <= d.start
                and d.start + n <= f.req.params.max_tokens
                and all(0 <= t < self.vocab_size for t in d.token_ids)
                and logprobs_fit(d.logprobs, n, f.req.params.logprobs, self.vocab_size)
            ):
                raise ValueError(f"{sender} sent tokens that do not fit {d.request_id!r}")
            if f.where != sender:
                f.reported_by = sender
            self.frontend.report(deltas=[d])
            lps = d.logprobs or [None] * len(d.token_ids)
            for i, (tok, lp) in enumerate(zip(d.token_ids, lps)):
                if d.start + i >= f.streamed:
                    f.pending[d.start + i] = (tok, lp)

    def take_deltas(self) -> list[TokenDelta]:
        """Tokens of unfinished requests received since the last call, in order per request."""
        out = []
        for rid, f in self.inflight.items():
            run = []
            while (item := f.pending.pop(f.streamed + len(run), None)) is not None:
                run.append(item)
            if run:
                lps = None if f.req.params.logprobs is None else [lp for _, lp in run]
                out.append(TokenDelta(rid, f.streamed, [t for t, _ in run], lps))
                f.streamed += len(run)
        return out

    def on_handoff(self, sender: str, msg: rpc.Handoff) -> None:
        """An instance handed a request on: the ledger follows it (or re-runs it if its new
        instance is already dead)."""
        f = self.inflight.get(msg.request_id)
        if f is None or f.where != sender or msg.to not in self.names:
            return
        if msg.to in self.dead:  # handed over before that instance died: lost there
            reason = f"InstanceDied: instance {msg.to} died ({self.dead[msg.to]})"
            self.recover(msg.request_id, f, reason)
        else:
            self._arrived(msg.request_id, f, msg.to)

    def _arrived(self, rid: str, f: Inflight, where: str) -> None:
        """Request ``rid`` runs on ``where`` now, handed on by the instance that prefilled it."""
        f.where = where
        self.frontend.report(handoffs=[rid])

    def recover(self, rid: str, f: Inflight, error: str) -> None:
        """Re-run a request whose instance died, or end it with ``error``."""
        if self.frontend.may_rerun(f.reruns):
            with contextlib.suppress(TransferError, MiniMemServeError):
                f.reruns += 1
                where = self.resubmit(rid, f)
                self.frontend.num_reruns += 1
                logger.warning("request %s re-run on %s after: %s", rid, where, error)
                return
        self.inflight.pop(rid, None)
        self.frontend.report(dropped=[rid])
        self.done.append(f.end("error", error))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and return its partial output; None if unknown or
        done. The instance the frontend believes holds it is asked first (it answers between
        its steps, and follows its hand-off when it passed the request on), then the others;
        each is waited for at most ``ABORT_WAIT_S``, and one that left an abort unanswered is
        only told until it makes progress again (see ``ABORT_WAIT_S``)."""
        if (f := self.inflight.pop(request_id, None)) is None:
            return None
        self.frontend.report(dropped=[request_id])
        order = [f.where] + [n for n in self.names if n != f.where]
        asked: set[str] = set()
        while order:
            if (name := order.pop(0)) in asked or name in self.dead:
                continue
            asked.add(name)
            if (rep := self._ask_abort(name, request_id)) is None:
                continue
            if isinstance(rep, rpc.Output):
                return rep.output
            if isinstance(rep, rpc.Info) and rep.data.get("handed_to") in self.names:
                order.insert(0, rep.data["handed_to"])
        return f.end("abort")

    def _ask_abort(self, name: str, request_id: str) -> rpc.Msg | None:
        """``name``'s answer to an abort of ``request_id``, or None if it gave none in time
        (or is stalled and only told: it drops the request when it reads this)."""
        abort = rpc.AbortRequest(request_id)
        stalled = self.stalled.get(name)
        if stalled is not None and self.progress.get(name, stalled) <= stalled:
            self.node.try_push(name, abort)
            return None
        self.stalled.pop(name, None)
        try:
            return self.node.call(name, abort, timeout_s=ABORT_WAIT_S)
        except RemoteError:
            return None
        except TransferError as e:
            if not isinstance(e, InstanceDied):
                logger.warning("%s did not answer an abort of %s: %s", name, request_id, e)
                self.stalled[name] = time.monotonic()
            return None

    def location(self, request_id: str) -> str | None:
        """The instance a request is on now (as far as the frontend knows); None once done."""
        f = self.inflight.get(request_id)
        return None if f is None else f.where

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not been returned by :meth:`step` yet."""
        return bool(self.inflight or self.done)
