import contextlib
import os

import pytest
import torch

# One thread per test process: CI has two cores and Ray/DeepSpeed tests start their own workers.
torch.set_num_threads(max(1, int(os.environ.get("RLHF_SG_TEST_THREADS", "1"))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@contextlib.contextmanager
def two_ray_nodes(num_cpus: int, pythonpath: list[str]):
    """A Ray cluster of two simulated nodes on this machine (``num_cpus`` each), connected as the driver."""
    import ray
    from ray import cluster_utils

    os.environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])
    os.environ["DS_ACCELERATOR"] = "cpu"
    if ray.is_initialized():
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus})
    cluster.add_node(num_cpus=num_cpus)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
