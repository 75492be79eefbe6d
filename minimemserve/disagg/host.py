"""This host and its processes as the runtime sees them: the host's identity peers compare
(:func:`host_identity`) and whether a process is gone (:func:`process_gone`)."""

from __future__ import annotations

import os
import socket


def host_identity() -> str:
    """This host as the network sees it: the kernel's boot id and the network namespace, so
    processes in different namespaces count as different hosts (they share no sockets on
    loopback and reach each other only through the network)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}/{netns}"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited, including as a zombie nobody reaped (``kill(pid, 0)``
    still succeeds on those); without ``/proc``, the kernel's word."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")  # state, after the name
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    return False
