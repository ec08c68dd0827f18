"""Rollout routing replay (``rlhf_sg.moe.replay``) on real transformers MoE models.

The gap test: a tiny Qwen3-MoE whose routers nearly tie (experts 0-2 share a router row up to a small noise), so a
bf16 forward (the engine) and an fp32 forward (the trainer) choose other experts for a third of the tokens. Without
replay the log-probs differ by far more than the two precisions do on a model without experts; with the bf16
forward's routes replayed in the fp32 forward, the gap falls to that level.
"""

import pytest
import torch

from rlhf_sg.moe import RouteRecorder, RouteReplay, router_layers
from rlhf_sg.moe.replay import ROUTE_DTYPE, route_bytes_per_token
from rlhf_sg.tiny import tiny_family_model

MOE_FAMILIES = ["qwen3-moe", "mixtral", "gpt-oss", "qwen3-next"]


def _logp(logits, ids):
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def _ids(rows=4, length=24, seed=1):
    return torch.randint(3, 60, (rows, length), generator=torch.Generator().manual_seed(seed))


def _near_ties(model, scale=30.0, eps=1e-3):
    """Experts 0, 1 and 2 of every router nearly tie (rows equal up to ``eps`` noise), expert outputs made large
    enough that which of them a token takes shows in its log-prob."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(scale)
                p[1] = p[0] + eps * torch.randn_like(p[0])
                p[2] = p[0] + eps * torch.randn_like(p[0])
            elif name.endswith("experts.down_proj"):
                p.mul_(10)
    return model


def _bf16_vs_fp32(model, ids, replay: bool):
    """(max |Δ log-prob| between the bf16 and the fp32 forward, the fraction of routes replay replaced)."""
    with torch.no_grad():
        model.to(torch.bfloat16)
        recorder = RouteRecorder(model) if replay else None
        if recorder is not None:
            with recorder.recording():
                engine = _logp(model(ids).logits, ids)
            (routes,) = recorder.take()
        else:
            engine = _logp(model(ids).logits, ids)
        model.float()
        if not replay:
            return (engine - _logp(model(ids).logits, ids)).abs().max().item(), None
        replayer = RouteReplay(model)
        with replayer.replaying(routes):
            trainer = _logp(model(ids).logits, ids)
        return (engine - trainer).abs().max().item(), replayer.replaced_fraction


def test_replay_closes_the_gap_that_flipped_experts_open():
    ids = _ids()
    dense_gap, _ = _bf16_vs_fp32(tiny_family_model("qwen3", seed=0).eval(), ids, replay=False)
    without, _ = _bf16_vs_fp32(_near_ties(tiny_family_model("qwen3-moe", seed=0).eval()), ids, replay=False)
    with_replay, replaced = _bf16_vs_fp32(_near_ties(tiny_family_model("qwen3-moe", seed=0).eval()), ids, True)
    assert replaced > 0.1, replaced  # the routers did disagree on many tokens
    assert without > 10 * dense_gap, (without, dense_gap)
    assert with_replay < 2 * dense_gap, (with_replay, dense_gap)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_moe_family_records_each_layers_routes_and_replays_them_exactly(family):
    model = tiny_family_model(family, seed=0).eval()
    layers = router_layers(model)
    assert [layer for _, layer in layers] == list(range(model.config.num_hidden_layers))
    ids = _ids(rows=3, length=10)
    recorder = RouteRecorder(model)
    with torch.no_grad():
        with recorder.recording():
            plain = model(ids).logits
            model(ids[:, :5])  # a second forward: routes come back per forward
        first, second = recorder.take()
        assert recorder.take() == []
        assert first.shape == (30, len(layers), recorder.top_k) and second.shape == (15, len(layers), recorder.top_k)
        assert first.dtype == ROUTE_DTYPE and (first >= 0).all() and (first < recorder.num_experts).all()
        torch.testing.assert_close(first.reshape(3, 10, -1)[:, :5], second.reshape(3, 5, -1), rtol=0, atol=0)
        replay = RouteReplay(model)
        with replay.replaying(first):
            replayed = model(ids).logits
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    assert replay.consumed == {layer: 1 for _, layer in layers} and replay.replaced_fraction == 0.0


def test_the_router_keeps_its_gradient_under_replay():
    """Gate weights come from the live scores at the replayed experts: replaying a forward's own routes gives the
    very gradient the model computes on its own, the router's included."""
    model = _near_ties(tiny_family_model("qwen3-moe", seed=0))
    ids = _ids()
    recorder = RouteRecorder(model)
    with recorder.recording():
        _logp(model(ids).logits, ids).sum().backward()
    (routes,) = recorder.take()
    own = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with RouteReplay(model).replaying(routes):
        _logp(model(ids).logits, ids).sum().backward()
    routers = [n for n in own if n.endswith("mlp.gate.weight")]
    assert routers and all(own[n].abs().sum() > 0 for n in routers)
    for name, grad in own.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_gradient_checkpointing_recompute_replays_the_same_routes():
    """The backward recomputes each layer (its router runs again): it must get the forward's routes, so the
    gradients equal those of the same replay without checkpointing."""
    ids = _ids()
    with torch.no_grad():
        engine = _near_ties(tiny_family_model("qwen3-moe", seed=0)).to(torch.bfloat16)
        recorder = RouteRecorder(engine)
        with recorder.recording():
            engine(ids)
        (routes,) = recorder.take()

    def grads(checkpointing: bool):
        model = _near_ties(tiny_family_model("qwen3-moe", seed=0)).train()
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay = RouteReplay(model)
        with replay.replaying(routes):
            _logp(model(ids).logits, ids).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, replay.consumed

    plain, once = grads(False)
    checkpointed, twice = grads(True)
    assert set(once.values()) == {1} and set(twice.values()) == {2}
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_tokens_without_a_record_keep_the_live_choice():
    model = _near_ties(tiny_family_model("qwen3-moe", seed=0)).eval()
    ids = _ids(rows=2, length=8)
    layers = len(router_layers(model))
    with torch.no_grad():
        plain = model(ids).logits
        with RouteReplay(model).replaying(torch.full((16, layers, 2), -1, dtype=ROUTE_DTYPE)):
            unrecorded = model(ids).logits
    torch.testing.assert_close(unrecorded, plain, rtol=0, atol=0)


