"""The SGLang weight-update group is made from its TCP store, never split from the trainer's default group.

DeepSpeed binds the default group to the rank's GPU; torch then builds later NCCL groups by ``ncclCommSplit`` of
that communicator when the default group has a ``bound_device_id`` (``_new_process_group_helper`` asks
``_get_split_source``). On CPU the split itself cannot run, so this checks the decision torch takes: with a bound
default group, our group creation must never ask for a split source."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from backends.base import WeightGroupSpec
from backends.sglang_backend import open_weight_update_group


@pytest.fixture
def bound_default_group():
    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    default = distributed_c10d._get_default_group()
    default.bound_device_id = torch.device("cpu", 0)  # as DeepSpeed's device_id leaves it on a GPU rank
    try:
        yield default
    finally:
        default.bound_device_id = None
        dist.destroy_process_group()


def test_the_side_group_is_not_split_from_a_bound_default_group(bound_default_group, monkeypatch):
    asked = []
    real = distributed_c10d._get_split_source
    monkeypatch.setattr(distributed_c10d, "_get_split_source", lambda pg: asked.append(pg) or real(pg))
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    spec = WeightGroupSpec(master_address="127.0.0.1", master_port=store.port, rank_offset=0, world_size=1,
                           group_name="split_check", backend="gloo", timeout_s=30.0)
    group = open_weight_update_group(spec, 0, store=store)
    try:
        assert asked == []  # torch never looked for a communicator to split from
        assert bound_default_group.bound_device_id == torch.device("cpu", 0)  # and the default group is as it was
        flat = torch.ones(4)
        group.broadcast([flat]).wait()
    finally:
        dist.destroy_process_group(group)


def test_a_dropped_sglang_group_leaves_no_registration_behind(monkeypatch):
    """Every engine restart builds a new SGLang-path group; our end must leave torch's tables as it found them."""
    from rlhf_sg.sync.transports import _deregister

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    spec = WeightGroupSpec(master_address="127.0.0.1", master_port=store.port, rank_offset=0, world_size=1,
                           group_name="restart_check", backend="gloo", timeout_s=30.0)
    before = len(distributed_c10d._world.pg_map)
    group = open_weight_update_group(spec, 0, store=store)
    assert len(distributed_c10d._world.pg_map) == before + 1
    group.abort()
    _deregister(group)
    assert group not in distributed_c10d._world.pg_map and len(distributed_c10d._world.pg_map) == before
    again = open_weight_update_group(spec, 0, store=store)  # the name is free again
    again.shutdown()
    _deregister(again)
