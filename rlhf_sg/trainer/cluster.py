"""The running processes of a run: Ray, the model groups, the rollout engines, and the hand-over of a
shared device between engines and training states (colocated layouts)."""

from __future__ import annotations

import logging
import os
import sys

from rlhf_sg.config import Config, offload_states, rollout_is_async, sleep_engines
from rlhf_sg.timing import StepTimer
from rlhf_sg.trainer.layout import Layout

log = logging.getLogger("rlhf_sg")


#: in the output directory: the processes of the run that started them (pid and start time)
PROCESS_RECORD = ".processes.json"


def record_processes(path: str) -> None:
    """Write every process this one started (Ray's, the workers', the engines') to ``path``."""
    import json

    import psutil

    from rlhf_sg.trainer.checkpoint import write_atomic

    me = psutil.Process()
    procs = [{"pid": p.pid, "started": p.create_time()} for p in me.children(recursive=True)]
    write_atomic(path, json.dumps({"driver": {"pid": me.pid, "started": me.create_time()}, "processes": procs}))


def stop_recorded_processes(path: str) -> int:
    """Kill the processes ``path`` recorded that still run (matched by pid and start time, so a reused pid is
    left alone) when the process that recorded them is gone; returns how many."""
    import json

    import psutil

    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return 0
    driver = record.get("driver") or {}
    if _running(driver.get("pid"), driver.get("started")):
        return 0  # the process that started them still runs (this one, or another run there): they are in use
    stopped = 0
    for entry in record.get("processes", []):
        if _running(entry["pid"], entry["started"]):
            try:
                psutil.Process(entry["pid"]).kill()
                stopped += 1
            except psutil.Error:
                pass
    return stopped


def _running(pid, started) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - started) < 1e-3
    except (psutil.Error, TypeError, ValueError):
        return False


