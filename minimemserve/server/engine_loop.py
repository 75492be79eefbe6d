"""The engine's own thread: it owns the ``Serving`` (no other thread touches it) and turns its
outputs into per-request events for asyncio callers.

A caller runs a function on the serving in that thread (:meth:`EngineLoop.call`), registering an
``asyncio.Queue`` for the request ids it adds; every step, the loop puts each ``TokenDelta``
and finished ``RequestOutput`` on the queue of its request (thread-safely, through the caller's
event loop). Between steps it runs the queued calls; idle, it blocks on them.

A call its caller gave up on (a cancelled future) is skipped, and one already running keeps
its result to itself: no caller can make the thread fail. Every ``TICK_S`` the thread also
runs ``tick(serving)``, and once more as soon as the last request ended (the server refreshes
its metrics and view of the instances there), so probes read state instead of waiting for a
step. If the thread does fail, ``on_failure(error)`` runs
after every open stream got its error output."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..request import RequestMetrics, RequestOutput, TokenDelta
from ..serving import Serving

logger = logging.getLogger(__name__)

# How long an idle engine thread blocks waiting for a call before checking it should stop.
IDLE_WAIT_S = 0.05
# How often the engine thread runs its ``tick`` between steps (a scrape interval or better).
TICK_S = 1.0
# With requests running, queued calls get about this long between two steps (then a step).
CALL_SLICE_S = 0.05

Event = TokenDelta | RequestOutput


def _put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for events, ev in items:
        events.put_nowait(ev)


class EngineLoop:
    """Runs ``make_serving()`` and its steps in one daemon thread. ``on_output(out)`` is called
    (in that thread) for every finished request, e.g. to record metrics; ``tick(serving)``
    every ``TICK_S``; ``on_failure(error)`` once if the thread dies of an error."""

    def __init__(
        self,
        make_serving: Callable[[], Serving],
        on_output: Callable[[RequestOutput], None] = lambda out: None,
        tick: Callable[[Serving], None] = lambda serving: None,
        on_failure: Callable[[BaseException], None] = lambda error: None,
    ) -> None:
        self._make = make_serving
        self._on_output = on_output
        self._tick = tick
        self._on_failure = on_failure
        self._ticked = -TICK_S  # monotonic time of the last tick
        self.beat = time.monotonic()  # when the loop last started an iteration
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ready = threading.Event()
        self._stopping = False
        self.serving: Serving | None = None
        self.error: BaseException | None = None  # why the thread ended, if it failed
        self._thread = threading.Thread(target=self._main, name="mms-engine", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float | None = None) -> None:
        """Build the serving in the engine thread and wait until it is ready (or failed)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the engine was not ready within {timeout_s} s")
        if self.error is not None:
            raise RuntimeError(f"the engine failed to start: {self.error}") from self.error

    def stop(self) -> None:
        """Stop stepping and close the serving (its processes and memory)."""
        self._stopping = True
        self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive() and self.error is None

    def busy_for(self) -> float:
        """Seconds the current loop iteration (a step and its calls) has been running."""
        return time.monotonic() - self.beat

    @property
    def num_streams(self) -> int:
        """Requests with a registered queue (added and not finished)."""
        return len(self._streams)

    # ---- calls from asyncio -------------------------------------------------------------------
    async def call(self, fn: Callable[[Serving], Any]) -> Any:
        """Run ``fn(serving)`` in the engine thread between steps; return or raise its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.post(fn, fut)
        return await asyncio.wrap_future(fut)

    def post(self, fn: Callable[[Serving], Any], fut: concurrent.futures.Future | None = None):
        """Queue ``fn(serving)`` without waiting (safe from any thread, also while cancelled)."""
        if not self.alive:
            err = RuntimeError(f"the engine is not running: {self.error or 'stopped'}")
            if fut is None:
                return
            fut.set_exception(err)
            return
        self._calls.put((fn, fut))

    def register(
        self, request_id: str, loop: asyncio.AbstractEventLoop, events: asyncio.Queue
    ) -> None:
        """Deliver ``request_id``'s deltas and output to ``events``, through ``loop`` (call in
        the engine thread, inside the call that adds the request, so nothing comes before it)."""
        self._streams[request_id] = (loop, events)

    def unregister(self, request_id: str) -> None:
        """Stop delivering to ``request_id``'s queue (aborted by its caller)."""
        self._streams.pop(request_id, None)

    # ---- the thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.serving = self._make()
        except BaseException as e:  # reported by start()
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self.beat = time.monotonic()
                if self.beat - self._ticked >= TICK_S:
                    self._run_tick()
                had_work = self.serving.has_unfinished()
                self._run_calls(block=not had_work)
                if self.serving.has_unfinished():
                    self._step()
                elif had_work:  # the last request just ended: show the idle state at once
                    self._ticked = -TICK_S
        except BaseException as e:
            logger.exception("the engine loop failed")
            self.error = e
        finally:
            self._fail_pending()
            self.serving.close()
        if self.error is not None:
            self._on_failure(self.error)

    def _run_tick(self) -> None:
        self._ticked = time.monotonic()
        try:
            self._tick(self.serving)
        except Exception as e:  # a view of the state failed; serving goes on
            logger.warning("the engine's periodic check failed: %s", e)

    def _run_calls(self, block: bool) -> None:
        """Run queued calls (waiting ``IDLE_WAIT_S`` for one when ``block``). With requests
        running, stop after ``CALL_SLICE_S`` so a burst of calls (a slow add each) does not
        hold back the tokens of the requests already running."""
        try:
            item = self._calls.get(timeout=IDLE_WAIT_S) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        start = time.monotonic()
        while True:
            self._run_one(*item)
            if time.monotonic() - start > CALL_SLICE_S and self.serving.has_unfinished():
                return
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run_one(self, fn: Callable[[Serving], Any], fut: concurrent.futures.Future | None):
        """Run one call; skipped if its caller already gave up. A running future cannot be
        cancelled, so setting its result never fails (a caller that left drops it)."""
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.serving)
        except Exception as e:
            if fut is None:
                logger.warning("a queued engine call failed: %s", e)
            else:
                fut.set_exception(e)
        else:
            if fut is not None:
                fut.set_result(result)

    def _step(self) -> None:
        outputs = self.serving.step()
        batch: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up per loop and step
        for ev in [*self.serving.take_deltas(), *outputs]:
            if (dest := self._streams.get(ev.request_id)) is not None:
                batch.setdefault(dest[0], []).append((dest[1], ev))
        for out in outputs:
            self._streams.pop(out.request_id, None)
            try:
                self._on_output(out)
            except Exception as e:  # one output's bookkeeping; the thread serves on
                logger.error("recording request %s failed: %r", out.request_id, e)
        for loop, items in batch.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_pending(self) -> None:
        """The loop ended: every open stream gets an error output, every call an exception."""
        for rid in list(self._streams):
            loop, events = self._streams.pop(rid)
            m = RequestMetrics(time.perf_counter())
            out = RequestOutput(rid, [], [], None, "error", m, f"engine stopped: {self.error}")
            loop.call_soon_threadsafe(events.put_nowait, out)
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine stopped"))
