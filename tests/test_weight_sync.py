"""Weight sync: bucket planning, and round trips from a 2-rank ZeRO-3 trainer into embedded engines.

The round trips use real parts: Ray, DeepSpeed ZeRO-3 on its CPU accelerator (gloo), a tiny Qwen2
saved to disk, and the embedded engine (through :class:`ResetCountingBackend`, which only adds a
log of its prefix-cache resets so the test can see them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import time

import pytest
import torch

from backends.base import BackendConfig, BucketManifest, SamplingParams, TensorSpec, WeightGroupSpec
from backends.embedded import EmbeddedBackend
from rlhf_sg.sync import WeightSyncer, gather_bucket, hf_name, named_weights, plan_buckets

F32, BF16 = torch.float32, torch.bfloat16
TIMEOUT_S = 300.0


class ResetCountingBackend(EmbeddedBackend):
    """The embedded engine, logging every prefix-cache reset to ``<extra["reset_log_dir"]>/<seed>.log``.

    Engine ``i`` of :func:`~rlhf_sg.engine_actor.start_engine_actors` has seed ``i``, so its log is ``i.log``.
    """

    name = "hf-reset-counting"

    def __init__(self, config: BackendConfig):
        extra = dict(config.extra)
        self._reset_log = os.path.join(extra.pop("reset_log_dir"), f"{config.seed}.log")
        super().__init__(dataclasses.replace(config, extra=extra))

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        with open(self._reset_log, "a") as f:
            f.write("reset\n")


class PackLoggingBackend(EmbeddedBackend):
    """The embedded engine whose sender-side ``pack_tensor_bucket`` logs each payload it makes to the file
    ``$RLHF_SG_TEST_PACK_LOG`` (the registry may load this file as a module of its own, so a file, not a list)."""

    name = "hf-pack-logging"

    @classmethod
    def pack_tensor_bucket(cls, manifest, flat, num_tp_ranks):
        payload = super().pack_tensor_bucket(manifest, flat, num_tp_ranks)
        with open(os.environ["RLHF_SG_TEST_PACK_LOG"], "a") as f:
            f.write(f"{manifest.tensors[0].name}\n")
        return payload


# ---- bucket planning (pure) --------------------------------------------------------------------
def _layout(manifests):
    return [(m.dtype, m.numel, [(t.name, t.offset) for t in m.tensors]) for m in manifests]


def test_plan_buckets_fills_up_to_bucket_bytes_in_order():
    meta = [("a", (2, 3), F32), ("b", (4,), F32), ("c", (2,), F32), ("d", (5,), F32)]
    # 40 bytes: a (24 B) + b (16 B) fill one bucket; c + d (28 B) the next.
    assert _layout(plan_buckets(meta, 40)) == [
        (F32, 10, [("a", 0), ("b", 6)]),
        (F32, 7, [("c", 0), ("d", 2)]),
    ]


def test_plan_buckets_oversized_tensor_gets_a_bucket_of_its_own():
    meta = [("small", (2,), F32), ("big", (100,), F32), ("after", (3,), F32)]
    assert _layout(plan_buckets(meta, 64)) == [
        (F32, 2, [("small", 0)]),
        (F32, 100, [("big", 0)]),
        (F32, 3, [("after", 0)]),
    ]


def test_plan_buckets_one_dtype_per_bucket_order_kept_within_dtype():
    meta = [("w1", (4,), F32), ("n1", (4,), BF16), ("w2", (4,), F32), ("n2", (4,), BF16), ("w3", (8,), F32)]
    assert _layout(plan_buckets(meta, 32)) == [
        (F32, 8, [("w1", 0), ("w2", 4)]),
        (BF16, 8, [("n1", 0), ("n2", 4)]),
        (F32, 8, [("w3", 0)]),
    ]


def test_plan_buckets_covers_every_element_once_and_unflattens_back():
    model_meta = [(f"t{i}", (i % 3 + 1, 5), F32 if i % 4 else BF16) for i in range(23)]
    tensors = {name: torch.randn(shape).to(dtype) for name, shape, dtype in model_meta}
    plan = plan_buckets(model_meta, 48)
    assert sorted(t.name for m in plan for t in m.tensors) == sorted(tensors)
    for m in plan:
        assert m.numel * m.dtype.itemsize <= 48 or len(m.tensors) == 1
        assert all(t.dtype == m.dtype for t in m.tensors)
        flat = torch.empty(m.numel, dtype=m.dtype)
        for t in m.tensors:
            flat[t.offset : t.offset + t.numel] = tensors[t.name].reshape(-1)
        for name, view in m.unflatten(flat):
            assert torch.equal(view, tensors[name])
        ends = [t.offset + t.numel for t in m.tensors]
        assert [t.offset for t in m.tensors] == [0, *ends[:-1]] and ends[-1] == m.numel


def test_plan_buckets_rejects_bad_input():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (1,), F32)], 0)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_buckets([("a", (1,), F32), ("a", (2,), F32)], 64)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([("a", (-1, 2), F32)], 64)
    with pytest.raises(ValueError, match="not a torch.dtype"):
        plan_buckets([("a", (1,), "float32")], 64)


def test_hf_names_drop_wrapper_prefixes_and_tied_weights_appear_once():
    assert hf_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    from transformers import AutoModelForCausalLM

    from rlhf_sg.tiny import tiny_config

    config = tiny_config("qwen2", "tiny")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [name for name, _ in named_weights(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def test_gather_bucket_copies_plain_parameters_at_their_offsets():
    from rlhf_sg.tiny import build_tiny_model

    named = named_weights(build_tiny_model("llama", "tiny"))
    plan = plan_buckets([(n, p.shape, p.dtype) for n, p in named], 64 * 1024)
    params = dict(named)
    for manifest in plan:
        out = torch.full((manifest.numel,), float("nan"))
        gather_bucket([params[t.name] for t in manifest.tensors], manifest, out)
        for name, view in manifest.unflatten(out):
            assert torch.equal(view, params[name].detach())


def test_weight_syncer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="transport"):
        WeightSyncer(0, 1, [object()], transport="carrier-pigeon")
    with pytest.raises(ValueError, match="engines is empty"):
        WeightSyncer(0, 1, [])
    with pytest.raises(ValueError, match="rank 2 outside"):
        WeightSyncer(2, 2, [object()])
    with pytest.raises(ValueError, match="bucket_bytes"):
        WeightSyncer(0, 1, [object()], bucket_bytes=-5)


def test_weight_syncer_spreads_engines_over_sender_ranks():
    engines = [object()] * 5
    assert [WeightSyncer(r, 2, engines).my_engines for r in range(2)] == [[0, 2, 4], [1, 3]]
    assert [WeightSyncer(r, 2, engines, num_senders=1).my_engines for r in range(2)] == [[0, 1, 2, 3, 4], []]
    assert [WeightSyncer(r, 3, engines[:1]).my_engines for r in range(3)] == [[0], [], []]


# ---- round trips with Ray + ZeRO-3 ----------------------------------------------------------------
ray = pytest.importorskip("ray")


def odd_model(seed: int = 0, vocab_size: int | None = None):
    """A tiny Llama whose hidden size (63) makes most tensors odd-sized.

    With 2 ZeRO-3 ranks an odd tensor's last partition is padded, so the shard exchange's tail
    handling is exercised (the stock tiny sizes are all even).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_sg.tiny import EOS_ID, PAD_ID, char_vocab

    config = LlamaConfig(
        vocab_size=vocab_size or len(char_vocab()),
        hidden_size=63,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=8,  # RoPE wants an even head size; q/k/v project 63 -> 3 x 8
        intermediate_size=129,
        max_position_embeddings=256,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    """A 2-rank ZeRO-3 trainer and 2 embedded engines over one saved tiny Qwen2, on the session's Ray."""
    from rlhf_sg.bench.weight_sync import start_trainer_ranks
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("weight_sync")
    model_path = save_tiny_model(str(root / "model"), model=odd_model())
    backend = f"{os.path.abspath(__file__)}:ResetCountingBackend"
    config = BackendConfig(model_path=model_path, num_threads=1, extra={"reset_log_dir": str(root)})
    engines = start_engine_actors(backend, config, 2)
    logs = [str(root / f"{i}.log") for i in range(2)]
    ranks = start_trainer_ranks(model_path, 2, timeout_s=600.0)  # start-up on a busy CI box is slow
    state = {"version": 0}
    yield {"model_path": model_path, "engines": engines, "ranks": ranks, "logs": logs, "state": state}
    for actor in [*engines, *ranks]:
        ray.kill(actor)


def _get(refs):
    return ray.get(refs, timeout=TIMEOUT_S)


def _resets(log: str) -> int:
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        return len(f.readlines())


TIE_LOGIT = 1e-4  # two logits this close are a tie that last-bit differences may break either way


def _assert_greedy_equals_hf(model_path: str, state: dict[str, torch.Tensor], prompt: list[int], completion) -> None:
    """The engine's greedy completion is the HF model's with the same weights.

    Exactly equal to ``generate(do_sample=False)`` unless the HF path meets a near-tie (two logits
    within TIE_LOGIT), where the last bits of two correct implementations may pick either token;
    in every case each engine token is an argmax of the HF logits given the engine's own prefix
    (up to a tie) and its log-prob matches HF's.
    """
    from transformers import AutoModelForCausalLM

    from rlhf_sg.tiny import EOS_ID, PAD_ID

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    tokens = completion.token_ids
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(tokens) if completion.finish_reason == "length" else len(tokens) + 8,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            output_scores=True,
            return_dict_in_generate=True,
        )
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    hf_tokens = gen.sequences[0, len(prompt) :].tolist()
    near_tie = any(float(sc[0].topk(2).values.diff().abs()) < TIE_LOGIT for sc in gen.scores)
    if not near_tie:
        assert tokens == hf_tokens, f"prompt {prompt}: engine {tokens} != HF greedy {hf_tokens}"
    top = logits.max(dim=-1).values
    picked = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.all(picked >= top - TIE_LOGIT), f"prompt {prompt}: engine token is not HF's argmax: {tokens}"
    hf_logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(completion.logprobs), hf_logp, atol=1e-4, rtol=0)


PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 12, 77, 13, 9]]


@pytest.mark.slow
def test_zero3_trainer_really_partitions_every_parameter(cluster):
    shards = _get(cluster["ranks"][0].shard_numels.remote())
    assert shards and all(local < full for local, full in shards.values()), shards
    assert any(full % 2 for _, full in shards.values()), "no padded partition: the tail path goes untested"


@pytest.mark.slow
@pytest.mark.parametrize(
    "transport,kwargs",
    [
        ("collective", {"num_senders": 1}),
        ("collective", {"num_senders": 2}),
        ("collective", {"num_senders": 2, "overlap": False}),
        ("collective", {"baseline": True}),  # the benchmark's per-tensor baseline must deliver the same weights
        ("tensor", {}),
        ("disk", {}),
    ],
    ids=["collective-1-sender", "collective-2-senders", "collective-no-overlap", "per-tensor", "tensor", "disk"],
)
def test_round_trip_engines_hold_the_trainers_weights(cluster, transport, kwargs):
    ranks, engines, state = cluster["ranks"], cluster["engines"], cluster["state"]
    before = _get(engines[0].get_weights_by_name.remote("model.layers.1.mlp.down_proj.weight"))
    resets_before = [_resets(log) for log in cluster["logs"]]
    state["version"] += 1
    version = state["version"]
    _get([r.perturb.remote(seed=version) for r in ranks])
    # ~8 KiB buckets: the tiny model spans many buckets, so double buffering is exercised.
    _get(
        [
            r.setup_syncer.remote(engines, transport=transport, bucket_bytes=8192, timeout_s=TIMEOUT_S, **kwargs)
            for r in ranks
        ]
    )
    try:
        stats = _get([r.sync.remote(version) for r in ranks])
    finally:
        _get([r.close_syncer.remote() for r in ranks])

    assert stats[0]["buckets"] > 2 and stats[0]["bytes"] > 0
    assert sum(s["engines"] for s in stats) == len(engines)
    trainer = _get([r.full_state_dict.remote() for r in ranks])[0]  # the gather is collective
    assert not torch.equal(trainer["model.layers.1.mlp.down_proj.weight"], before), (
        "the trainer's weights did not change"
    )
    for i, engine in enumerate(engines):
        held = _get([engine.get_weights_by_name.remote(name) for name in trainer])
        for (name, want), got in zip(trainer.items(), held):
            assert torch.equal(got, want), f"engine {i}: {name} differs from the trainer's after {transport} sync"
        assert _get(engine.weight_version.remote()) == version
        assert _resets(cluster["logs"][i]) == resets_before[i] + 1, f"engine {i}: prefix cache not reset once"

    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for engine in engines:
        for prompt in PROMPTS:
            completion = _get(engine.generate.remote([prompt], params))[0]
            assert completion.weight_version == version
            _assert_greedy_equals_hf(cluster["model_path"], trainer, prompt, completion)