class Cluster:
    """Ray, the actor / critic / reference / teacher / reward groups and the engines of one run.

    Groups a run does not use are None. Start with :meth:`start`, stop with :meth:`shutdown` (which
    also cleans up after a failed start)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.layout = Layout(cfg)
        self.actor = self.critic = self.ref = self.teacher = self.reward_model = None
        self.engines: list = []
        self._shared: list = []  # placement groups several groups share (colocated layouts)
        self._engine_bundles = None  # the engines' shared bundles, if colocated
        self._started_ray = False  # whether this run started (or joined) Ray itself, and so shuts it down

    # ---- start and stop --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Stop what an earlier run in the same output directory left running (a run killed with SIGKILL
        cannot stop its Ray processes; Ray's node agents linger for a minute or more after their raylet died),
        then start Ray, the groups and the engines, and record their processes for the next run to check."""
        record = os.path.join(self.cfg.log.output_dir, PROCESS_RECORD)
        stopped = stop_recorded_processes(record)
        if stopped:
            log.warning("stopped %d processes an earlier run in %s left running", stopped, self.cfg.log.output_dir)
        self._start_ray()
        self._start_groups()
        record_processes(record)

    def start_engines(self) -> list:
        """Ray and the engines alone, holding ``--model.pretrain``'s weights as saved (``rlhf-sg eval``): no
        training group, no weight sync. Stop with :meth:`shutdown`."""
        self._start_ray()
        self.engines = self._start_engines()
        return self.engines

    def _start_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return  # the caller's Ray: it stays up after the run
        self._started_ray = True
        # Workers and engines must import what the driver can (a user's module:Class backend or reward).
        paths = [os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[0])), os.environ.get("PYTHONPATH", "")]
        runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                    "PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
        if (os.environ.get("RAY_ADDRESS") or "local") != "local":  # a cluster the user started: join it
            ray.init(runtime_env=runtime_env)
            return
        # otherwise a fresh local instance, never one that happens to run on this machine already; its
        # workers do all the computing, so they run at normal priority (Ray's default is nice 15)
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, self.layout.cpus_needed()),
                 include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)

    def _start_shared_bundles(self) -> dict[str, object]:
        """One shared placement group per colocated set; returns group name -> its bundles."""
        from rlhf_sg.workers import SharedBundles

        t, sizes, placed = self.cfg.train, self.layout.group_sizes(), {}
        for names in self.layout.colocation():
            bundles = SharedBundles.create(max(sizes[g] for g in names), len(names), t.device,
                                           t.placement_strategy, t.timeout_s)
            self._shared.append(bundles)
            placed.update(dict.fromkeys(names, bundles))
            log.info("colocated on %d shared devices: %s", bundles.size, ", ".join(names))
        return placed

    def _group(self, role: str, shared):
        from rlhf_sg.workers import ModelGroup

        t = self.cfg.train
        # On CPU every rank asks for one Ray CPU (a colocated one a share of one); Ray is started with at
        # least as many CPUs as bundles, and each worker runs Layout.worker_threads OpenMP threads (the cores
        # shared among the ranks that compute at the same time), so phases never oversubscribe the cores.
        return ModelGroup(self.layout.worker_spec(role), num_cpus=1.0, num_gpus=1.0 if t.device == "cuda" else 0.0,
                          strategy=t.placement_strategy, shared=shared, wait=False)

    def _start_groups(self) -> None:
        """Every group and the engines load their models at the same time, except that engines sharing devices
        with a group start first and alone: an engine sizes its KV cache from the memory it finds free, which a
        model loading beside it would change (vLLM stops on that)."""
        r, t, layout = self.cfg.rollout, self.cfg.train, self.layout
        placed = self._start_shared_bundles()
        self._engine_bundles = placed.get("engines")
        if self._engine_bundles is not None:
            self.engines = self._start_engines()
        self.actor = self._group("actor", placed.get("actor"))
        if layout.uses_critic:
            self.critic = self._group("critic", placed.get("critic"))
        if layout.ref_group:
            self.ref = self._group("ref", placed.get("ref"))
        if layout.uses_teacher:
            self.teacher = self._group("teacher", placed.get("teacher"))
        if layout.uses_reward_model:
            self.reward_model = self._group("reward", placed.get("reward"))
        if self._engine_bundles is None:
            self.engines = self._start_engines()
        for group in (self.actor, self.critic, self.ref, self.teacher, self.reward_model):
            if group is not None:
                group.wait_started()
        self.actor.call("setup_weight_sync", self.engines, r.weight_transport, r.bucket_bytes, t.timeout_s,
                        what="weight-sync set-up")

    def _start_engines(self, only: list[int] | None = None) -> list:
        """Engine actors (all of them, or the indices in ``only``), each on its place: its own bundle, or bundle
        i of the colocated set."""
        from rlhf_sg.engine_actor import start_engine_actors

        r, t = self.cfg.rollout, self.cfg.train
        return start_engine_actors(
            r.backend, self.layout.engine_config(), r.num_engines, num_cpus=1.0,
            num_gpus=self.layout.engine_gpus, start_timeout_s=t.timeout_s,
            shared=self._engine_bundles, only=only, abortable=self.abortable_engines,
        )

    @property
    def abortable_engines(self) -> bool:
        """Whether the engines take ``abort_generation`` next to a running generate (async partial rollout)."""
        return rollout_is_async(self.cfg) and self.cfg.rollout.partial_rollout

    def abort_generation(self) -> int:
        """Cut every engine's running generate short and hold the abort (partial rollout); returns how many
        generates were cut. Needs :attr:`abortable_engines`."""
        from rlhf_sg.engine_actor import wait_engine_calls

        timeout_s = self.cfg.train.timeout_s
        calls = [(i, "abort_generation", e.abort_generation.options(concurrency_group="abort").remote(timeout_s))
                 for i, e in enumerate(self.engines)]
        return sum(wait_engine_calls(calls, timeout_s + 10))

    def shutdown(self) -> None:
        import ray

        for group in (self.actor, self.critic, self.ref, self.teacher, self.reward_model):
            if group is not None:
                group.shutdown()
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception:  # the engine may already be gone; shutting down must not fail the run
                log.warning("an engine did not shut down cleanly", exc_info=True)
            ray.kill(e)
        self.engines = []
        for bundles in self._shared:
            bundles.remove()
        self._shared = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def restart_engine(self, index: int, version: int) -> None:
        """Replace engine ``index`` (its actor or process died) by a fresh one in the same place, set the weight
        sync up again with every engine, and push the trainer's weights as ``version`` so the new engine samples
        from the same policy as the others."""
        import ray

        r, t = self.cfg.rollout, self.cfg.train
        try:
            ray.kill(self.engines[index])
        except Exception:  # already gone
            pass
        (self.engines[index],) = self._start_engines(only=[index])
        self.actor.call("setup_weight_sync", self.engines, r.weight_transport, r.bucket_bytes, t.timeout_s,
                        what=f"weight-sync set-up after restarting engine {index}")
        self.actor.call("sync_weights", version, what=f"weight sync to restarted engine {index} (version {version})")

    # ---- calls on every engine or rank -------------------------------------------------------------------
    def engines_call(self, method: str, *args) -> list:
        """``method(*args)`` on every engine, waited for with the run's timeout (a stuck engine is named)."""
        from rlhf_sg.engine_actor import wait_engine_calls

        calls = [(i, method, getattr(e, method).remote(*args)) for i, e in enumerate(self.engines)]
        return wait_engine_calls(calls, self.cfg.train.timeout_s)

    def training_groups(self) -> list:
        return [g for g in (self.actor, self.critic) if g is not None]

    def move_states(self, method: str, groups: list | None = None, **kwargs) -> int:
        """``offload_states`` / ``reload_states`` on every rank of ``groups`` (default: the training groups);
        returns the device bytes moved."""
        groups = self.training_groups() if groups is None else groups
        return sum(sum(g.call(method, what=f"{method} ({g.spec.role})", **kwargs)) for g in groups)

    # ---- the device between engines and trainer (colocated layouts) -------------------------------------
    # With engines asleep while the trainer trains and training states offloaded while the engines generate,
    # one step hands the device over in this order, so that engine weights, KV cache and training states are
    # never on it together (see backends.base):
    #   training states off -> engine weights on -> sync -> KV cache on -> generate -> engines off -> states on
    def hand_device_to_engines(self, timer: StepTimer, version: int) -> list[dict]:
        """Push the trainer's weights as ``version`` and leave the engines ready to generate.

        1. training states off the device; the actor keeps its ZeRO-3 parameter shards, which the sync gathers;
        2. engine weights on (``wake(("weights",))``), the KV cache still released;
        3. the weight sync: after a release the engine's weights are stale or gone, so one always follows;
           with sleeping engines the actor frees its sync buffers after it;
        4. the actor's parameter shards off; the forward-only groups (reference, teacher, reward model) return their
           allocators' cached blocks;
        5. KV cache on (``wake(("kv_cache",))``): the engines can generate.

        Without sleeping engines or offloaded states only step 3 runs. Returns the sync's per-rank stats."""
        from backends.base import MEMORY_KV_CACHE, MEMORY_WEIGHTS

        offloading, sleeping = offload_states(self.cfg), sleep_engines(self.cfg)
        if offloading:
            with timer.phase("offload"):
                self.move_states("offload_states", [self.actor], keep_params=True)
                if self.critic is not None:
                    self.move_states("offload_states", [self.critic])
        with timer.phase("weight_sync"):
            if sleeping:
                self.engines_call("wake", (MEMORY_WEIGHTS,))
            stats = self.actor.call("sync_weights", version, release_buffers=sleeping,
                                    what=f"weight sync to version {version}")
        if offloading:
            with timer.phase("offload"):
                self.move_states("offload_states", [self.actor])
        if sleeping:
            with timer.phase("weight_sync"):
                for group in (self.ref, self.teacher, self.reward_model):
                    if group is not None:
                        group.call("release_device_cache", what=f"release_device_cache ({group.spec.role})")
                still = self.engines_call("wake", (MEMORY_KV_CACHE,))
            if any(still):
                raise RuntimeError(f"engines still hold released memory after waking every tag: {still}")
        return stats

    def hand_device_to_trainer(self, timer: StepTimer) -> int:
        """After generation: the engines release weights and KV cache, then the training states come back.
        Returns the device bytes the training states took back (what they had left to the engines)."""
        if sleep_engines(self.cfg):
            with timer.phase("generate"):
                self.engines_call("sleep")
        if not offload_states(self.cfg):
            return 0
        with timer.phase("offload"):
            return self.move_states("reload_states")

    def offload_training_states(self, timer: StepTimer) -> None:
        """Training states off the device before a step generates (with offloading: a no-op after the first
        step, as each step ends with them off; needed at the first step and after a resume)."""
        if offload_states(self.cfg):
            with timer.phase("offload"):
                self.move_states("offload_states")
