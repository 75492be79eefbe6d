"""The Ray runtime: placement plans (no Ray), then deployments on a two-node
``ray.cluster_utils.Cluster`` on this machine (skipped without the ray extra): the same tokens
as in one process with prefill and decode on different nodes, KV over NIXL or gloo between
them, a tensor-parallel instance's ranks on one node, a decode actor killed mid-run and
restarted, and a deployment that cannot be placed."""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torch

from minimemserve import SamplingParams
from minimemserve.config import EngineConfig, parse_config_name
from minimemserve.deployment import DeploymentSpec
from minimemserve.disagg.nixl import nixl_missing
from minimemserve.disagg.placement import NodeView, Wanted, plan_nodes
from minimemserve.disagg.ray_runtime import import_ray
from minimemserve.errors import ConfigError
from minimemserve.inprocess import InProcessCluster

CONFIG = EngineConfig(num_blocks=128)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CPU = {"CPU": 1.0}
PREFILL_NODE, DECODE_NODE = "prefill_node", "decode_node"  # custom resources of the two nodes


def node(i: int, cpus: float, **extra: float) -> NodeView:
    return NodeView(f"node{i}" + "0" * 40, {"CPU": cpus, **extra}, {"zone": f"z{i}"})


def test_plan_packs_spreads_and_pins():
    nodes = [node(0, 4), node(1, 4, **{DECODE_NODE: 1})]
    wanted = [Wanted("P0", "prefill", 1, CPU), Wanted("D0", "decode", 1, CPU)]
    packed = plan_nodes(wanted, nodes)
    assert packed["P0"] == packed["D0"] == nodes[0].id
    spread = plan_nodes(wanted, nodes, "spread")
    assert (spread["P0"], spread["D0"]) == (nodes[0].id, nodes[1].id)
    pinned = plan_nodes(wanted, nodes, pin={"prefill": DECODE_NODE})
    assert pinned["P0"] == pinned["D0"] == nodes[1].id  # pack follows the pinned one
    by_label = plan_nodes(wanted, nodes, pin={"decode": "zone=z1"})
    assert (by_label["P0"], by_label["D0"]) == (nodes[0].id, nodes[1].id)
    tp = [Wanted("C0", "colocated", 3, CPU), Wanted("C1", "colocated", 3, CPU)]
    assert len(set(plan_nodes(tp, nodes).values())) == 2  # 3 + 3 > 4 per node


def test_plan_names_what_is_missing():
    nodes = [node(0, 2), node(1, 2)]
    with pytest.raises(ConfigError, match=r"decode instance D0: its 3 rank\(s\) need CPU 3"):
        plan_nodes([Wanted("D0", "decode", 3, CPU)], nodes)
    with pytest.raises(ConfigError, match="need CPU 1 on one node with gpu_node.*not gpu_node"):
        plan_nodes([Wanted("D0", "decode", 1, CPU)], nodes, pin={"decode": "gpu_node"})
    with pytest.raises(ConfigError, match="GPU 1 on one node"):
        plan_nodes([Wanted("P0", "prefill", 1, {"GPU": 1.0})], nodes)
    with pytest.raises(ConfigError, match="placement must be one of"):
        DeploymentSpec(placement="anywhere")
    with pytest.raises(ConfigError, match="pin names no role"):
        DeploymentSpec(pin={"encoder": DECODE_NODE})


def test_without_ray_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        import_ray()


def test_importing_the_package_imports_no_ray():
    code = (
        "import sys, minimemserve, minimemserve.deployment, minimemserve.disagg.ray_runtime;"
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_ray_without_token_authentication_is_refused():
    if importlib.util.find_spec("ray") is None:  # not imported here: see ray_cluster
        pytest.skip("the ray extra is not installed")
    code = (
        "import types;"
        "from minimemserve.disagg.ray_runtime import connect;"
        "connect(types.SimpleNamespace(is_initialized=lambda: True), None)"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "RAY_AUTH_MODE": "disabled"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert run.returncode != 0
    assert b"ConfigError: Ray runs without token authentication" in run.stderr


# ---- on a two-node Ray cluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes on this machine (two CPUs each, one with ``prefill_node``, the other with
    ``decode_node`` and the label ``role=decode``), with token authentication; torn down at the
    end."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # before Ray is imported: it reads them once (no test imports it)
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 2, "resources": {PREFILL_NODE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=2, resources={DECODE_NODE: 1}, labels={"role": "decode"})
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, logging_level="warning")
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def prompt(seed: int, n: int = 37) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def reference(model_dir, config: str, prompts, params=PARAMS) -> list[list[int]]:
    c = InProcessCluster(model_dir, parse_config_name(config), engine_config=CONFIG)
    try:
        rids = [c.add_request(p, params) for p in prompts]
        outs = {}
        while c.has_unfinished():
            outs.update((o.request_id, o.token_ids) for o in c.step())
        return [outs[r] for r in rids]
    finally:
        c.close()


def generate(cluster, prompts, params=PARAMS, timeout_s: float = 120) -> list:
    rids = [cluster.add_request(p, params) for p in prompts]
    outs = {o.request_id: o for o in cluster.run_until_done(timeout_s)}
    return [outs[r] for r in rids]


def ray_cluster_of(model_dir, config: str, opts: dict, **kw):
    from minimemserve.disagg.ray_runtime import RayCluster

    fields = {"engine": CONFIG, "runtime": "ray"} | opts | kw
    return RayCluster(DeploymentSpec(config, model_dir, **fields))


