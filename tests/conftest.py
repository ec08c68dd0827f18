import contextlib
import functools
import importlib
import importlib.util
import os
import warnings

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(os.path.dirname(TESTS), "recipes")
# Logical GPUs of the session's Ray cluster: Ray sets CUDA_VISIBLE_DEVICES per actor exactly as on a GPU node
# (an actor that asks for one GPU sees one, index 0), so placement decisions are tested where a GPU run makes them.
RAY_LOGICAL_GPUS = 4

# One thread per test process: CI has two cores and Ray/DeepSpeed tests start their own workers.
torch.set_num_threads(max(1, int(os.environ.get("RLHF_SG_TEST_THREADS", "1"))))


# What the fast tier (`pytest -m "not slow"`) may not start; a test that does must be marked slow.
# zero3_rank.in_fresh_process: a ZeRO-3 rank in a spawned process, out of the reach of the guards above.
_HEAVY = {"ray": ("init",), "deepspeed": ("initialize", "init_distributed"),
          "rlhf_sg.engine_actor": ("start_engine_actors",), "zero3_rank": ("in_fresh_process",)}
_running: dict = {"item": None}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    yield
    _running["item"] = None


def _guard(module, name: str) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        item = _running["item"]
        if item is not None and not (item.get_closest_marker("slow") or item.get_closest_marker("gpu")):
            raise AssertionError(f"{item.nodeid} (or a fixture it uses) calls {module.__name__}.{name} but is not "
                                 "marked slow: mark it `@pytest.mark.slow` (the fast tier starts no Ray cluster, "
                                 "DeepSpeed engine or inference engine)")
        return original(*args, **kwargs)

    setattr(module, name, guarded)


def pytest_configure(config):
    """The fast tier stays fast by construction: a test not marked ``slow`` (or ``gpu``) whose body or
    fixtures start a Ray cluster, a DeepSpeed engine or process group, or an engine actor fails, naming it.
    Torch's extension builds go to this Python environment's own directory (``pin_torch_extensions_dir``), for
    this session and every process it starts (Ray's workers, the op build), including tests that start DeepSpeed
    without the trainer's workers: the engines' suites run in venvs of their own beside the main one."""
    from rlhf_sg.distributed import pin_torch_extensions_dir

    pin_torch_extensions_dir()
    for module_name, names in _HEAVY.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            _guard(module, name)


def _tier(item) -> int:
    """Run order: the fast tier, then the slow tests on the session's Ray cluster, then the tests that end that
    cluster to start one of another shape, so the shared cluster starts once (``pytest`` runs the tiers in CI's
    order). Within a tier, the files' order."""
    if "slow" not in item.keywords:
        return 0
    return 2 if "two_nodes" in getattr(item, "fixturenames", ()) else 1


_op_build: dict = {"process": None, "log": None}


def pytest_collection_modifyitems(config, items):
    """Orders the tiers and marks the extended tier (``tests/extended.py``'s entries) before ``-m`` deselects."""
    from extended import EXTENDED

    items.sort(key=_tier)  # stable: each tier keeps the collection order
    for item in items:
        if item.nodeid in EXTENDED or item.nodeid.split("[")[0] in EXTENDED:
            item.add_marker(pytest.mark.extended)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """The op build starts when the tests that will run hold both tiers: here, once ``-m`` / ``-k`` have
    deselected theirs (pytest deselects after this file's ``pytest_collection_modifyitems``, which sees them all)."""
    items = session.items
    if torch.cuda.is_available() or session.config.option.collectonly:
        return
    if items and "slow" not in items[0].keywords and "slow" in items[-1].keywords:
        _start_op_build(session.config)


def _start_op_build(config) -> None:
    """DeepSpeed's CPU communication op compiled beside the fast tier (``deepspeed_ops.py``), when this session
    runs both tiers; the first slow test waits for it."""
    if importlib.util.find_spec("deepspeed") is None:
        return
    from deepspeed_ops import start_build

    log = os.path.join(str(config.rootpath), ".pytest-deepspeed-op-build.log")
    _op_build.update(process=start_build(log), log=log)


def _wait_op_build(timeout_s: float = 600) -> None:
    process = _op_build["process"]
    if process is None:
        return
    _op_build["process"] = None
    from deepspeed_ops import finish_build

    code = finish_build(process, timeout_s)
    if code != 0:  # DeepSpeed then builds it in the first rank itself and reports its own error there
        warnings.warn(f"compiling DeepSpeed's CPU communication op ahead of the slow tests failed ({code}); "
                      f"see {_op_build['log']}", stacklevel=2)


def pytest_runtest_setup(item):
    if "slow" in item.keywords:
        _wait_op_build()


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the whole test session (start-up paid once; module scope only so that it
    starts again after a module that needed a cluster of another shape, :func:`two_ray_nodes`, ended it):
    8 CPUs and :data:`RAY_LOGICAL_GPUS` logical GPUs. Tests use it and never call ``ray.init`` /
    ``ray.shutdown`` themselves."""
    ray = pytest.importorskip("ray")
    # engine and worker processes import the reward / backend modules of these tests and recipes
    paths = [RECIPES, TESTS, os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if not torch.cuda.is_available():  # on a GPU node DeepSpeed picks its CUDA accelerator itself
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("RAY_worker_niceness", "0")
    if not ray.is_initialized():
        # on a GPU node Ray must hand out the devices that exist; elsewhere logical ones stand in for them
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else RAY_LOGICAL_GPUS
        ray.init(address="local", num_cpus=8, num_gpus=gpus, include_dashboard=False,
                 log_to_driver=False)
    yield ray  # left running for the next module; pytest_sessionfinish shuts it down


@pytest.fixture
def no_ray():
    """No Ray in this process, as in a fresh ``rlhf-sg`` run before it starts one (checks made before Ray, device
    counts of this machine): ends the session's cluster if an earlier module left it up; the next module that asks
    for :func:`ray_cluster` starts it again."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    import sys

    # a session cut short: the build finishes, or stops removing torch's lock (at once on Ctrl-C, which the build,
    # in a session of its own, does not get)
    _wait_op_build(0 if exitstatus == pytest.ExitCode.INTERRUPTED else 120)

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def task(tmp_path_factory):
    """The quickstart's task for the whole session (paid once): a warm-started policy that is right some of the
    time, and the prompt file; tests only read them."""
    import sys

    sys.path.insert(0, RECIPES)
    from quickstart_cpu import prepare

    return prepare(str(tmp_path_factory.mktemp("quickstart")), warm_start_steps=30)


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