def test_bad_routes_are_refused_before_the_forward_naming_token_and_layer():
    model = tiny_family_model("qwen3-moe", seed=0).eval()
    ids = _ids(rows=1, length=6)
    replay = RouteReplay(model)
    good = torch.tensor([[0, 1]], dtype=ROUTE_DTYPE).repeat(6, 2, 1)
    partial = good.clone()
    partial[2, 1] = -1
    cases = [
        (good[:, :1], r"this model needs \[tokens, 2 MoE layers, top_k 2\]"),
        (good.clone().index_fill_(0, torch.tensor([3]), 4), r"token 3, MoE layer 0: expert 4 outside \[0, 4\)"),
        (torch.tensor([[2, 2]], dtype=ROUTE_DTYPE).repeat(6, 2, 1), r"token 0, MoE layer 0: an expert chosen twice"),
        (partial, r"token 2: routes recorded for some layers or slots only"),
        (good.float(), "integer tensor"),
    ]
    for routes, match in cases:
        with pytest.raises(ValueError, match=match):
            with replay.replaying(routes):
                model(ids)
    with pytest.raises(ValueError, match=r"MoE layer 0: its router saw 6 tokens, the routes hold 5"):
        with replay.replaying(good[:5]):
            model(ids)
    with pytest.raises(ValueError, match=r"the routes of MoE layer\(s\) \[0, 1\] were never consumed"):
        with replay.replaying(good):
            pass
    with pytest.raises(ValueError, match="no router"):
        RouteReplay(tiny_family_model("qwen3", seed=0))


def test_route_memory_per_token():
    assert route_bytes_per_token(48, 8) == 768
    assert route_bytes_per_token(48, 8) * 32768 == 24 * 2**20


