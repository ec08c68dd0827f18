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