@pytest.mark.slow
def test_tensor_transport_packs_a_payload_of_its_own_for_every_engine(cluster, tmp_path, monkeypatch):
    """Two engines served by one sender rank: the sender packs each bucket once per engine (a CUDA IPC
    handle must be made for each receiving process, never shared between two), and both engines then
    hold the trainer's weights."""
    from rlhf_sg.engine_actor import start_engine_actors

    log = tmp_path / "packs.log"
    monkeypatch.setenv("RLHF_SG_TEST_PACK_LOG", str(log))
    backend = f"{os.path.abspath(__file__)}:PackLoggingBackend"
    config = BackendConfig(model_path=cluster["model_path"], num_threads=1)
    engines = start_engine_actors(backend, config, 2, num_cpus=0)
    model = odd_model(seed=11)
    syncer = WeightSyncer(0, 1, engines, transport="tensor", bucket_bytes=8192, timeout_s=TIMEOUT_S)
    syncer.setup()
    try:
        stats = syncer.sync(model, 1)
    finally:
        syncer.close()
    packs = log.read_text().split("\n")[:-1]
    buckets = int(stats["buckets"])
    assert buckets > 2 and len(packs) == 2 * buckets, f"{len(packs)} payloads for {buckets} buckets x 2 engines"
    want = dict(model.named_parameters())
    for i, engine in enumerate(engines):
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
            assert torch.equal(_get(engine.get_weights_by_name.remote(name)), want[name].detach()), (i, name)
    for engine in engines:
        ray.kill(engine)