def test_replayed_experts_get_gate_weights_from_the_live_router_scores():
    """A router handed other experts than its own weights them by its live probabilities at those experts (Qwen3-MoE:
    softmax over all experts, then the chosen ones renormalised when ``norm_topk_prob``), not by the values of
    the experts it would have chosen."""
    model = tiny_family_model("qwen3-moe", seed=0).eval()
    ids = _ids(rows=2, length=8)
    tokens = torch.arange(16)
    routes = torch.stack([tokens % 4, (tokens + 1) % 4], dim=-1)[:, None, :].repeat(1, 2, 1).to(ROUTE_DTYPE)
    seen = []
    hooks = [router.register_forward_hook(lambda _m, _a, out: seen.append(out)) for router, _ in router_layers(model)]
    try:
        with torch.no_grad(), RouteReplay(model).replaying(routes):
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == 2
    for logits, scores, indices in seen:
        assert torch.equal(indices, routes[:, 0].long())
        expected = torch.softmax(logits.float(), -1).gather(-1, indices)
        if model.config.norm_topk_prob:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(scores.float(), expected, rtol=1e-6, atol=1e-7)


# ---- the embedded engine records the routes it sampled with ------------------------------------------------------
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_embedded_engine_returns_the_routes_the_model_takes_on_each_row_alone(family, tmp_path):
    """Several samples per prompt from prompts of different lengths (left-padded together), rows stopping at
    different steps (the decode compacts its rows): each completion's routes, prompt and sampled tokens but the last,
    are the routes of the model's own forward on that row alone."""
    from backends.base import BackendConfig, SamplingParams
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.tiny import save_tiny_model

    model = tiny_family_model(family, seed=0).eval()
    save_tiny_model(str(tmp_path), model=model)
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path), num_threads=1, max_model_len=64))
    prompts = [[5, 17, 33, 9, 60, 61, 8], [40, 41, 12], [70, 3, 99, 100, 101]]
    params = SamplingParams(n=3, max_new_tokens=8, seed=11, stop_token_ids=tuple(range(3, 40)),
                            return_routed_experts=True)
    try:
        completions = engine.generate(prompts, params)
        plain = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=11,
                                                        stop_token_ids=tuple(range(3, 40))))
    finally:
        engine.shutdown()
    assert len({len(c.token_ids) for c in completions}) > 1  # rows stopped at different steps
    assert [c.token_ids for c in plain] == [c.token_ids for c in completions]  # recording changes no sample
    assert all(c.routed_experts is None for c in plain)
    recorder = RouteRecorder(model)
    for c in completions:
        row = prompts[c.prompt_index] + c.token_ids
        with torch.no_grad(), recorder.recording():
            model(torch.tensor([row[:-1]]))
        (alone,) = recorder.take()
        assert c.routed_experts.shape == (len(row) - 1, len(router_layers(model)), recorder.top_k)
        assert torch.equal(c.routed_experts, alone), (family, c.prompt_index)


def test_a_backend_without_routes_or_a_dense_model_refuses_the_request(tmp_path):
    from backends.base import BackendConfig, BackendError, SamplingParams, check_generate_args
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.tiny import save_tiny_model

    asking = SamplingParams(max_new_tokens=2, return_routed_experts=True)
    with pytest.raises(BackendError, match="supports_routed_experts is False"):
        check_generate_args([[1, 2]], asking, 100, 64)
    save_tiny_model(str(tmp_path), model=tiny_family_model("qwen3", seed=0))
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path), num_threads=1, max_model_len=64))
    try:
        with pytest.raises(BackendError, match="has no mixture-of-experts router"):
            engine.generate([[5, 6]], asking)
    finally:
        engine.shutdown()


# ---- through the trainer's layout --------------------------------------------------------------------------------
def _engine_rollout(model, tmp_path, replay_routes: bool = True):
    """The embedded engine's samples of ``model`` (4 prompts x 4, fp32, batched decode), as the trainer's batch."""
    from backends.base import BackendConfig, SamplingParams
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.tiny import save_tiny_model

    save_tiny_model(str(tmp_path), model=model)
    engine = EmbeddedBackend(BackendConfig(model_path=str(tmp_path), num_threads=1, max_model_len=64))
    prompts = [[5, 17, 33, 9, 60, 61, 8], [40, 41, 12], [70, 3, 99, 100, 101], [7, 8, 9, 10]]
    try:
        out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, seed=3,
                                                      return_routed_experts=replay_routes))
    finally:
        engine.shutdown()
    return build_rollout_batch([prompts[c.prompt_index] for c in out], [c.token_ids for c in out],
                               [c.logprobs for c in out], 0,
                               routed_experts=[c.routed_experts for c in out] if replay_routes else None)


