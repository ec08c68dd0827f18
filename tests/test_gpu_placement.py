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
