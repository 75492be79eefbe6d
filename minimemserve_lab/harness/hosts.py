"""The multi-host runtime on one machine: ``minimemserve instance`` processes started here (each
in a network namespace, if given one), and a frontend that joins them.

``bench --runtime hosts`` runs every configuration this way, so the comparison covers what a
deployment over several hosts adds: instances that start on their own, the join handshake,
and KV over NIXL or torch.distributed (``--transport nixl|gloo``) instead of shared memory."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg import rpc
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import ConfigError
from minimemserve_lab.harness.transfer_paths import pick_free_port

# How long a stopped instance process gets to exit before it is killed.
STOP_GRACE_S = 5.0


class LocalInstances:
    """``minimemserve instance`` processes of ``roles`` on this machine, the ``i``-th listening
    on ``hosts[i]`` (default loopback) inside network namespace ``netns[i]`` (None: this one).
    Writes a cluster key to ``key`` (a new file) unless it exists; logs go to ``log_dir``.
    :attr:`addresses` is what a frontend's ``instances=`` takes. Use as a context manager."""

    def __init__(
        self,
        roles: Sequence[str],
        key: str | Path,
        *,
        model_dir: str | Path | None = None,
        transport: str = "auto",
        hosts: Sequence[str] | None = None,
        netns: Sequence[str | None] | None = None,
        threads: int = 1,
        log_dir: str | Path | None = None,
    ) -> None:
        """Start the processes (they bind and wait; a frontend's Hello waits for them)."""
        self.key = Path(key)
        if not self.key.exists():
            rpc.ClusterKey.generate().save(self.key)
        hosts = list(hosts or [rpc.LOOPBACK] * len(roles))
        netns = list(netns or [None] * len(roles))
        self._logs = Path(log_dir or tempfile.mkdtemp(prefix="mms-instances-"))
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        try:
            for i, (role, host, ns) in enumerate(zip(roles, hosts, netns)):
                port = pick_free_port(host) if ns is None else pick_free_port()
                cmd = [
                    sys.executable,
                    "-m",
                    "minimemserve.cli",
                    "instance",
                    "--role",
                    role,
                    "--listen",
                    f"{host}:{port}",
                    "--key",
                    str(self.key),
                    "--transport",
                    transport,
                    "--threads",
                    str(threads),
                ]
                if model_dir is not None:
                    cmd += ["--model", str(model_dir)]
                if ns is not None:
                    cmd = ["ip", "netns", "exec", ns, *cmd]
                log = open(self._logs / f"{i}-{role}.log", "wb")
                with log:
                    self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
                self.addresses.append(f"{host}:{port}")
        except BaseException:
            self.close()
            raise

    def log(self, i: int) -> str:
        """What instance ``i`` printed so far."""
        return next(self._logs.glob(f"{i}-*.log")).read_text(errors="replace")

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL). Idempotent."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> LocalInstances:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostsCluster(ProcessCluster):
    """A ``ProcessCluster`` over :class:`LocalInstances` it starts for ``spec`` (the
    deployment's roles, ``num_colocated`` colocated ones, ``cores_per_instance`` threads each)
    and stops when closed."""

    def __init__(self, spec: DeploymentSpec) -> None:
        """Start the instances, then join them as a spec with ``instances`` does."""
        if spec.instances or spec.key is not None:
            raise ConfigError("the hosts runtime starts its own instances and makes their key")
        roles = [r for _, r in spec.deployment.instances(colocated=spec.num_colocated)]
        self._dir = tempfile.TemporaryDirectory(prefix="mms-hosts-")
        key = os.path.join(self._dir.name, "cluster.key")
        self.local = LocalInstances(
            roles,
            key,
            model_dir=spec.model_dir,
            transport=spec.transport,
            threads=spec.cores_per_instance,
            log_dir=self._dir.name,
        )
        try:
            super().__init__(replace(spec, instances=tuple(self.local.addresses), key=key))
        except BaseException:
            self.local.close()
            self._dir.cleanup()
            raise

    def close(self) -> None:
        """Close the frontend, then stop the instance processes."""
        super().close()
        self.local.close()
        with contextlib.suppress(OSError):
            self._dir.cleanup()