def _trainer_gap(model, experience, replay: bool) -> tuple[float, float | None]:
    from rlhf_sg.packing import response_logprobs

    with torch.no_grad():
        if replay:
            replayer = RouteReplay(model)
            with replayer.active():
                logp = response_logprobs(model, experience.sequences, experience.attention_mask,
                                         experience.response_width, routes=experience.routes, replay=replayer)
        else:
            replayer = None
            logp = response_logprobs(model, experience.sequences, experience.attention_mask, experience.response_width)
    gap = (logp - experience.rollout_logp).abs()[experience.action_mask].max().item()
    return gap, replayer.replaced_fraction if replayer else None


def test_the_engines_routes_replayed_in_the_trainers_packed_rows_close_the_engine_trainer_gap(tmp_path):
    """The R3 gap test, engine to trainer, all fp32: routers whose scores tie to a few ulps (``eps`` 1e-7) pick
    other experts in the engine's batched decode than in the trainer's packed rows for a fifth of the routes. Without
    replay the engine's and the trainer's log-probs of the sampled tokens differ by a few hundredths; with the
    engine's routes laid into the packed rows and replayed, by what they differ on a model without experts."""
    dense = tiny_family_model("qwen3", seed=0).eval()
    dense_gap, _ = _trainer_gap(dense, _engine_rollout(dense, tmp_path / "dense", replay_routes=False), False)
    moe = _near_ties(tiny_family_model("qwen3-moe", seed=0), eps=1e-7).eval()
    experience = _engine_rollout(moe, tmp_path / "moe")
    without, _ = _trainer_gap(moe, experience, replay=False)
    with_replay, replaced = _trainer_gap(moe, experience, replay=True)
    assert replaced > 0.05, replaced
    assert without > 1e-2, without
    assert with_replay <= max(4 * dense_gap, 2e-6), (with_replay, dense_gap)


def test_the_rollout_batch_lays_each_samples_routes_beside_its_tokens():
    from rlhf_sg.experience import build_rollout_batch

    routes = [torch.arange(4 * 2 * 2).reshape(4, 2, 2).to(ROUTE_DTYPE) % 4,  # prompt 3 + completion 2 - 1
              torch.arange(3 * 2 * 2).reshape(3, 2, 2).to(ROUTE_DTYPE) % 4]  # prompt 1 + completion 3 - 1
    exp = build_rollout_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [[0.0] * 2, [0.0] * 3], 0, routed_experts=routes)
    # columns: 3 prompt (left-padded) + 3 response; a sample's routes end before its last token
    assert exp.routes.shape == (2, 6, 2, 2)
    assert torch.equal(exp.routes[0, 0:4], routes[0]) and (exp.routes[0, 4:] == -1).all()
    assert (exp.routes[1, :2] == -1).all() and torch.equal(exp.routes[1, 2:5], routes[1])
    assert (exp.routes[1, 5] == -1).all()
    assert torch.equal(exp.rows([1]).routes, exp.routes[1:])
    with pytest.raises(ValueError, match=r"sample 1: the engine returned routes for 4 tokens, where its prompt "
                                         r"and completion \(1 \+ 3 tokens\) need 3"):
        build_rollout_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], [[0.0] * 2, [0.0] * 3], 0,
                            routed_experts=[routes[0], routes[0]])


def test_engine_vs_trainer_metrics_on_a_hand_case():
    import math

    from rlhf_sg.algorithms import engine_vs_trainer_metrics

    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = torch.tensor([[-1.0, -1.0, -9.0]])  # Δ 0, +1, -6 (the last not sampled)
    mask = torch.tensor([[True, True, False]])
    m = engine_vs_trainer_metrics(rollout, trainer, mask)
    assert m["rollout/logp_gap_engine_vs_trainer"] == pytest.approx(0.5)
    assert m["rollout/k3_kl_engine_vs_trainer"] == pytest.approx((math.e - 1 - 1) / 2)
    assert m["rollout/frac_logp_gap_over_ln2"] == pytest.approx(0.5)


