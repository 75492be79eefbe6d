"""Instances started on their own (``minimemserve instance``) and joined by a frontend: the
multi-host runtime on loopback with KV forced over gloo, in two network namespaces, under
hostile connections, and when a remote decode instance is killed or stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from minimemserve import SamplingParams, cli
from minimemserve.config import EngineConfig
from minimemserve.disagg import rpc
from minimemserve.disagg.launch import pair_transport, seen_over
from minimemserve.disagg.nixl import nixl_missing
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.errors import ConfigError
from minimemserve_lab.harness.hosts import LocalInstances

CONFIG = EngineConfig(num_blocks=128)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ROLES = ["colocated", "colocated", "prefill", "decode"]  # one set serves every config below
ANSWER_S = 0.5  # how long a knock waits for an answer that must not come


def prompt(seed: int, n: int = 37) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def run_turns(cluster, conversations: int = 3, turns: int = 2) -> list[list[int]]:
    """Multi-turn chats: each turn's prompt is the last one, its answer and new tokens."""
    history = [prompt(i) for i in range(conversations)]
    answers = []
    for t in range(turns):
        rids = [cluster.add_request(h, PARAMS) for h in history]
        outs = {o.request_id: o for o in cluster.run_until_done(120)}
        for i, rid in enumerate(rids):
            assert outs[rid].finish_reason == "length", outs[rid].error
            answers.append(outs[rid].token_ids)
            history[i] = history[i] + outs[rid].token_ids + prompt(100 * t + i, 19)
    return answers


def moved(cluster) -> tuple[int, int, int, str]:
    """Bytes the pools sent, bytes sent and received over links, and the links' transports."""
    stats = {n: s for n, s in cluster.stats().items() if n != "frontend"}
    pools = sum(s["pool"]["counters"]["sent_bytes"] for s in stats.values())
    links = [link for s in stats.values() for link in s["links"].values()]
    kinds = ",".join(sorted({link["transport"] for link in links}))
    return pools, sum(x["sent_bytes"] for x in links), sum(x["recv_bytes"] for x in links), kinds


def _instances(model_dir, tmp_path_factory, transport: str):
    d = tmp_path_factory.mktemp("hosts")
    with LocalInstances(
        ROLES, d / "cluster.key", model_dir=model_dir, transport=transport, log_dir=d
    ) as inst:
        yield inst


@pytest.fixture(scope="module")
def local(tiny_llama_dir, tmp_path_factory):
    """Standalone instances of every role that move KV over gloo."""
    yield from _instances(tiny_llama_dir, tmp_path_factory, "gloo")


@pytest.fixture(scope="module")
def local_nixl(tiny_llama_dir, tmp_path_factory):
    """The same over NIXL (skipped where the nixl extra does not load)."""
    if (why := nixl_missing()) is not None:
        pytest.skip(why)
    yield from _instances(tiny_llama_dir, tmp_path_factory, "nixl")


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
@pytest.mark.parametrize("config", ["PD-CC", "1P1D", "1P1D-CC3"])
def test_same_tokens_and_bytes_as_single_host(tiny_llama_dir, request, config, transport):
    local = request.getfixturevalue("local" if transport == "gloo" else "local_nixl")
    # routing that never moves a prefix between colocated instances: whether prompt_tree
    # pushes one depends on timing, and the bytes compared here must not
    kw = {"engine": CONFIG, "policy": "prompt_tree_local"}
    with ProcessCluster.of(tiny_llama_dir, config, **kw) as ref:  # shared memory
        want, (ref_bytes, *_) = run_turns(ref), moved(ref)
        ref.check_pools()
    addresses = local.addresses[:2] if config.startswith("PD") else local.addresses[2:]
    with ProcessCluster.of(tiny_llama_dir, config, instances=addresses, key=local.key, **kw) as c:
        assert all(i.process is None and i.info.handle is None for i in c.instances.values())
        assert run_turns(c) == want
        pools, sent, received, kinds = moved(c)
        c.check_pools()
    assert pools == sent == received == ref_bytes
    if config != "PD-CC":  # colocated instances move no KV under prompt_tree_local
        assert kinds == transport and sent > 0