@pytest.mark.slow
def test_mismatched_model_is_refused_before_any_byte_moves(cluster):
    """A trainer model that is not the engines' model: clear error naming the tensor; engines unharmed."""
    from rlhf_sg.tiny import char_vocab

    engines, state = cluster["engines"], cluster["state"]
    version_before = _get(engines[0].weight_version.remote())
    vocab = len(char_vocab())
    wrong = odd_model(vocab_size=vocab + 20)  # embeddings of another shape
    syncer = WeightSyncer(0, 1, engines, transport="collective", timeout_s=TIMEOUT_S)
    syncer.setup()
    try:
        expected = rf"engine \d: .*model\.embed_tokens\.weight.*\({vocab + 20}, 63\) in the trainer.*\({vocab}, 63\)"
        with pytest.raises(ValueError, match=expected):
            syncer.sync(wrong, state["version"] + 1)
        assert _get([e.weight_version.remote() for e in engines]) == [version_before] * 2
        # Nothing was sent, so the groups are still in step: the right model syncs through the same syncer.
        right = odd_model(seed=7)
        state["version"] += 1
        syncer.sync(right, state["version"])
    finally:
        syncer.close()
    got = _get(engines[1].get_weights_by_name.remote("model.norm.weight"))
    assert torch.equal(got, right.model.norm.weight.detach())
    out = _get(engines[0].generate.remote([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=4)))
    assert len(out[0].token_ids) >= 1 and out[0].weight_version == state["version"]


@pytest.mark.slow
def test_bad_manifest_into_an_engine_is_a_clear_error_and_the_engine_stays_usable(cluster):
    from rlhf_sg.engine_actor import EngineCallError, wait_engine_calls

    engine = cluster["engines"][0]
    name = "model.layers.0.mlp.gate_proj.weight"
    before = _get(engine.get_weights_by_name.remote(name))
    bad = BucketManifest((TensorSpec(name, (3, 3), F32, 0), TensorSpec("model.no_such.weight", (2,), F32, 9)), F32, 11)
    with pytest.raises(EngineCallError, match=r"engine 0: update_weights_from_tensor failed: .*gate_proj.*\(3, 3\)"):
        wait_engine_calls(
            [(0, "update_weights_from_tensor", engine.update_weights_from_tensor.remote(bad, torch.ones(11)))], 60
        )
    with pytest.raises(EngineCallError, match=r"engine 0: check_manifests failed: .*shape \(3, 3\) in the trainer"):
        wait_engine_calls([(0, "check_manifests", engine.check_manifests.remote([bad]))], 60)
    assert torch.equal(_get(engine.get_weights_by_name.remote(name)), before)
    out = _get(engine.generate.remote([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=4)))
    assert len(out[0].token_ids) >= 1


@pytest.mark.slow
def test_an_engine_that_never_joins_times_out_naming_group_and_rank(cluster):
    # Defined here so Ray pickles the class by value (workers cannot import this test module).
    class NeverJoins:
        """An engine that accepts the group spec and then never connects (a wrong address, a hung worker)."""

        def describe(self):
            return {
                "engine_index": 0,
                "backend": "never-joins",
                "backend_class": "backends.embedded:EmbeddedBackend",  # its group is the plain one
                "transports": ["collective"],
                "node_id": ray.get_runtime_context().get_node_id(),
                "weight_group_size": 1,
                "weight_version": 0,
            }

        def init_weight_update_group(self, spec):
            return None

    from rlhf_sg.engine_actor import EngineActor

    def params(cls, method):  # Ray adds a tracing keyword to classes it wraps
        return [p for p in inspect.signature(getattr(cls, method)).parameters if not p.startswith("_ray")]

    for method in ("describe", "init_weight_update_group"):  # the fake keeps the real actor's signatures
        assert params(NeverJoins, method) == params(EngineActor, method)
    ghost = ray.remote(num_cpus=0)(NeverJoins).remote()
    # the actor's process is started first (seconds on a loaded machine): the 2 s limit is for the group's set-up
    ray.get(ghost.describe.remote(), timeout=120)
    syncer = WeightSyncer(0, 1, [ghost], transport="collective", timeout_s=2.0, group_name="ghost-sync")
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"'ghost-sync-rank0-setup1'.*trainer rank 0 \(group rank 0\).*engine 0 \(group rank 1\)"
    ):
        syncer.setup()
    assert time.monotonic() - start < 60, "setup hung instead of timing out"
    ray.kill(ghost)