def _replay_config(tmp_path, model: str, **changes):
    """A run with --train.routing_replay on ``model`` through the embedded engine; ``section__name=value`` changes."""
    from rlhf_sg.config import Config

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    c = Config()
    c.model.pretrain, c.data.prompt_data, c.data.label_key = model, str(prompts), "answer"
    c.reward.function = "arith_task:addition_reward"
    c.rollout.backend, c.train.routing_replay = "hf", True
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(c, section), name, value)
    return c


def test_routing_replay_is_refused_before_ray_where_it_cannot_run(tmp_path):
    from rlhf_sg.config import ConfigError, validate
    from rlhf_sg.tiny import save_tiny_model

    moe, dense = str(tmp_path / "moe"), str(tmp_path / "dense")
    save_tiny_model(moe, model=tiny_family_model("qwen3-moe", seed=0))
    save_tiny_model(dense, model=tiny_family_model("qwen3", seed=0))

    def cfg(model=moe, **changes):
        return _replay_config(tmp_path, model, **changes)

    validate(cfg())  # the embedded engine, a MoE model
    with pytest.raises(ConfigError, match="is not a mixture-of-experts model"):
        validate(cfg(model=dense))
    with pytest.raises(ConfigError, match="does not return the experts it routed"):
        validate(cfg(rollout__backend="recipes/custom_backend.py:HFGenerateBackend"))
    with pytest.raises(ConfigError, match="--agent.env"):
        validate(cfg(agent__env="rlhf_sg.agent:Environment"))
    with pytest.raises(ConfigError, match="partial_rollout"):
        validate(cfg(rollout__mode="async"))