def test_join_refuses_a_wrong_key_and_a_wrong_deployment(tiny_llama_dir, local, tmp_path):
    other = tmp_path / "other.key"
    rpc.ClusterKey.generate().save(other)
    with pytest.raises(Exception, match="no instance answers"):  # its frames are dropped
        ProcessCluster.of(
            tiny_llama_dir, "1P1D", instances=local.addresses[2:], key=other, startup_timeout_s=1.0
        )
    with pytest.raises(ConfigError, match="has no 'colocated' role"):
        ProcessCluster.of(tiny_llama_dir, "1P1D", instances=local.addresses[:1], key=local.key)
    with pytest.raises(ConfigError, match="needs \\['decode'\\]"):
        ProcessCluster.of(tiny_llama_dir, "1P1D", instances=local.addresses[2:3], key=local.key)
    os.chmod(other, 0o644)
    with pytest.raises(ConfigError, match="open to group or others"):
        ProcessCluster.of(tiny_llama_dir, "1P1D", instances=local.addresses[2:], key=other)
    with (
        ProcessCluster.of(
            tiny_llama_dir,
            "1P1D",
            engine=CONFIG,  # still joinable
            instances=local.addresses[2:],
            key=local.key,
        ) as c
    ):
        assert len(run_turns(c, 1, 1)) == 1