def test_engine_actor_finish_weight_update_bumps_version_and_resets_prefix_cache(tmp_path):
    """The actor class in-process (no Ray): finish_weight_update reaches the backend's reset."""
    from rlhf_sg.engine_actor import EngineActor
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), size="tiny")
    actor = EngineActor(
        f"{os.path.abspath(__file__)}:ResetCountingBackend",
        BackendConfig(model_path=path, num_threads=1, seed=3, extra={"reset_log_dir": str(tmp_path)}),
    )
    assert actor.finish_weight_update(5) == 5 and actor.weight_version() == 5
    assert _resets(str(tmp_path / "3.log")) == 1
    actor.shutdown()


@pytest.mark.slow
def test_an_engine_failing_mid_sync_fails_the_sync_at_once_and_set_up_again_recovers(cluster):
    from rlhf_sg.engine_actor import EngineCallError

    engines, state = cluster["engines"], cluster["state"]
    model = odd_model(seed=11)
    syncer = WeightSyncer(0, 1, engines, transport="collective", bucket_bytes=8192, timeout_s=300.0)
    syncer.setup()
    _get(engines[1].destroy_weight_update_group.remote())  # engine 1 can no longer receive
    start = time.monotonic()
    with pytest.raises(
        EngineCallError, match=r"engine 1: update_weights_from_collective failed: .*no weight-update group"
    ):
        syncer.sync(model, state["version"] + 1)
    assert time.monotonic() - start < 60, "the sender waited for its timeout instead of seeing the engine fail"
    with pytest.raises(RuntimeError, match=r"previous sync failed .* call close\(\) and setup\(\) again"):
        syncer.sync(model, state["version"] + 2)
    syncer.close()
    syncer.setup()
    try:
        state["version"] += 3
        syncer.sync(model, state["version"])
    finally:
        syncer.close()
    for engine in engines:
        got = _get(engine.get_weights_by_name.remote("model.layers.0.self_attn.q_proj.weight"))
        assert torch.equal(got, model.model.layers[0].self_attn.q_proj.weight.detach())
        assert _get(engine.weight_version.remote()) == state["version"]


@pytest.mark.slow
def test_open_group_hook_meets_an_engine_that_joins_with_prefixed_keys(cluster):
    """``open_group=`` lets the trainer meet engines that build their group another way (SGLang's keys)."""
    sglang_backend = pytest.importorskip("backends.sglang_backend")
    from rlhf_sg.tiny import build_tiny_model

    class PrefixedKeysEngine:
        """Receives buckets on a group built like SGLang's workers build theirs (a boundary: no SGLang here)."""

        def describe(self):
            return {"transports": ["collective"], "weight_group_size": 1, "backend": "prefixed", "engine_index": 0}

        def init_weight_update_group(self, spec):
            from backends.sglang_backend import open_weight_update_group

            self.group, self.spec, self.received = open_weight_update_group(spec, spec.rank_offset), spec, {}

        def check_manifests(self, manifests):
            return sum(len(m.tensors) for m in manifests)

        def update_weights_from_collective(self, manifests, src_rank=0):
            import torch.distributed as dist

            seconds = []  # EngineActor's answer: each bucket's receive-and-load time
            for m in manifests:
                start = time.perf_counter()
                flat = torch.empty(m.numel, dtype=m.dtype)
                opts = dist.BroadcastOptions()
                opts.rootRank = src_rank
                self.group.broadcast([flat], opts).wait()
                self.received.update((name, t.clone()) for name, t in m.unflatten(flat))
                seconds.append(time.perf_counter() - start)
            return seconds

        def finish_weight_update(self, version):
            return version

        def destroy_weight_update_group(self):
            import torch.distributed as dist

            dist.destroy_process_group(self.group)

        def weights(self):
            return self.received

    def sglang_trainer_side(spec, store):
        return sglang_backend.open_weight_update_group(spec, 0, store=store)

    engine = ray.remote(num_cpus=0)(PrefixedKeysEngine).remote()
    syncer = WeightSyncer(0, 1, [engine], bucket_bytes=8192, timeout_s=60.0, open_group=sglang_trainer_side)
    try:
        for version in (1, 2):  # a second setup must not collide with the first group's registered name
            model = build_tiny_model("qwen2", "tiny", seed=30 + version)
            syncer.setup()
            try:
                syncer.sync(model, version)
            finally:
                syncer.close()
            got = _get(engine.weights.remote())
            assert got.keys() == dict(named_weights(model)).keys()
            assert all(torch.equal(got[n], p.detach()) for n, p in named_weights(model))
    finally:
        ray.kill(engine)