def links(cluster) -> list[dict]:
    stats = {n: s for n, s in cluster.stats().items() if n != "frontend"}
    return [link for s in stats.values() for link in s["links"].values()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "config,transport", [("1P1D-CC", "auto"), ("1P1D-CC", "gloo"), ("PD-CC", "auto")]
)
def test_same_tokens_across_two_nodes(ray_cluster, tiny_llama_dir, config, transport):
    """Prefill and decode (or the two colocated instances) on different nodes: the greedy
    tokens of one process; KV moves over NIXL where both instances have an agent, else gloo,
    and the links' byte counters say which."""
    prompts = [prompt(i) for i in range(3)]
    want = reference(tiny_llama_dir, config, prompts)
    opts = {"placement": "spread"}
    with ray_cluster_of(tiny_llama_dir, config, opts, transport=transport) as c:
        assert len({c.node_of(n) for n in c.instances}) == 2
        assert [o.token_ids for o in generate(c, prompts)] == want
        turn2 = [p + w + prompt(50 + i, 11) for i, (p, w) in enumerate(zip(prompts, want))]
        assert [o.token_ids for o in generate(c, turn2)] == reference(tiny_llama_dir, config, turn2)
        kinds = {link["transport"] for link in links(c)}
        sent = sum(link["sent_bytes"] for link in links(c))
        received = sum(link["recv_bytes"] for link in links(c))
        c.check_pools()
    expect = transport if transport != "auto" else "gloo" if nixl_missing() else "nixl"
    assert kinds == {expect}
    assert sent == received
    if config != "PD-CC":  # 1P1D moves every request's KV; PD-CC only pushed prefixes
        assert sent > 0


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_on_one_node(ray_cluster, tiny_llama_dir):
    if (why := nixl_missing()) is not None:
        pytest.skip(why)  # a standalone TP instance's KV reaches peers over NIXL
    prompts = [prompt(i) for i in range(2)]
    want = reference(tiny_llama_dir, "PD", prompts)
    engine = EngineConfig(num_blocks=128, tensor_parallel_size=2)
    opts = {"pin": {"colocated": "role=decode"}}  # by the second node's label
    with ray_cluster_of(tiny_llama_dir, "PD", opts, num_colocated=1, engine=engine) as c:
        ranks = c.actors.nodes_of_ranks("C0")
        assert len(ranks) == 2 and set(ranks) == {c.node_of("C0")}
        labelled = [n["NodeID"] for n in ray_cluster.nodes() if DECODE_NODE in n["Resources"]]
        assert ranks[0] in labelled
        assert c.stats()["C0"]["ranks"] == 2
        assert [o.token_ids for o in generate(c, prompts)] == want
        c.check_pools()


@pytest.mark.timeout(300)
def test_killed_decode_actor_fails_its_requests_and_rejoins(ray_cluster, tiny_llama_dir):
    """Prefill and decode pinned to one node each; decode killed mid-run: its requests end with
    an error naming it (no decode instance is left to re-run them) or are re-run once it is
    back, the prefill pool balances; Ray restarts the actor, it rejoins, and it serves the same
    tokens again."""
    prompts = [prompt(i) for i in range(3)]
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    opts = {"pin": {"prefill": PREFILL_NODE, "decode": DECODE_NODE}, "max_restarts": 1}
    with ray_cluster_of(tiny_llama_dir, "1P1D-CC", opts, heartbeat_timeout_s=60.0) as c:
        decode_node = c.node_of("D0")
        assert c.node_of("P0") != decode_node
        pid = ray_cluster.get(c.actors.placed["D0"].actor.where.remote())["pid"]
        rids = [c.add_request(p, long) for p in prompts]
        deadline = time.monotonic() + 60
        while not any(c.location(r) == "D0" for r in rids) and time.monotonic() < deadline:
            c.step()
        os.kill(pid, signal.SIGKILL)
        outs = {o.request_id: o for o in c.run_until_done(120)}
        assert "D0" in c.dead and "Ray actor died" in c.dead["D0"]
        want = reference(tiny_llama_dir, "1P1D-CC", prompts, long)
        for r, tokens in zip(rids, want):  # failed naming D0, or re-run once it came back
            if outs[r].finish_reason == "error":
                assert "D0" in outs[r].error
            else:
                assert outs[r].token_ids == tokens
        c.check_pools()  # the survivor: P0
        deadline = time.monotonic() + 120
        while c.num_rejoins < 1 and time.monotonic() < deadline:
            c.step()
        assert c.num_rejoins == 1 and "D0" not in c.dead
        assert c.node_of("D0") == decode_node  # its placement group stayed there
        assert [o.token_ids for o in generate(c, prompts)] == reference(
            tiny_llama_dir, "1P1D-CC", prompts
        )
        assert links(c) and all(link["sent_bytes"] + link["recv_bytes"] for link in links(c))
        c.check_pools()


@pytest.mark.timeout(120)
def test_a_deployment_that_cannot_be_placed_fails_at_start(ray_cluster, tiny_llama_dir):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"prefill instance P0: its 1 rank\(s\) need CPU 3"):
        ray_cluster_of(tiny_llama_dir, "1P1D", {"cores_per_instance": 3})
    with pytest.raises(ConfigError, match="with gpu_node"):
        ray_cluster_of(tiny_llama_dir, "1P1D", {"pin": {"decode": "gpu_node"}})
    engine = EngineConfig(num_blocks=128, decode_tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"decode instance D0: its 3 rank\(s\) need CPU 3"):
        ray_cluster_of(tiny_llama_dir, "1P1D", {}, engine=engine)
    assert time.monotonic() - start < 30
    assert not ray_cluster.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray_cluster.util.placement_group_table().values()
    )