def _qwen2_moe():
    """A tiny Qwen2-MoE: its router (Qwen2MoeTopKRouter) is not one replay was built and tested for."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from rlhf_sg.tiny import tiny_config

    config = Qwen2MoeConfig(vocab_size=tiny_config().vocab_size, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_router_replay_does_not_know_is_refused_by_name_and_the_probe_runs_it_plain(tmp_path):
    from rlhf_sg.config import ConfigError, validate
    from rlhf_sg.moe import replay_refusal
    from rlhf_sg.probe import check_packing
    from rlhf_sg.tiny import save_tiny_model

    model = _qwen2_moe()
    assert "Qwen2MoeTopKRouter" in replay_refusal(model)
    with pytest.raises(ValueError, match="Qwen2MoeTopKRouter"):
        RouteReplay(model)
    assert check_packing(model, share_prompts=False)["packed"] <= 1e-4  # the probe without replay, as before
    save_tiny_model(str(tmp_path / "m"), model=model)
    with pytest.raises(ConfigError, match="--train.routing_replay: .*Qwen2MoeTopKRouter"):
        validate(_replay_config(tmp_path, str(tmp_path / "m")))


def test_routes_armed_outside_the_replay_scope_are_refused():
    model = tiny_family_model("qwen3-moe", seed=0)
    with pytest.raises(RuntimeError, match="outside its active"):
        RouteReplay(model).arm(torch.zeros((3, 2, 2), dtype=ROUTE_DTYPE))


# ---- SGLang's routed experts (CUDA only) --------------------------------------------------------------------------
def _sglang_meta_info_routes(routes: torch.Tensor) -> str:
    """What SGLang 0.5.23 puts in ``meta_info["routed_experts"]`` for a token-id request
    (``tokenizer_manager.py``: ``pybase64.b64encode(val.numpy().tobytes())`` of the capturer's int32 host rows
    ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]``)."""
    import base64

    return base64.b64encode(routes.to(torch.int32).numpy().tobytes()).decode("utf-8")


def test_sglangs_routed_experts_decode_to_the_moe_layers_columns():
    from backends.base import BackendError
    from backends.sglang_backend import decode_routed_experts

    every_layer = torch.randint(0, 8, (5, 4, 2), generator=torch.Generator().manual_seed(0))
    out = decode_routed_experts(_sglang_meta_info_routes(every_layer), 5, 4, 2, [1, 3])
    assert out.dtype == ROUTE_DTYPE and torch.equal(out, every_layer[:, [1, 3]].to(ROUTE_DTYPE))
    with pytest.raises(BackendError, match="hold 40 values; 6 tokens x 4 layers x top-2 need 48"):
        decode_routed_experts(_sglang_meta_info_routes(every_layer), 6, 4, 2, [1, 3])
    with pytest.raises(BackendError, match="returned no routed_experts"):
        decode_routed_experts(None, 5, 4, 2, [1, 3])


def test_sglang_refuses_routing_replay_on_cpu_before_the_engine_starts(tmp_path):
    """SGLang 0.5.23 started on CPU with enable_return_routed_experts: its scheduler died in
    ``_cuda_host_register`` ("Torch not compiled with CUDA enabled"). Refused first, naming the way out."""
    import importlib.util

    from backends.base import BackendConfig, BackendError
    from rlhf_sg.tiny import save_tiny_model

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here (bash recipes/install/sglang_cpu.sh builds its venv)")
    from backends.sglang_backend import SGLangBackend

    save_tiny_model(str(tmp_path), model=tiny_family_model("qwen3-moe", seed=0))
    with pytest.raises(BackendError, match="SGLang captures routed experts on CUDA only"):
        SGLangBackend(BackendConfig(model_path=str(tmp_path), routed_experts=True, num_threads=1))


def test_routing_replay_through_sglang_is_refused_on_cpu_before_ray(tmp_path):
    from rlhf_sg.config import ConfigError, validate
    from rlhf_sg.tiny import save_tiny_model

    save_tiny_model(str(tmp_path / "m"), model=tiny_family_model("qwen3-moe", seed=0))
    with pytest.raises(ConfigError, match="(SGLang captures routed experts on CUDA only|cannot look up)"):
        validate(_replay_config(tmp_path, str(tmp_path / "m"), rollout__backend="sglang"))


@pytest.mark.gpu
def test_sglang_on_cuda_returns_the_routes_the_model_takes_on_each_row(tmp_path):
    """GPU only (SGLang's capture needs CUDA): a bf16 tiny Qwen3-MoE through SGLang with routed experts on; each
    completion's routes have the contract's shape and agree with the model's own forward on that row alone (bf16
    kernels may flip a near tie, so 90 % of the routes), and replaying them in the trainer's packed rows brings the
    trainer no further from the engine than routing live does."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs a CUDA device and sglang")
    from backends.base import BackendConfig, SamplingParams
    from backends.sglang_backend import SGLangBackend
    from rlhf_sg.experience import build_rollout_batch
    from rlhf_sg.tiny import save_tiny_model

    model = tiny_family_model("qwen3-moe", seed=0, head_dim=32).to(torch.bfloat16)
    save_tiny_model(str(tmp_path), model=model)
    model = model.cuda().eval()
    engine = SGLangBackend(BackendConfig(model_path=str(tmp_path), dtype="bfloat16", device="cuda",
                                         max_model_len=128, memory_fraction=0.3, routed_experts=True))
    prompts = [[5, 17, 33, 9, 60, 61, 8], [40, 41, 12], [70, 3, 99, 100, 101], [7, 8, 9, 10]]
    try:
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, return_routed_experts=True))
    finally:
        engine.shutdown()
    recorder, agree, total = RouteRecorder(model), 0, 0
    for c in out:
        row = prompts[c.prompt_index] + c.token_ids
        assert c.routed_experts.shape == (len(row) - 1, len(router_layers(model)), recorder.top_k)
        with torch.no_grad(), recorder.recording():
            model(torch.tensor([row[:-1]], device="cuda"))
        (alone,) = recorder.take()
        same = (c.routed_experts.long().sort(-1).values == alone.cpu().long().sort(-1).values).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree >= 0.9 * total, (agree, total)
    experience = build_rollout_batch([prompts[c.prompt_index] for c in out], [c.token_ids for c in out],
                                     [c.logprobs for c in out], 0, routed_experts=[c.routed_experts for c in out])
    without, _ = _trainer_gap(model, experience, replay=False)
    with_replay, _ = _trainer_gap(model, experience, replay=True)
    assert with_replay <= without + 1e-3, (with_replay, without)
