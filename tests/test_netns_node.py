"""A second Ray node with an address of its own: its processes run in a network namespace joined to this
one by a veth pair (two addresses of the test's choosing, traffic only between them), so loopback on one
node is not the other's. An actor ZeRO-3 group with a rank on each node trains PPO steps (with weight
syncs into the engines); the model group meets at rank 0's node address, and would wait forever at 127.0.0.1.

Needs root and ``ip netns``; skipped otherwise. The namespace, the veth pair and both Ray nodes are the
test's own and are removed after it."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, RECIPES)

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

START_TIMEOUT_S = 120.0
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a network namespace and a veth pair"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (ip netns, ip link)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else f"`ip netns` unavailable: {probe.stderr.decode().strip()}"


def _free_pair(tag: int) -> tuple[str, str]:
    """Two addresses of a /30 in 198.18.0.0/15 (set aside for network testing, RFC 2544) that overlaps none of
    this machine's routes, so the pair never shadows a network the machine uses."""
    import ipaddress

    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                            timeout=30).stdout.split()
    taken = [ipaddress.ip_network(word, strict=False) for word in routes
             if word[:1].isdigit() and ("/" in word or word.count(".") == 3)]
    testing = ipaddress.ip_network("198.18.0.0/15")
    subnets = list(testing.subnets(new_prefix=30))
    for k in range(len(subnets)):
        net = subnets[(tag * 7 + k) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return str(net[1]), str(net[2])
    raise RuntimeError("no free /30 in 198.18.0.0/15 for the namespace pair")


@contextlib.contextmanager
def _veth_namespace():
    """(namespace, host address, namespace address): a fresh namespace behind a veth /30 pair."""
    tag = os.getpid() % 10000
    netns, host_if, ns_if = f"rlhfsg{tag}", f"rsh{tag}", f"rsn{tag}"
    host_addr, ns_addr = _free_pair(tag)
    _ip("netns", "add", netns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", netns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("addr", "add", f"{ns_addr}/30", "dev", ns_if, netns=netns)
        _ip("link", "set", ns_if, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        yield netns, host_addr, ns_addr
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def _start_node(cmd: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115 - the node's process owns it until it ends
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop_node(proc: subprocess.Popen) -> None:
    """End the node's process group (``ray start --block`` and the Ray processes it started): a few seconds to stop
    on SIGTERM (it often waits out its own 30 s for a peer node already gone), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what it left behind in its group


@contextlib.contextmanager
def netns_ray_nodes(tmp_path, num_cpus: int):
    """A head node at the veth host address and a second node inside the namespace; the driver joins."""
    from rlhf_sg.placement import free_port

    with _veth_namespace() as (netns, host_addr, ns_addr):
        # the nodes authenticate the way this process's Ray already does (fixed when Ray was first set up here;
        # a token, when on, is the shared ~/.ray/auth_token)
        from ray._raylet import AuthenticationMode, get_authentication_mode

        auth = "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   RAY_AUTH_MODE=auth,
                   PYTHONPATH=os.pathsep.join([RECIPES, TESTS, os.environ.get("PYTHONPATH", "")]))
        port = free_port(host_addr)
        common = ["--block", "--disable-usage-stats", f"--num-cpus={num_cpus}", "--num-gpus=0"]
        head = _start_node([RAY, "start", "--head", f"--node-ip-address={host_addr}", f"--port={port}",
                            "--include-dashboard=false", f"--dashboard-agent-listen-port={free_port(host_addr)}",
                            *common], env, str(tmp_path / "head.log"))
        nodes = [head]
        try:
            if ray.is_initialized():
                ray.shutdown()  # the session's shared cluster; the next module's ray_cluster starts it again
            ray.init(address=f"{host_addr}:{port}", _node_ip_address=host_addr, log_to_driver=False)
            nodes.append(_start_node(["ip", "netns", "exec", netns, RAY, "start", f"--address={host_addr}:{port}",
                                      f"--node-ip-address={ns_addr}", *common], env, str(tmp_path / "ns.log")))
            _wait_for_nodes(2, START_TIMEOUT_S, tmp_path)
            yield host_addr, ns_addr
        finally:
            ray.shutdown()
            for proc in reversed(nodes):
                _stop_node(proc)


def _wait_for_nodes(count: int, timeout_s: float, tmp_path) -> None:
    """Poll Ray's view of the cluster until ``count`` nodes are alive, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()  # never set: its wait is the poll interval
    while len([n for n in ray.nodes() if n["Alive"]]) < count:
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log")}
            raise TimeoutError(f"{count} Ray nodes not alive within {timeout_s} s; node logs: {logs}")
        tick.wait(0.5)


@pytest.fixture
def two_nodes(tmp_path):
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    with netns_ray_nodes(tmp_path, num_cpus=3) as addresses:
        yield addresses


def test_ppo_steps_with_ranks_and_an_engine_on_a_node_of_its_own(tmp_path, two_nodes):
    import arith_task
    from quickstart_cpu import make_config, prepare

    from rlhf_sg.trainer import PPOTrainer

    host_addr, ns_addr = two_nodes
    policy, prompts = prepare(str(tmp_path / "task"), warm_start_steps=5)
    cfg = make_config(policy, prompts, str(tmp_path / "run"), steps=1, algo="gae", backend="hf")
    cfg.rollout.num_engines = 2
    cfg.rollout.prompts_per_step = 4
    cfg.train.placement_strategy = "STRICT_SPREAD"  # one actor rank and one engine on each node:
    cfg.train.colocate_all = True  # engine i shares bundle i with rank i of every group
    cfg.train.critic_num_ranks = cfg.train.ref_num_ranks = cfg.train.actor_num_ranks
    cfg.train.timeout_s = 120.0  # a rank dialling the wrong address fails within this, named
    cfg.train.max_steps = 2
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    trainer = PPOTrainer(cfg, reward_fn=arith_task.addition_reward)
    try:
        trainer.setup()
        seen = trainer.cluster.actor.call("placement_seen")
        assert {s["node_address"] for s in seen} == {host_addr, ns_addr}
        # every rank met at rank 0's node address: the namespace's loopback is not the head's
        assert {s["master"][0] for s in seen} == {seen[0]["node_address"]}
        engines = ray.get([e.describe.remote() for e in trainer.engines], timeout=START_TIMEOUT_S)
        assert {e["engine_index"] for e in engines} == {0, 1}
        node_address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        assert {node_address[e["node_id"]] for e in engines} == {host_addr, ns_addr}  # an engine on each node
        trainer.train_step()
        metrics = trainer.train_step()
        assert metrics["weight_version"] == 2
        versions = ray.get([e.weight_version.remote() for e in trainer.engines], timeout=START_TIMEOUT_S)
        assert versions == [2, 2]
    finally:
        trainer.shutdown()
