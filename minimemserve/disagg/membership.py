"""Who in a process deployment is alive: exit codes and heartbeats watched, a death told to
every survivor and to the request ledger, and standalone instances that come back after
being declared dead taken back (asked to join again, relinked, routed to).

The rule: any authentic frame from an instance (a heartbeat, a reply, a report) shows it is
alive, and its heartbeats come from a thread that does not wait for its model to load or its
step to end; so an instance is declared dead only when its process exited, or when nothing
came from it for ``heartbeat_timeout_s`` (stopped, wedged, cut off). A step that hangs
inside, on a peer or a collective, ends on that wait's own deadline. An instance that ended
its session on its own (it says so with ``Rejoin``, or refuses a request as waiting) counts
as dead until it has joined again: nothing is routed to it meanwhile.

A spawned instance whose process exited is started again (a new process of the same spec)
after ``RESTART_WAIT_S``, doubling with each restart up to ``RESTART_MAX_WAIT_S``, at most
``MAX_RESTARTS`` times in a row: one that then serves for ``RESTART_RESET_S`` has its whole
budget again. It rejoins as a standalone one does. One that used its restarts stays dead
(:attr:`Membership.given_up`), as does a Ray actor that Ray will not restart again. Standalone
instances are restarted by whoever started them (a supervisor), and then rejoin on their own."""

from __future__ import annotations

import logging
import time

from ..errors import ConfigError, TransferError
from ..scheduler.global_scheduler import GlobalScheduler
from . import rpc
from .launch import InstanceInfo, Launcher, seen_over, unlink_segment
from .ledger import Ledger

logger = logging.getLogger(__name__)

# A spawned instance whose process exited is started again after this long, doubling with each
# restart (a crash at start-up does not spin), waiting at most RESTART_MAX_WAIT_S ...
RESTART_WAIT_S = 1.0
RESTART_MAX_WAIT_S = 30.0
# ... and at most this many times in a row (then it stays dead: a crash loop) ...
MAX_RESTARTS = 5
# ... where a restarted instance that served this long since it rejoined counts as new (a
# crash a day on a long-lived server is no crash loop).
RESTART_RESET_S = 600.0