# ---- two network namespaces ------------------------------------------------------------------
@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (name, our address, its address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    name, here, there, net = f"mms{tag}", f"mmsa{tag}", f"mmsb{tag}", random.randrange(1, 250)
    a, b = f"10.231.{net}.1", f"10.231.{net}.2"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", name],
        ["ip", "addr", "add", f"{a}/24", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{b}/24", "dev", there],
        ["ip", "netns", "exec", name, "ip", "link", "set", there, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make a network namespace here: {e}")
    try:
        yield name, a, b
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)


@pytest.mark.parametrize("transport", ["auto", "gloo"])
def test_instances_in_two_network_namespaces(
    tiny_llama_dir, tmp_path, netns, transport, monkeypatch
):
    """KV across a veth pair: over NIXL (what "auto" picks where both instances have it) or
    torch.distributed, the tokens and bytes of shared memory on one host. UCX would still find
    cross-memory attach between namespaces of one kernel; kept to TCP, NIXL's data crosses the
    veth pair as it would between hosts."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    name, here, there = netns
    want_kind = transport if transport != "auto" else "gloo" if nixl_missing() else "nixl"
    with ProcessCluster.of(tiny_llama_dir, "1P1D-CC", engine=CONFIG) as ref:
        want, (ref_bytes, *_) = run_turns(ref), moved(ref)
    with (
        LocalInstances(
            ["prefill", "decode"],
            tmp_path / "k",
            model_dir=tiny_llama_dir,
            hosts=[here, there],
            netns=[None, name],
            log_dir=tmp_path,
            transport=transport,
        ) as inst,
        ProcessCluster.of(
            tiny_llama_dir,
            "1P1D-CC",
            engine=CONFIG,
            cluster_host=here,
            instances=inst.addresses,
            key=inst.key,
        ) as c,
    ):
        p, d = c.instances["P0"].info, c.instances["D0"].info
        assert p.host != d.host and p.transport == d.transport == transport
        assert run_turns(c) == want
        pools, sent, received, kinds = moved(c)
        c.check_pools()
    assert kinds == want_kind and pools == sent == received == ref_bytes > 0


# ---- hostile connections ---------------------------------------------------------------------
def knock(address: str, frame: bytes, curve: tuple[bytes, bytes] | None, server_key: bytes):
    """Send one frame from a fresh socket; returns the answer, or None if none came."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(address)
    try:
        sock.send(frame)
        return sock.recv() if sock.poll(int(ANSWER_S * 1000)) else None
    finally:
        sock.close(linger=0)
        ctx.term()


def test_hostile_connections_leave_the_instance_serving(tiny_llama_dir, tmp_path):
    host = "127.0.0.2"  # not one of the loopback names: sockets are CURVE-encrypted
    with (
        LocalInstances(
            ["prefill", "decode"],
            tmp_path / "k",
            model_dir=tiny_llama_dir,
            hosts=[host, host],
            log_dir=tmp_path,
        ) as inst,
        ProcessCluster.of(
            tiny_llama_dir,
            "1P1D",
            engine=CONFIG,
            cluster_host=host,
            instances=inst.addresses,
            key=inst.key,
        ) as c,
    ):
        key = rpc.ClusterKey.load(inst.key)
        target = "tcp://" + inst.addresses[1]
        stats = rpc.Stream().envelope("req", 1, "frontend", "D0", rpc.Query("stats"))
        good = rpc.Codec(key.secret).encode(stats)
        assert knock(target, good, key.curve, key.curve[0]) is not None  # the key holder's
        payload = msgspec.msgpack.encode(
            {
                "kind": "req",
                "seq": 7,
                "sender": "frontend",
                "to": "D0",
                "stream": 1,
                "count": 1,
                "sent": 0.0,
                "msg": {
                    "type": "Submit",
                    "request_id": 5,
                    "prompt": "abc",
                    "params": [],
                    "arrival_time": "now",
                },
            }
        )
        typed_wrong = hmac.digest(key.secret, payload, "sha256") + payload
        before = c.stats()["D0"]["rejected"]
        assert knock(target, good, None, key.curve[0]) is None  # no CURVE: no handshake
        assert knock(target, good, zmq.curve_keypair(), key.curve[0]) is None  # wrong key
        d_host, d_port = inst.addresses[1].split(":")
        with socket.create_connection((d_host, int(d_port))) as s:  # noise
            s.sendall(os.urandom(1 << 16))
        assert c.stats()["D0"]["rejected"] == before  # none of those reached a handler
        answer = knock(target, typed_wrong, key.curve, key.curve[0])  # a member's bad message
        env = rpc.Codec(key.secret).decode(answer)
        assert isinstance(env.msg, rpc.Error) and "malformed" in env.msg.message
        assert knock(target, b"\0" * (100 << 20), key.curve, key.curve[0]) is None  # 100 MB
        assert c.stats()["D0"]["rejected"] == before + 1
        assert len(run_turns(c, 2, 2)) == 4  # still serving
        c.check_pools()


# ---- a remote decode instance lost -----------------------------------------------------------
@contextlib.contextmanager
def joined(model_dir, tmp_path, roles: list[str], config: str, transport: str):
    """Standalone instances of ``roles`` joined as ``config``, one declared dead after 2 s of
    silence: yields them and the cluster."""
    with (
        LocalInstances(
            roles, tmp_path / "k", model_dir=model_dir, transport=transport, log_dir=tmp_path
        ) as inst,
        ProcessCluster.of(
            model_dir,
            config,
            engine=CONFIG,
            instances=inst.addresses,
            key=inst.key,
            heartbeat_timeout_s=2.0,
            timeout_s=4.0,
        ) as c,
    ):
        yield inst, c


def step_until_on(c, rids: list[str], name: str) -> list:
    """Step ``c`` until one of ``rids`` runs on instance ``name`` (a minute at most); returns
    the outputs that finished meanwhile."""
    outs, deadline = [], time.monotonic() + 60
    while not any(c.location(r) == name for r in rids) and time.monotonic() < deadline:
        outs += c.step()
    return outs


@pytest.mark.parametrize("transport", ["gloo", "nixl"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_losing_a_remote_decode_instance(tiny_llama_dir, tmp_path, how, transport):
    if transport == "nixl" and (why := nixl_missing()) is not None:
        pytest.skip(why)
    long = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    roles = ["prefill", "decode", "decode"]
    with joined(tiny_llama_dir, tmp_path, roles, "1P2D", transport) as (inst, c):
        victim = inst.procs[1]  # D0: the first decode address
        rids = [c.add_request(prompt(i), long) for i in range(6)]
        outs = step_until_on(c, rids, "D0")
        os.kill(victim.pid, how)
        outs += c.run_until_done(timeout_s=120)
        assert sorted(o.request_id for o in outs) == sorted(rids)  # none lost
        for o in outs:
            done = o.finish_reason == "length" and len(o.token_ids) == 160
            assert done or (o.finish_reason == "error" and "InstanceDied" in o.error), o
        assert "D0" in c.dead and set(c.stats()) == {"P0", "D1", "frontend"}
        c.check_pools()  # the survivors hold nothing for D0, nothing referenced
        if how == signal.SIGSTOP:  # woken, it drops the session and rejoins this frontend
            os.kill(victim.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while "D0" in c.dead and time.monotonic() < deadline:
                c.step()
            assert not c.dead and c.num_rejoins == 1, inst.log(1)[-2000:]
            busy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            rids = [c.add_request(prompt(50 + i), busy) for i in range(4)]  # D1 gets busy
            outs = c.run_until_done(60)
            assert sorted(o.request_id for o in outs) == sorted(rids)
            assert all(o.finish_reason == "length" for o in outs)
            assert "D0" in {o.metrics.decode_instance for o in outs}  # it serves again
            c.check_pools()  # D0 included
            links = c.stats()["P0"]["links"]
            assert links["D0"]["transport"] == transport  # a new link with D0


FRONTEND_SCRIPT = """
import sys, time
from minimemserve.disagg.runtime import ProcessCluster
from minimemserve.config import EngineConfig
c = ProcessCluster.of(sys.argv[1], "1P1D", engine=EngineConfig(num_blocks=128),
                   instances=sys.argv[3:], key=sys.argv[2], heartbeat_timeout_s=2.0)
print("joined", flush=True)
time.sleep(600)
"""


def test_instances_outlive_a_killed_frontend(tiny_llama_dir, tmp_path):
    with LocalInstances(
        ["prefill", "decode"],
        tmp_path / "k",
        model_dir=tiny_llama_dir,
        transport="gloo",
        log_dir=tmp_path,
    ) as inst:
        cmd = [sys.executable, "-c", FRONTEND_SCRIPT, str(tiny_llama_dir), str(inst.key)]
        front = subprocess.Popen(cmd + inst.addresses, stdout=subprocess.PIPE, text=True)
        assert front.stdout.readline().strip() == "joined"
        front.kill()  # no Shutdown: the instances notice the silence and end the session
        front.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            inst.log(i).count("waiting for a frontend") == 2 for i in (0, 1)
        ):
            time.sleep(0.2)
        assert all("nothing from the frontend" in inst.log(i) for i in (0, 1))
        with ProcessCluster.of(
            tiny_llama_dir, "1P1D", engine=CONFIG, instances=inst.addresses, key=inst.key
        ) as c:
            assert len(run_turns(c, 2, 1)) == 2
            c.check_pools()


def test_the_instance_command_names_what_is_wrong(tmp_path, capsys):
    key = tmp_path / "k"
    assert cli.main(["keygen", "--out", str(key)]) == 0
    cases = [
        (["keygen", "--out", str(key)], "File exists"),  # never overwrites a key
        (
            [
                "instance",
                "--role",
                "decode",
                "--listen",
                "127.0.0.1:7001",
                "--key",
                str(tmp_path / "none"),
            ],
            "No such file",
        ),
        (
            ["instance", "--role", "decode", "--listen", "0.0.0.0:7001", "--key", str(key)],
            "not a wildcard",
        ),
        (["instance", "--role", "decode", "--listen", "127.0.0.1", "--key", str(key)], "HOST:PORT"),
        (
            [
                "instance",
                "--role",
                "decode",
                "--listen",
                "127.0.0.1:7001",
                "--key",
                str(key),
                "--transport",
                "nccl",
            ],
            "CUDA",
        ),
    ]
    for argv, why in cases:
        with pytest.raises(SystemExit, match=why):
            cli.main(argv)
    os.chmod(key, 0o640)
    with pytest.raises(SystemExit, match="open to group or others"):
        cli.main(["instance", "--role", "decode", "--listen", "127.0.0.1:7001", "--key", str(key)])


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_tensor_parallel_instances_over_nixl(tiny_llama_dir, local_nixl, p_tp, d_tp):
    """A tensor-parallel prefill or decode instance on its own: KV between it and a one-rank
    peer over NIXL (through its whole-model landing or staging tensor) gives the tokens and
    the bytes of a one-rank deployment over shared memory."""
    kw = {"policy": "prompt_tree_local"}
    with ProcessCluster.of(tiny_llama_dir, "1P1D-CC", engine=CONFIG, **kw) as ref:
        want, (ref_bytes, *_) = run_turns(ref), moved(ref)
    tp = dataclasses.replace(CONFIG, tensor_parallel_size=p_tp, decode_tensor_parallel_size=d_tp)
    with ProcessCluster.of(
        tiny_llama_dir,
        "1P1D-CC",
        engine=tp,
        instances=local_nixl.addresses[2:],
        key=local_nixl.key,
        **kw,
    ) as c:
        assert run_turns(c) == want
        pools, sent, received, kinds = moved(c)
        c.check_pools()
        assert {n: s["ranks"] for n, s in c.stats().items() if n != "frontend"} == {
            "P0": p_tp,
            "D0": d_tp,
        }
    assert kinds == "nixl" and pools == sent == received == ref_bytes > 0


def test_losing_a_prefill_instance_while_it_writes_over_nixl(tiny_llama_dir, tmp_path):
    """P killed while it hands requests over: what reached D finishes, the rest fail clearly,
    and D gives back every block it granted to P's transfers."""
    if (why := nixl_missing()) is not None:
        pytest.skip(why)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    with joined(tiny_llama_dir, tmp_path, ["prefill", "decode"], "1P1D", "nixl") as (inst, c):
        rids = [c.add_request(prompt(i, 120), params) for i in range(8)]
        outs = step_until_on(c, rids, "D0")
        os.kill(inst.procs[0].pid, signal.SIGKILL)  # mid-way through its hand-offs
        outs += c.run_until_done(timeout_s=120)
        assert sorted(o.request_id for o in outs) == sorted(rids)  # none lost, none hung
        finished = [o for o in outs if o.finish_reason == "length"]
        for o in outs:
            assert o in finished or (o.finish_reason == "error" and "InstanceDied" in o.error), o
        assert finished and len(finished) < len(rids) and "P0" in c.dead
        report = c.check_pools()["D0"]  # nothing referenced: the grants to P0 were released
        assert report["ok"] and c.stats()["D0"]["grants"].get("P0", 0) == 0


def test_pair_transport_prefers_nixl_between_hosts_where_both_have_an_agent():
    agent = {"nixl": b"the agent's data, opaque to the frontend"}

    def inst(name: str, host: str, transport: str = "auto", links=agent) -> rpc.PeerInfo:
        return rpc.PeerInfo(name, "prefill", "", None, host, transport, links)

    assert pair_transport(inst("a", "h1"), inst("b", "h1")) == "shm"
    assert pair_transport(inst("a", "h1"), inst("b", "h2")) == "nixl"
    assert pair_transport(inst("a", "h1"), inst("b", "h2", links={})) == "gloo"
    assert pair_transport(inst("a", "h1"), inst("b", "h1"), "nixl") == "nixl"
    assert seen_over(inst("b", "h2"), "gloo").links == {}  # the agent only to NIXL peers
    assert seen_over(inst("b", "h2"), "nixl").links == agent
    with pytest.raises(ConfigError, match="b has no NIXL agent"):
        pair_transport(inst("a", "h1"), inst("b", "h2", links={}), "nixl")
    with pytest.raises(ConfigError, match="asks for nixl KV transport, b for gloo"):
        pair_transport(inst("a", "h1", "nixl"), inst("b", "h2", "gloo"))


def test_a_tensor_parallel_standalone_instance_needs_nixl(tiny_llama_dir, local):
    tp = dataclasses.replace(CONFIG, decode_tensor_parallel_size=2)
    with pytest.raises(Exception, match="only over the nixl transport"):
        ProcessCluster.of(
            tiny_llama_dir, "1P1D", engine=tp, instances=local.addresses[2:], key=local.key
        )
