"""Ranks and engines placed by Ray the way a GPU node places them (logical GPUs: Ray sets each actor's
``CUDA_VISIBLE_DEVICES``), checked from inside: device index, LOCAL_RANK as DeepSpeed read it, rendezvous."""

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from rlhf_sg.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("placement") / "policy"))


def _spec(role, model_path, world_size, train):
    from rlhf_sg.workers import WorkerSpec

    # the rendezvous left empty, as Layout.worker_spec leaves it: ModelGroup fills it in once placed
    return WorkerSpec(role=role, model_path=model_path, world_size=world_size, master_addr="", master_port=0,
                      train=train, device="cpu", timeout_s=TIMEOUT_S)


def _check_ranks(seen, world_size):
    assert [s["rank"] for s in seen] == list(range(world_size))
    ids = [s["cuda_visible_devices"] for s in seen]
    assert all(len(i.split(",")) == 1 for i in ids), ids  # one GPU per rank, as Ray gives it
    assert [s["gpu_ids"] for s in seen] == [[i] for i in ids]
    # CUDA index 0 and LOCAL_RANK 0 on every rank, never the global rank; DeepSpeed's engine read the same
    assert [(s["local_device"], s["local_rank_env"], s["deepspeed_local_rank"]) for s in seen] == \
        [(0, "0", 0)] * world_size
    # the group met at rank 0's node address (what other nodes reach), not at loopback chosen on the driver
    assert all(s["master"] == seen[0]["master"] for s in seen)
    assert seen[0]["master"][0] == seen[0]["node_address"]


def test_a_two_rank_group_on_one_gpu_each_sees_device_0_and_local_rank_0(ray_cluster, tiny_model):
    from rlhf_sg.workers import ModelGroup

    group = ModelGroup(_spec("actor", tiny_model, 2, train=True), num_cpus=1.0, num_gpus=1.0)
    try:
        seen = group.call("placement_seen")
        _check_ranks(seen, 2)
        assert seen[0]["cuda_visible_devices"] != seen[1]["cuda_visible_devices"]
    finally:
        group.shutdown()


def test_colocated_groups_share_each_ranks_gpu_and_an_engine_sees_device_0(ray_cluster, tiny_model):
    from backends.base import BackendConfig
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.workers import ModelGroup, SharedBundles

    shared = SharedBundles.create(2, tenants=3, device="cuda", strategy="PACK", timeout_s=TIMEOUT_S)
    groups, engines = [], []
    try:
        for role, train in (("actor", True), ("ref", False)):
            groups.append(ModelGroup(_spec(role, tiny_model, 2, train), shared=shared))
        engines = start_engine_actors("hf", BackendConfig(model_path=tiny_model, device="cpu", num_threads=1), 2,
                                      shared=shared)
        actor, ref = (g.call("placement_seen") for g in groups)
        _check_ranks(actor, 2)
        _check_ranks(ref, 2)
        import ray

        described = ray.get([e.describe.remote() for e in engines], timeout=TIMEOUT_S)
        # rank i of every tenant and engine i share bundle i's GPU, and each sees it as its device 0
        for i in range(2):
            assert actor[i]["gpu_ids"] == ref[i]["gpu_ids"] == described[i]["gpu_ids"]
            assert described[i]["local_device"] == 0
        assert actor[0]["gpu_ids"] != actor[1]["gpu_ids"]
    finally:
        import ray

        for e in engines:
            ray.kill(e)
        for g in groups:
            g.shutdown()
        shared.remove()


def test_a_group_whose_rendezvous_port_is_taken_starts_again_on_another(ray_cluster, tiny_model, monkeypatch,
                                                                          caplog):
    """The port a group picks free on rank 0's node can be bound by another process (another job's ranks, Ray's
    workers) before rank 0 binds it: rank 0 then fails at once with EADDRINUSE while the other ranks wait to meet
    there. The group starts its ranks again on a port picked anew, and says so."""
    import socket

    from rlhf_sg import placement
    from rlhf_sg.workers import ModelGroup

    held = socket.socket()
    held.bind(("", 0))  # every address, as the store binds its port
    held.listen()
    taken = held.getsockname()[1]
    real, picks = placement.rendezvous_for_bundle, []

    def pick(pg, bundle_index=0, timeout_s=60.0):
        host, port = real(pg, bundle_index, timeout_s)
        picks.append(taken if not picks else port)  # the first pick is taken before rank 0 binds it
        return host, picks[-1]

    monkeypatch.setattr(placement, "rendezvous_for_bundle", pick)
    try:
        with caplog.at_level("WARNING", logger="rlhf_sg"):
            group = ModelGroup(_spec("ref", tiny_model, 2, train=False), num_cpus=1.0)
        try:
            seen = group.call("placement_seen")
        finally:
            group.shutdown()
    finally:
        held.close()
    assert len(picks) == 2 and picks[1] != taken
    assert [tuple(s["master"]) for s in seen] == [(seen[0]["node_address"], picks[1])] * 2
    assert f"ref: rendezvous port {taken} on {seen[0]['node_address']} was taken by another process" in caplog.text