class Membership:
    """The live and dead instances of ``launcher``'s deployment. A death drops the instance
    from ``scheduler`` and hands its requests to ``ledger``; ``entry_role`` instances that
    rejoin are routed to again."""

    def __init__(
        self, launcher: Launcher, scheduler: GlobalScheduler, ledger: Ledger, entry_role: str
    ) -> None:
        self.launcher = launcher
        self.spec = launcher.spec
        self.instances = launcher.instances
        self.node = launcher.node
        self.scheduler = scheduler
        self.ledger = ledger
        self.entry_role = entry_role
        self.dead = ledger.dead  # instance name -> why it died
        self.started = time.monotonic()  # silence counts from here for one never heard
        # standalone instances declared dead, that may come back: gone (nothing heard),
        # back (it said it is waiting again), joining (asked to join again, at a time);
        # ended: live ones that said they ended their session (name -> why), to be declared dead
        self.gone: set[str] = set()
        self.back: set[str] = set()
        self.joining: dict[str, float] = {}
        self.ended: dict[str, str] = {}
        self.num_rejoins = 0  # instances taken back after they were declared dead
        # spawned instances whose process exited: when each is started again; restarts made
        self.restart_at: dict[str, float] = {}
        self.restarts: dict[str, int] = {}
        self.up_since: dict[str, float] = {}  # when each restarted instance was started last
        self.given_up: dict[str, str] = {}  # dead for good: name -> why

    def admits(self, sender: str, msg: rpc.Msg) -> bool:
        """Whether ``sender`` may send ``msg`` now (a dead instance only its way back)."""
        back = (type(msg) is rpc.Rejoin and sender in self.gone) or (
            type(msg) is rpc.Ready and sender in self.joining
        )
        return sender in self.instances and (sender not in self.dead or back)

    def silent(self, name: str, since: float) -> float:
        """How long nothing came from ``name``, up to the frontend's last read of its socket
        (not up to now: a caller that has not stepped for a while has not read the heartbeats,
        and blames nobody), counting from ``since`` at the earliest."""
        return self.node.drained_at - max(since, self.node.heard.get(name, since))

    def monitor(self) -> dict[str, str]:
        """Check every instance (exit code, heartbeat); handle deaths. Returns :attr:`dead`."""
        timeout = self.spec.heartbeat_timeout_s
        for name, why in list(self.ended.items()):
            del self.ended[name]
            self.end_session(name, why)
        for inst in [i for i in self.instances.values() if i.info.name not in self.dead]:
            if inst.process is not None and not inst.process.is_alive():
                self._on_death(inst, f"process exited with code {inst.process.exitcode}")
            elif self.silent(inst.info.name, self.started) > timeout:
                # should it wake up, it drops this session and rejoins (spawned ones too)
                self.node.try_push(inst.info.name, rpc.Shutdown("declared dead: no heartbeat"))
                self.gone.add(inst.info.name)
                self._on_death(inst, f"no heartbeat for {timeout:g} s")
        for name in list(self.back):
            self._ask_back(self.instances[name])
        self._watch_restarts()
        self._watch_joining(timeout)
        return self.dead

    def _watch_restarts(self) -> None:
        """Restart the spawned instances whose time came; plan it for one declared dead while
        alive (silent) whose process has exited since."""
        for name in list(self.gone):
            if (proc := self.instances[name].process) is not None and not proc.is_alive():
                self.gone.discard(name)
                self._plan_restart(self.instances[name])
        for name, due in list(self.restart_at.items()):
            if time.monotonic() >= due:
                self._restart(self.instances[name])

    def _watch_joining(self, timeout: float) -> None:
        """Revive the instances asked back that are ready; a restarted process that exited is
        restarted later; one silent for ``timeout`` is waited for (its ``Rejoin``)."""
        for name, asked in list(self.joining.items()):
            inst = self.instances[name]
            if inst.ready:
                self._revive(inst)
            elif inst.process is not None and not inst.process.is_alive():  # restart failed
                del self.joining[name]
                logger.error("instance %s exited while restarting", name)
                self._plan_restart(inst)
            elif self.silent(name, asked) > timeout:  # gone while it loaded: wait for a Rejoin
                del self.joining[name]
                self.gone.add(name)

    def _plan_restart(self, inst: InstanceInfo) -> None:
        """Start spawned ``inst`` again later (its process exited), unless it used its restarts."""
        name = inst.info.name
        made = self.restarts.get(name, 0)
        up = time.monotonic() - self.up_since.get(name, self.started)
        if made and up >= RESTART_RESET_S:
            made = self.restarts[name] = 0  # it served long enough: a new life
        if made >= MAX_RESTARTS:
            self.give_up(name, f"it exited after {made} restarts in a row")
            return
        wait = min(RESTART_WAIT_S * 2**made, RESTART_MAX_WAIT_S)
        self.restart_at[name] = time.monotonic() + wait
        logger.warning("instance %s: restart %d of %d in %g s", name, made + 1, MAX_RESTARTS, wait)

    def _restart(self, inst: InstanceInfo) -> None:
        """A new process for spawned ``inst``; it reports ``Ready``, then ``monitor`` revives it."""
        name = inst.info.name
        del self.restart_at[name]
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.up_since[name] = time.monotonic()
        self.launcher.respawn(name)
        self.node.dead.pop(name, None)  # the node would refuse to reach the new process
        self.joining[name] = time.monotonic()

    def give_up(self, name: str, why: str) -> None:
        """Instance ``name`` will not come back (``why``)."""
        logger.error("instance %s stays dead: %s", name, why)
        self.given_up[name] = why

    def beyond_repair(self) -> str | None:
        """Why the deployment cannot serve and will not recover on its own: a role every
        instance of which stays dead; None while every role has one that lives or may return."""
        for role in dict.fromkeys(i.info.role for i in self.instances.values()):
            names = [n for n, i in self.instances.items() if i.info.role == role]
            if all(n in self.given_up for n in names):
                why = "; ".join(f"{n}: {self.given_up[n]}" for n in names)
                return f"no {role} instance will come back ({why})"
        return None

    def on_rejoin(self, sender: str, msg: rpc.Rejoin) -> None:
        """A standalone instance is waiting: one declared dead is asked back by ``monitor``;
        one thought alive ended its session, and ``monitor`` declares it dead first."""
        if sender in self.gone:
            self.gone.discard(sender)
            self.back.add(sender)  # monitor() asks it to join (a handler must not call)
        elif sender not in self.dead:
            self.ended[sender] = "it ended its session"

    def end_session(self, name: str, why: str) -> None:
        """Instance ``name`` ended its session on its own (``why``): it is dead until it has
        joined again, which it is asked to do."""
        if name not in self.dead:
            self.ledger.sessionless.add(name)
            self._on_death(self.instances[name], why)
            self.back.add(name)

    def declare_dead(self, name: str, reason: str) -> None:
        """An instance its manager (Ray) reports dead: handled as a process that exited; it may
        come back (:meth:`returned`)."""
        if name not in self.dead:
            self._on_death(self.instances[name], reason)
        self.gone.add(name)

    def returned(self, name: str, address: str) -> None:
        """A dead instance its manager restarted, waiting at ``address``: ``monitor`` asks it to
        join again."""
        self.instances[name].info.address = address
        self.gone.discard(name)
        self.back.add(name)

    def _ask_back(self, inst: InstanceInfo) -> None:
        """Send a Join to a standalone instance that came back."""
        name = inst.info.name
        self.back.discard(name)
        inst.ready, inst.info.handle = False, None
        self.node.connect(name, inst.info.address)  # frames queued for its old session go
        join = self.launcher.join_message(name)
        reason = self.node.dead.pop(name, "")  # the node would refuse to call it
        try:
            self.node.call(name, join, timeout_s=self.spec.timeout_s)
        except TransferError as e:
            logger.warning("instance %s did not rejoin: %s", name, e)
            self.node.dead[name] = reason
            self.gone.add(name)
            return
        self.joining[name] = time.monotonic()

    def _revive(self, inst: InstanceInfo) -> None:
        """Take a rejoined instance back: peers reach it again, the scheduler routes to it."""
        name = inst.info.name
        del self.joining[name]
        if inst.process is not None:  # a new process, where its Ready said it listens
            self.node.connect(name, inst.info.address)
        self.num_rejoins += 1
        scope = f"r{self.num_rejoins}"  # new pair groups: the old ones died with its session
        others = [i for i in self.instances.values() if i.info.name not in self.dead]
        try:
            if self.spec.linked:
                seen = self.launcher.seen_by(inst.info, [inst.info, *(b.info for b in others)])
                for b, way in zip(others, (info.transport for info in seen[1:])):
                    info = seen_over(inst.info, way)
                    self.node.push(
                        b.info.name, rpc.PeerUp(info, self.launcher.store_address(), scope)
                    )
                self.node.push(name, rpc.Peers(seen, self.launcher.store_address(), scope))
                self.node.call(name, rpc.Query("links"), timeout_s=self.spec.timeout_s)
        except (TransferError, ConfigError) as e:
            logger.warning("instance %s could not rejoin: %s", name, e)
            self.node.dead[name] = self.dead[name]
            self.gone.add(name)
            return
        del self.dead[name]
        self.ledger.sessionless.discard(name)
        self.node.heard[name] = time.monotonic()
        if inst.info.role == self.entry_role:
            self.scheduler.add(name)
        logger.warning("instance %s (%s) rejoined", name, inst.info.role)

    def _on_death(self, inst: InstanceInfo, reason: str) -> None:
        name = inst.info.name
        self.dead[name] = reason
        self.node.dead[name] = reason
        self.scheduler.drop(name)
        logger.error("instance %s (%s) died: %s", name, inst.info.role, reason)
        self.launcher.beacon.remove(name)
        if inst.process is not None:
            unlink_segment(inst.info.handle)
        for other in self.instances.values():
            peer = other.info.name
            if peer in self.dead or not other.ready:
                continue
            try:
                rep = self.node.call(peer, rpc.PeerDown(name, reason))
            except TransferError as e:
                logger.warning("could not tell %s that %s died: %s", peer, name, e)
                continue
            # hand-offs to or from the dead instance whose notice has not reached us yet
            data = rep.data if isinstance(rep, rpc.Info) else {}
            self.ledger.moved(data.get("handed", ()), peer, name)
            self.ledger.moved(data.get("holding", ()), name, peer)
        self.ledger.lost(name, f"InstanceDied: instance {name} died ({reason})")
        if inst.process is not None and not inst.process.is_alive():
            self._plan_restart(inst)