# ---- GPU transports (skipped without CUDA) ------------------------------------------------------
def _sync_into_cuda_engine(cluster, transport: str, trainer_gpu_differs: bool) -> None:
    """The driver is a one-rank trainer on a GPU; one embedded engine on a GPU takes its weights."""
    from rlhf_sg.engine_actor import start_engine_actors

    config = BackendConfig(model_path=cluster["model_path"], device="cuda", num_threads=1)
    engine = start_engine_actors("hf", config, 1, num_cpus=0, num_gpus=1)[0]
    try:
        engine_gpu = int(_get(engine.describe.remote())["gpu_ids"][0])  # a plain node lists GPUs by index
        others = [g for g in range(torch.cuda.device_count()) if g != engine_gpu]
        trainer_gpu = others[0] if trainer_gpu_differs else engine_gpu
        # The driver sees every GPU; indices are physical only when CUDA_VISIBLE_DEVICES is unset.
        assert "CUDA_VISIBLE_DEVICES" not in os.environ, "run the GPU weight-sync tests with all GPUs visible"
        torch.cuda.set_device(trainer_gpu)
        model = odd_model(seed=21).to(f"cuda:{trainer_gpu}")
        syncer = WeightSyncer(0, 1, [engine], transport=transport, bucket_bytes=8192, device="cuda")
        syncer.setup()
        try:
            syncer.sync(model, 1)
        finally:
            syncer.close()
        for name, param in named_weights(model):
            assert torch.equal(_get(engine.get_weights_by_name.remote(name)), param.detach().cpu()), name
        assert _get(engine.weight_version.remote()) == 1
    finally:
        _get(engine.shutdown.remote())
        ray.kill(engine)


@pytest.mark.gpu
@pytest.mark.slow
def test_tensor_transport_over_cuda_ipc_into_a_colocated_gpu_engine(cluster):
    _sync_into_cuda_engine(cluster, "tensor", trainer_gpu_differs=False)


@pytest.mark.gpu
@pytest.mark.slow
def test_collective_transport_over_nccl_into_a_gpu_engine(cluster):
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot put two ranks of one group on one GPU; needs 2 GPUs")
    _sync_into_cuda_engine(cluster, "collective", trainer_gpu_differs=True)


# ---- issue 11: waits on collectives, the in-memory hand-off, the plan check ------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: receivers whose ``.wait(...)`` takes arguments and is not a collective's Work
_WAITS_WITH_ARGUMENTS = {"ray", "concurrent.futures", "transport", "self._transport",
                         # threading.Event / Condition of partial rollout (engine actor, backends, async rollout)
                         "self._generate_done", "self._cond", "inflight.done", "done"}


def test_no_code_passes_a_timeout_to_a_collectives_wait():
    """On ProcessGroupNCCL a ``Work.wait(timeout)`` that expires aborts the communicator: nothing in
    rlhf_sg/ or backends/ may call ``.wait(...)`` with arguments, except on receivers known not to be
    a collective's Work (``ray.wait``, ``concurrent.futures.wait``, our transports' ``wait(handle)``)."""
    import ast
    import pathlib

    found = []
    for root in ("rlhf_sg", "backends"):
        for path in sorted(pathlib.Path(REPO, root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr == "wait" and (node.args or node.keywords):
                    if ast.unparse(node.func.value) not in _WAITS_WITH_ARGUMENTS:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a wait with a timeout on what may be a collective's Work:\n" + "\n".join(found)


class _RecordingWork:
    """A c10d Work that records how it is waited for (a boundary: wraps a real gloo Work)."""

    def __init__(self, work, log: list):
        self._work, self._log = work, log

    def is_completed(self) -> bool:
        self._log.append("is_completed")
        return self._work.is_completed()

    def wait(self, *args, **kwargs):
        self._log.append(("wait", args, kwargs))
        return self._work.wait()


class _RecordingGroup:
    def __init__(self, group, log: list):
        self._group, self._log = group, log

    def broadcast(self, tensors, opts):
        return _RecordingWork(self._group.broadcast(tensors, opts), self._log)

    def shutdown(self):
        self._group.shutdown()


def _gloo_pair(timeout_s: float = 60.0):
    """Ranks 0 and 1 of a real gloo group in this process (built concurrently, as the peers would)."""
    import concurrent.futures
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_s)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(dist.ProcessGroupGloo, store, r, 2, timeout) for r in range(2)]
        return [f.result(timeout=timeout_s) for f in futures]


class _GroupThatFails:
    """A side group's receiving end whose broadcast fails (a boundary: NCCL's failure cannot happen on CPU);
    records how it is destroyed."""

    def __init__(self):
        self.destroyed: list[str] = []

    def broadcast(self, tensors, opts):
        raise RuntimeError("connection reset by peer")

    def abort(self):
        self.destroyed.append("abort")

    def shutdown(self):
        self.destroyed.append("shutdown")


