"""On real GPUs, through Ray: what only a device can show of placement (``pytest -m gpu``)."""

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

TIMEOUT_S = 300.0


def test_a_two_rank_zero3_group_forms_over_nccl_with_one_gpu_per_rank(ray_cluster, tmp_path):
    """Proves defect 1 fixed on hardware: two ranks with ``num_gpus=1`` each see one GPU, bind CUDA device 0
    with ``LOCAL_RANK`` 0, and form DeepSpeed's NCCL default group (with the global rank as LOCAL_RANK, rank 1
    failed with an invalid device ordinal inside ``deepspeed.init_distributed``), then load the model
    partitioned across them (``zero.Init`` over that group) and answer a call afterwards."""
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.workers import ModelGroup, WorkerSpec

    model = save_tiny_model(str(tmp_path / "policy"))
    spec = WorkerSpec(role="actor", model_path=model, world_size=2, master_addr="", master_port=0, train=True,
                      device="cuda", dtype="bfloat16", timeout_s=TIMEOUT_S)
    group = ModelGroup(spec, num_cpus=1.0, num_gpus=1.0)
    try:
        seen = group.call("placement_seen")
        assert [(s["local_device"], s["local_rank_env"], s["deepspeed_local_rank"]) for s in seen] == [(0, "0", 0)] * 2
        assert seen[0]["cuda_visible_devices"] != seen[1]["cuda_visible_devices"]
        assert len(group.call("resources")) == 2  # both ranks alive after the NCCL group and zero.Init
    finally:
        group.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA devices")
def test_sglang_collective_sync_from_two_zero3_ranks(ray_cluster, task, tmp_path):
    """Proves defect 2 fixed on hardware: with 2 actor ranks DeepSpeed binds the default NCCL group to a device,
    and torch then builds later NCCL groups by splitting that communicator; the weight-sync side group with the
    SGLang scheduler (joined through the TCP store) must be built outside the split, or the scheduler is never
    in it and the first sync hangs. Two GRPO steps on CUDA (actor ranks on GPUs 0 and 1, the SGLang engine on a
    third) with the collective transport: both syncs land, and the engine's log-probs track the trainer's."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang not installed (bash recipes/install/gpu.sh sglang)")
    import arith_task
    from quickstart_cpu import make_config

    from rlhf_sg.trainer import train

    cfg = make_config(*task, str(tmp_path / "run"), 2, "grpo", "sglang")
    cfg.train.device, cfg.train.actor_num_ranks, cfg.train.kl_coef = "cuda", 2, 0.0  # no reference group
    cfg.rollout.weight_transport = "collective"
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    history = train(cfg, reward_fn=arith_task.addition_reward)
    assert [h["weight_version"] for h in history] == [1, 2]
    assert max(h["rollout/logp_gap_engine_vs_trainer"] for h in history) < 0.05
