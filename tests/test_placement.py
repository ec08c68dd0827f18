"""What a rank computes from its environment (rlhf_sg.placement), without Ray or a GPU.

The environments are the ones Ray gives an actor: ``CUDA_VISIBLE_DEVICES`` holding the ids it was assigned,
as the node listed them (integers, ``GPU-<uuid>``, ``MIG-<uuid>``)."""

import pytest

from rlhf_sg.placement import RankPlacement, local_device_index, visible_devices

UUID_A = "GPU-8d7c2b3e-1111-2222-3333-444455556666"
UUID_B = "GPU-0f4e9a11-aaaa-bbbb-cccc-ddddeeeeffff"
MIG = "MIG-5c3d1e2f-7777-8888-9999-000011112222"


@pytest.mark.parametrize("gpu_id", ["3", UUID_A, MIG])
def test_a_one_gpu_actor_is_on_device_0_whatever_the_id(gpu_id):
    # Ray on a 4-GPU node gives global rank 3 of a group the GPU "3": CUDA numbers it 0 in that process
    assert local_device_index({"CUDA_VISIBLE_DEVICES": gpu_id}, [gpu_id]) == 0


def test_the_global_rank_a_launcher_may_have_left_is_not_the_device():
    # LOCAL_RANK inherited from the driver (or set to the global rank) does not override Ray's assignment
    env = {"CUDA_VISIBLE_DEVICES": "2", "LOCAL_RANK": "2"}
    assert local_device_index(env, ["2"]) == 0


def test_several_visible_devices_index_by_position():
    env = {"CUDA_VISIBLE_DEVICES": f"{UUID_A},{UUID_B}"}
    assert local_device_index(env, [UUID_B]) == 1
    assert local_device_index({"CUDA_VISIBLE_DEVICES": "4,6,7"}, [7, 4]) == 2  # Ray may list ints


def test_without_ray_a_launchers_local_rank_is_kept():
    assert local_device_index({"LOCAL_RANK": "3"}) == 3
    assert local_device_index({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "1"}) == 1
    assert local_device_index({}) == 0


def test_an_unreachable_device_is_refused_with_the_variable_named():
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        local_device_index({"CUDA_VISIBLE_DEVICES": UUID_A}, [UUID_B])
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but CUDA_VISIBLE_DEVICES lists 1"):
        local_device_index({"CUDA_VISIBLE_DEVICES": "5", "LOCAL_RANK": "2"})
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES is unset"):
        local_device_index({}, [MIG])


def test_visible_devices_keeps_ids_as_strings():
    assert visible_devices({"CUDA_VISIBLE_DEVICES": f" {MIG}, 3 "}) == [MIG, "3"]
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_local_rank_is_assigned_not_defaulted():
    env = {"LOCAL_RANK": "1"}
    RankPlacement((UUID_A,), 0, 0, "10.0.0.2").export_local_rank(env)
    assert env["LOCAL_RANK"] == "0"


def test_zero3_on_cuda_gets_gpu_settings_and_cpu_keeps_the_test_settings():
    from rlhf_sg.distributed import zero3_config

    gpu = zero3_config(dtype="bfloat16", device="cuda")["zero_optimization"]
    assert (gpu["stage3_param_persistence_threshold"], gpu["overlap_comm"]) == (100_000, True)
    cpu = zero3_config()["zero_optimization"]
    assert (cpu["stage3_param_persistence_threshold"], cpu["overlap_comm"]) == (0, False)
    assert zero3_config(device="cuda", param_persistence_threshold=0)["zero_optimization"][
        "stage3_param_persistence_threshold"] == 0


def test_gloo_listens_on_the_interface_of_the_node_address():
    import socket

    from rlhf_sg.placement import export_gloo_interface

    env = {}
    assert export_gloo_interface("127.0.0.1", env) is not None and "GLOO_SOCKET_IFNAME" not in env  # loopback: no pin
    assert export_gloo_interface("192.0.2.255", env) is None and env == {}  # an address this machine lacks
    kept = {"GLOO_SOCKET_IFNAME": "ib0"}
    assert export_gloo_interface(socket.gethostbyname("localhost"), kept) == "ib0"  # the user's own choice wins


@pytest.mark.parametrize("colocate_all", [False, True])
def test_groups_load_side_by_side_and_colocated_engines_start_first_and_alone(monkeypatch, colocate_all):
    """The cluster's start order, with Ray's calls recorded at the boundary: groups on devices of their own are all
    started before any is waited on, with the engines in between; engines sharing devices with the trainer (an
    engine sizes its KV cache from the memory it finds free) are started and ready before any group starts."""
    from rlhf_sg.config import Config
    from rlhf_sg.trainer import cluster as cluster_module

    events = []

    class Group:
        def __init__(self, role):
            self.role = role
            events.append(f"launch {role}")

        def wait_started(self):
            events.append(f"ready {self.role}")

        def call(self, method, *args, **kwargs):
            events.append(method)

    class Bundles:
        size = 2

    cfg = Config()
    cfg.train.kl_coef, cfg.train.colocate_all = 0.01, colocate_all
    cluster = cluster_module.Cluster(cfg)
    monkeypatch.setattr(cluster, "_start_shared_bundles",
                        lambda: dict.fromkeys(("actor", "ref", "engines"), Bundles()) if colocate_all else {})
    monkeypatch.setattr(cluster, "_start_engines", lambda: events.append("engines ready") or ["engine"])
    monkeypatch.setattr(cluster, "_group", lambda role, shared: Group(role))
    cluster._start_groups()
    roles = [e.split()[1] for e in events if e.startswith("launch")]
    assert set(roles) >= {"actor", "ref"}
    if colocate_all:
        assert events[0] == "engines ready"
    else:
        assert events.index("engines ready") > max(events.index(f"launch {r}") for r in roles)
        assert events.index("engines ready") < min(events.index(f"ready {r}") for r in roles)
    assert all(events.index(f"ready {r}") < events.index("setup_weight_sync") for r in roles)


def test_a_rendezvous_port_is_never_handed_out_twice(monkeypatch):
    """Groups start side by side, so a port picked free for one group is still free (unbound) when the next group
    asks: the node's probe is asked again until it gives a port not handed out. Ray's calls are faked at the
    boundary with the real signatures' shapes; the probe answers the same port twice, then another."""
    import importlib

    import ray

    from rlhf_sg import placement

    pg_module = importlib.import_module("ray.util.placement_group")  # the attribute of ray.util is the function

    answers = iter([("10.0.0.2", 40001), ("10.0.0.2", 40001), ("10.0.0.2", 40002)])

    class Probe:
        def options(self, **kwargs):
            return self

        def remote(self):
            return next(answers)

    monkeypatch.setattr(placement, "_HANDED_OUT", set())
    monkeypatch.setattr(pg_module, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: "ab" * 28}})
    monkeypatch.setattr(ray, "remote", lambda fn: Probe())
    monkeypatch.setattr(ray, "wait", lambda refs, timeout: (refs, []))
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    assert placement.rendezvous_for_bundle("pg") == ("10.0.0.2", 40001)
    assert placement.rendezvous_for_bundle("pg") == ("10.0.0.2", 40002)