def test_the_embedded_engine_aborts_its_side_group_after_a_failed_receive(tmp_path):
    """A receive that failed leaves a broadcast that will never finish: the group is then aborted (NCCL's
    ncclCommAbort), not shut down gracefully (which may wait on it); a group that never failed shuts down."""
    from backends.base import BackendError
    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), model=build_tiny_model("llama", "tiny", seed=1))
    engine = EmbeddedBackend(BackendConfig(model_path=path, num_threads=1))
    named = named_weights(build_tiny_model("llama", "tiny", seed=2))
    (manifest,) = plan_buckets([(n, p.shape, p.dtype) for n, p in named], 1 << 30)
    spec = WeightGroupSpec("127.0.0.1", 1, 1, 2, "failing", "gloo", timeout_s=5.0)
    failed, clean = _GroupThatFails(), _GroupThatFails()
    engine._group, engine._group_spec = failed, spec
    with pytest.raises(BackendError, match="failed or timed out"):
        engine.update_weights_from_collective(manifest, 0)
    engine.destroy_weight_update_group()
    engine._group, engine._group_spec = clean, spec
    engine.destroy_weight_update_group()
    assert (failed.destroyed, clean.destroyed) == (["abort"], ["shutdown"])


def test_the_vllm_worker_aborts_its_side_group_after_a_failed_receive():
    """The same rule in vLLM's workers (``WeightSyncExtension``, the methods vLLM mixes into each worker; here on
    a bare instance with the attributes vLLM gives it)."""
    from backends.vllm_worker import WeightSyncExtension

    worker = WeightSyncExtension()
    worker.rank, worker.device = 0, torch.device("cpu")
    failed, clean = _GroupThatFails(), _GroupThatFails()
    worker._rlhf_group = failed
    worker._rlhf_group_spec = WeightGroupSpec("127.0.0.1", 1, 1, 2, "failing", "gloo", timeout_s=5.0)
    wire = {"numel": 4, "dtype": "float32", "names": ["w"]}
    with pytest.raises(RuntimeError, match="failed or timed out"):
        worker.rlhf_receive_bucket(wire, 0)
    worker.rlhf_destroy_weight_update_group()
    worker._rlhf_group = clean
    worker.rlhf_destroy_weight_update_group()
    assert (failed.destroyed, clean.destroyed) == (["abort"], ["shutdown"])


def test_broadcast_sender_and_embedded_receiver_never_wait_with_a_timeout(tmp_path):
    """A bucket whose receiver arrives late (longer than any short poll) goes through; the sender's
    work and the embedded engine's receive are polled with ``is_completed`` and waited for without a
    timeout, only once complete (the old sender called ``wait(timedelta(0.05))`` in a loop)."""
    import threading

    from rlhf_sg.sync.transports import BroadcastTransport, SenderContext
    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    model = build_tiny_model("llama", "tiny", seed=2)
    path = save_tiny_model(str(tmp_path / "m"), model=build_tiny_model("llama", "tiny", seed=1))
    named = named_weights(model)
    (manifest,) = plan_buckets([(n, p.shape, p.dtype) for n, p in named], 1 << 30)
    params = dict(named)
    flat = torch.cat([params[t.name].detach().reshape(-1) for t in manifest.tensors])
    sender_group, receiver_group = _gloo_pair()
    sent, received = [], []
    ctx = SenderContext(0, 1, [], [], 60.0, torch.device("cpu"), "recorded")
    transport = BroadcastTransport(ctx, [])
    transport.group = _RecordingGroup(sender_group, sent)
    engine = EmbeddedBackend(BackendConfig(model_path=path, num_threads=1))
    engine._group = _RecordingGroup(receiver_group, received)
    engine._group_spec = WeightGroupSpec("127.0.0.1", 1, 1, 2, "recorded", "gloo", timeout_s=60.0)

    def receive_late():  # once the sender is waiting for its broadcast to complete
        deadline = time.monotonic() + 60
        while not sent and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.update_weights_from_collective(manifest, 0)

    thread = threading.Thread(target=receive_late)
    thread.start()
    transport.wait(transport.send(0, manifest, flat))
    thread.join(60)
    for log in (sent, received):
        waits = [entry for entry in log if entry != "is_completed"]
        assert waits == [("wait", (), {})], log[-5:]
        assert log.index(waits[0]) > 0 and log[log.index(waits[0]) - 1] == "is_completed"
    assert sent.count("is_completed") > 1, "the sender did not have to poll: the test proves nothing"
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(engine.get_weights_by_name(name), params[name].detach())
    engine.shutdown()


def test_shared_tensor_payload_opens_in_an_unrelated_process(tmp_path):
    """The hand-off's CPU payload works between processes that share no multiprocessing authkey (as Ray
    actors and SGLang's schedulers): the receiver maps the sender's memory, and writes are seen both ways."""
    import subprocess
    import sys

    from backends.shared_tensor import share, shared_cpu_buffer

    buffer = shared_cpu_buffer(64)
    buffer.fill_(7)
    payload = tmp_path / "payload.bin"
    payload.write_bytes(share(buffer[:16].view(torch.float32)))
    code = (
        "import sys, torch; from backends.shared_tensor import open_shared\n"
        "t = open_shared(open(sys.argv[1], 'rb').read())\n"
        "assert t.shape == (4,) and t.dtype == torch.float32, (t.shape, t.dtype)\n"
        "print(int(t.view(torch.uint8)[0])); t.view(torch.uint8)[1] = 9\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(payload)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["7"] and int(buffer[1]) == 9


def test_plan_check_reads_the_checkpoint_headers_not_the_weights(tmp_path):
    """``check_manifests`` refuses wrong names, shapes and integer dtypes from the checkpoint's headers,
    never reading a weight back (a full copy per engine, and wrong with SGLang TP > 1)."""
    from backends.base import BackendError
    from rlhf_sg.engine_actor import EngineActor
    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    model = build_tiny_model("llama", "tiny", seed=3)
    path = save_tiny_model(str(tmp_path / "m"), model=model)
    actor = EngineActor("hf", BackendConfig(model_path=path, num_threads=1))

    def no_readback(name):
        raise AssertionError(f"check_manifests read weight {name!r} back")

    actor.backend.get_weights_by_name = no_readback
    named = named_weights(model)
    plan = plan_buckets([(n, p.shape, p.dtype) for n, p in named], 8192)
    assert actor.check_manifests(plan) == len(named)
    assert actor.check_manifests(plan) == len(named)  # once per plan: the second call is free
    name = "model.layers.0.mlp.gate_proj.weight"
    shape = dict(named)[name].shape
    cases = [
        ((name, (shape[0] + 1, shape[1]), F32), rf"{name}.*shape \({shape[0] + 1}, {shape[1]}\) in the trainer"),
        (("model.no_such.weight", (2,), F32), r"'model.no_such.weight' is not a weight of the engine's checkpoint"),
        ((name, tuple(shape), torch.int32), r"torch.int32 in the trainer but F32 in the engine"),
        ((name, tuple(shape), BF16), None),  # engines cast between floating types
    ]
    for meta, error in cases:
        bad = plan_buckets([meta], 1 << 30)
        if error is None:
            assert actor.check_manifests(bad) == 1
        else:
            with pytest.raises(BackendError, match=error):
                actor.check_manifests(bad)
    actor.shutdown()


HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang not installed (recipes/install/sglang_cpu.sh)")
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_tensor_transport_packs_in_the_trainer_and_sglang_loads_the_bytes_untouched(tmp_path, tp):
    """The colocated hand-off into SGLang, on CPU the same path as on GPU up to the device: the trainer
    process packs one payload per TP rank (SGLangBackend.pack_tensor_bucket, shared memory by name), the
    engine actor passes them to SGLang's Engine untouched, and SGLang's scheduler(s) open the trainer's
    memory. Weights and greedy output then match the trainer's model."""
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.tiny import build_tiny_model, save_tiny_model

    path = save_tiny_model(str(tmp_path / "m"), arch="llama", size="tiny", seed=0)
    model = build_tiny_model("llama", "tiny", seed=8)
    extra = {"engine_kwargs": {}}
    env = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    if tp == 2:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per TP rank (Ray's workers inherit it)
    if ray.is_initialized() and tp == 2:
        ray.shutdown()
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = BackendConfig(
            model_path=path, max_model_len=256, num_threads=1, tensor_parallel_size=tp, extra=extra
        )
        engines = start_engine_actors("sglang", config, 1, num_cpus=0, start_timeout_s=600)
        syncer = WeightSyncer(0, 1, engines, transport="tensor", bucket_bytes=64 * 1024, timeout_s=TIMEOUT_S)
        syncer.setup()
        try:
            stats = syncer.sync(model, 1)
        finally:
            syncer.close()
        assert stats["buckets"] > 2
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        out = ray.get(engines[0].generate.remote(PROMPTS, params), timeout=TIMEOUT_S)
        assert all(c.weight_version == 1 for c in out)
        state = {n: p.detach() for n, p in model.state_dict().items()}
        for prompt, completion in zip(PROMPTS, out):
            _assert_greedy_equals_hf(path, state, prompt, completion)
        if tp == 1:
            name = "model.layers.1.mlp.down_proj.weight"
            got = ray.get(engines[0].get_weights_by_name.remote(name), timeout=TIMEOUT_S)
            assert torch.equal(got, state[name])
        ray.get(engines[0].shutdown.remote(), timeout=TIMEOUT_S)
    finally:
        if env is None:
            os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = env
        if started:
            ray.shutdown()
