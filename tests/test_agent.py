"""Multi-turn rollouts (rlhf_sg.agent): exact ids, masks from provenance, budgets, tool failures, seeds, and the
trainer's log-probs on multi-turn rows. Fast tier: the embedded engine in-process, a tokenizer with merges."""

from __future__ import annotations

import dataclasses
import string
import time

import pytest
import torch

from backends.base import BackendConfig, SamplingParams
from rlhf_sg.agent import Environment, StepResult, ToolError, agent_metrics, run_agent_rollout, turn_seed
from rlhf_sg.config import AgentConfig
from rlhf_sg.data import Prompt
from rlhf_sg.experience import build_rollout_batch

DIGITS = "0123456789"


def merged_tokenizer():
    """Characters plus every digit pair as one token, with merges: "12" encodes as one id, so the two ids of
    "1" then "2", which an engine may sample, are a non-canonical segmentation of the same text."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for ch in string.printable.replace("\x0b", "").replace("\x0c", ""):
        vocab.setdefault(ch, len(vocab))
    merges = [(a, b) for a in DIGITS for b in DIGITS]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny random model over the merged tokenizer, saved, and the embedded engine on it (in-process)."""
    from backends.embedded import EmbeddedBackend
    from rlhf_sg.tiny import build_tiny_model

    tokenizer = merged_tokenizer()
    path = str(tmp_path_factory.mktemp("agent_model"))
    model = build_tiny_model(vocab_size=len(tokenizer), seed=3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    backend = EmbeddedBackend(BackendConfig(model_path=path, max_model_len=256, num_threads=1))
    yield backend, tokenizer, model
    backend.shutdown()


class Recorder:
    """generate_many over in-process backends (one per engine index), recording every call and completion."""

    def __init__(self, backends):
        self.backends, self.calls = backends, []

    def __call__(self, calls):
        out = []
        for engine, prompts, params in calls:
            completions = self.backends[engine].generate(prompts, params)
            self.calls.append((engine, prompts, params, completions))
            out.append(completions)
        return out


class Calc(Environment):
    """Answers each turn with "=<digits of the turn>;" (ids as the tokenizer encodes them), done after 3 turns."""

    made = 0

    def __init__(self, tokenizer, turns=3, obs=None):
        super().__init__(tokenizer)
        Calc.made += 1
        self.turns, self.seen, self.obs = turns, 0, obs

    def reset(self, prompt):
        self.prompt = prompt

    def step(self, turn_ids, turn_text, finish_reason):
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True, reward=1.0)
        obs = self.obs if self.obs is not None else self.encode("\n=" + "".join(c for c in turn_text if c.isdigit())[:6]
                                                               + ";")
        return StepResult(observation_ids=obs, tool_call=True)


def agent_cfg(**kw):
    base = dict(env="x:y", max_turns=3, max_turn_tokens=8, tool_timeout_s=5.0)
    return AgentConfig(**{**base, **kw})


def prompts_for(tokenizer, texts=("417*38=", "12+34=")):
    return [Prompt(list(tokenizer.encode(t)), t) for t in texts]


def run(engine, cfg=None, n=3, total=40, factory=None, context_len=256, seed=0, step=0, backends=None,
        params_kw=None):
    backend, tokenizer, _ = engine
    rec = Recorder(backends or [backend])
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=total, stop_token_ids=(2,), **(params_kw or {}))
    out = run_agent_rollout(prompts_for(tokenizer), n, params, rec, factory or (lambda tok: Calc(tok)), tokenizer,
                            cfg or agent_cfg(), len(rec.backends), context_len,
                            lambda e, t, b: turn_seed(seed, step, 0, e, t, b))
    return out, rec


# ---- exact ids, masks from provenance -------------------------------------------------------------------------------


def _turns_of(traj, rec, prompt_ids):
    """Every (call prompt, completion) whose prompt is this trajectory's prompt plus a prefix of its row, in order."""
    found = []
    for _, prompts, params, completions in rec.calls:
        for j, p in enumerate(prompts):
            if p[: len(prompt_ids)] != prompt_ids or p[len(prompt_ids):] != traj.token_ids[: len(p) - len(prompt_ids)]:
                continue
            for c in completions[j * params.n:(j + 1) * params.n]:
                end = len(p) - len(prompt_ids) + len(c.token_ids)
                if traj.token_ids[len(p) - len(prompt_ids):end] == c.token_ids:
                    found.append((len(p) - len(prompt_ids), c))
                    break
    return found


def test_rows_hold_the_engine_ids_under_a_non_canonical_segmentation(engine):
    _, tokenizer, _ = engine
    out, rec = run(engine, n=4)
    assert [t.prompt_index for t in out] == [0] * 4 + [1] * 4
    non_canonical = 0
    for traj in out:
        prompt = prompts_for(tokenizer)[traj.prompt_index].token_ids
        mask = [False] * len(traj.token_ids)
        logp = [0.0] * len(traj.token_ids)
        for start, c in _turns_of(traj, rec, prompt):
            mask[start:start + len(c.token_ids)] = [True] * len(c.token_ids)
            logp[start:start + len(c.token_ids)] = c.logprobs
            text = tokenizer.decode(c.token_ids)
            non_canonical += list(tokenizer.encode(text, add_special_tokens=False)) != c.token_ids
        # every sampled token found in a call at its place, nothing else marked as an action
        assert traj.action_mask == mask
        assert traj.logprobs == logp
        assert len(traj.token_ids) <= 40
        # the observation tokens are exactly the environment's ids (glue "\n" first, mask 0)
        turns = _turns_of(traj, rec, prompt)
        for (start, c), (nxt, _) in zip(turns, turns[1:]):
            obs = traj.token_ids[start + len(c.token_ids):nxt]
            assert obs[0] == tokenizer.convert_tokens_to_ids("\n") and not any(traj.action_mask[start + len(
                c.token_ids):nxt])
    # the engine did sample segmentations a decode/re-encode round trip would change
    assert non_canonical > 0


def test_stop_token_stays_with_the_model_turn(engine):
    _, tokenizer, _ = engine
    stops = [tokenizer.convert_tokens_to_ids(c) for c in string.ascii_letters]  # turns end early, on a letter
    out, rec = run(engine, cfg=agent_cfg(stop_token_ids=stops, max_turn_tokens=16), n=2)
    stopped = 0
    for traj in out:
        prompt = prompts_for(tokenizer)[traj.prompt_index].token_ids
        for start, c in _turns_of(traj, rec, prompt):
            if c.finish_reason != "stop":
                continue
            stopped += 1
            end = start + len(c.token_ids)  # the stop token is the model's last token: an action
            assert c.token_ids[-1] in stops + [2] and traj.action_mask[end - 1]
            assert end == len(traj.token_ids) or not traj.action_mask[end]  # the glue after it is not
    assert stopped > 0, "no turn ended on a stop token"


# ---- environments: one per trajectory, tool failures, hangs ---------------------------------------------------------


def test_one_environment_per_trajectory(engine):
    envs = []

    def factory(tok):
        envs.append(Calc(tok))
        return envs[-1]

    out, _ = run(engine, n=3, factory=factory)
    assert len(envs) == len(out) == 6 and len({id(e) for e in envs}) == 6
    assert all(e.seen == t.turns for e, t in zip(envs, out))
    assert all(t.finish_reason == "env_done" and t.env_reward == 1.0 for t in out)


class Failing(Environment):
    def __init__(self, tokenizer, how):
        super().__init__(tokenizer)
        self.how = how

    def step(self, turn_ids, turn_text, finish_reason):
        if self.how == "hang":
            time.sleep(1.0)
        if self.how == "raise":
            raise KeyError("boom")
        raise ToolError(self.how, "bad call")


@pytest.mark.parametrize("how,kind", [("malformed", "malformed"), ("unknown_tool", "unknown_tool"),
                                      ("raise", "exception"), ("hang", "timeout")])
def test_tool_failures_become_error_observations(engine, how, kind):
    _, tokenizer, _ = engine
    cfg = agent_cfg(tool_timeout_s=0.2 if how == "hang" else 5.0, max_turns=2 if how == "hang" else 3)
    out, rec = run(engine, cfg=cfg, n=2, total=120, factory=lambda tok: Failing(tok, how))
    for traj in out:  # every turn's step failed, the run went on to the turn limit
        assert traj.finish_reason == "max_turns" and traj.turns == cfg.max_turns
        assert traj.tool_errors == {kind: traj.turns}
        assert traj.tool_calls == sum(traj.tool_errors.values()) >= 1
        err = tokenizer.decode([t for t, m in zip(traj.token_ids, traj.action_mask) if not m])
        assert f"[error {kind}:" in err
    m = agent_metrics(out)
    assert m["agent/tool_error_frac"] == 1.0 and m["agent/tool_calls"] >= 1


def test_more_hung_steps_than_allowed_stop_the_rollout(engine):
    """Each step past its timeout is given up; one more given-up step still running than --agent.max_hung_steps is a
    fault of the run (a tool that never returns), not an observation."""
    cfg = agent_cfg(tool_timeout_s=0.1, max_turns=3, max_hung_steps=1)
    with pytest.raises(RuntimeError, match=r"--agent.max_hung_steps 1 allows"):
        run(engine, cfg=cfg, n=1, total=120, factory=lambda tok: Failing(tok, "hang"))


# ---- budgets and finish reasons --------------------------------------------------------------------------------------


def test_per_turn_budget_is_min_of_turn_cap_total_and_context(engine):
    _, tokenizer, _ = engine
    heads = [p.token_ids for p in prompts_for(tokenizer)]
    prompt_len = max(map(len, heads))
    for total, cap, context in [(40, 8, 256), (20, 16, 256), (40, 16, prompt_len + 30)]:
        out, rec = run(engine, cfg=agent_cfg(max_turn_tokens=cap, max_turns=6), total=total, context_len=context)
        for _, prompts, params, _ in rec.calls:
            # one call per budget: it asks exactly each of its trajectories' min(turn cap, total left, context left)
            wanted = set()
            for p in prompts:
                head = next(h for h in heads if p[:len(h)] == h)
                wanted.add(min(cap, total - (len(p) - len(head)), context - len(p)))
            assert wanted == {params.max_new_tokens}
        for t in out:  # the row is the total budget wide at most, never one turn's cap
            assert len(t.token_ids) <= total and len(t.token_ids) + len(heads[t.prompt_index]) <= context
        assert max(len(t.token_ids) for t in out) > cap


@pytest.mark.parametrize("policy", ["rollback", "truncate"])
def test_an_observation_that_does_not_fit_overflows(engine, policy):
    _, tokenizer, _ = engine
    big = tokenizer.encode("=" + "x" * 30 + ";")
    cfg = agent_cfg(overflow=policy, max_turn_tokens=8, max_observation_tokens=64)
    out, _ = run(engine, cfg=cfg, n=2, total=30, factory=lambda tok: Calc(tok, obs=big))
    for t in out:
        assert t.finish_reason == "overflow" and t.turns == 1
        holes = len(t.token_ids) - sum(t.action_mask)
        if policy == "rollback":
            assert holes == 0 and len(t.token_ids) == sum(t.action_mask)
        else:
            assert holes > 0 and len(t.token_ids) == 30 and t.token_ids[sum(t.action_mask):] == big[:holes]


def test_observation_length_bound_and_max_turns(engine):
    _, tokenizer, _ = engine
    obs = tokenizer.encode("=" + "y" * 20 + ";")
    cfg = agent_cfg(max_observation_tokens=5, max_turns=2, max_turn_tokens=4)
    out, _ = run(engine, cfg=cfg, n=2, total=60, factory=lambda tok: Calc(tok, turns=99, obs=obs))
    for t in out:
        assert t.finish_reason == "max_turns" and t.turns == 2
        assert len(t.token_ids) - sum(t.action_mask) == 5  # one observation, cut to the bound, none after turn 2


# ---- seeds, affinity, versions ---------------------------------------------------------------------------------------


def test_seeded_reruns_repeat_and_steps_differ(engine):
    a, _ = run(engine, seed=7, step=1)
    b, _ = run(engine, seed=7, step=1)
    c, _ = run(engine, seed=7, step=2)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    assert [t.token_ids for t in a] != [t.token_ids for t in c]


def test_every_turn_goes_to_the_engine_of_the_first(engine):
    backend, tokenizer, _ = engine
    out, rec = run(engine, backends=[backend, backend, backend], n=2, cfg=agent_cfg(max_turns=3))
    for t in out:
        assert t.engine == t.prompt_index % 3
        prompt = prompts_for(tokenizer)[t.prompt_index].token_ids
        engines = {e for e, prompts, _, _ in rec.calls for p in prompts
                   if p[:len(prompt)] == prompt and p[len(prompt):] == t.token_ids[:len(p) - len(prompt)]}
        assert engines == {t.engine} and t.turns == 3
        assert t.turn_versions == [0, 0, 0] and t.weight_version == 0


def test_the_router_places_each_prompt_group_and_gets_its_sessions_back(engine):
    """With a sticky-least-loaded router whose engine 0 is busy with a session of its own, both prompt groups go to
    the idle engines; every turn stays there; the rollout releases its
    sessions and finishes its calls, and records each call's prompt tokens where the engine reports hits."""
    from rlhf_sg.serve.router import Router

    backend, tokenizer, _ = engine
    router = Router(3)
    assert router.acquire("harness/elsewhere", 500) == 0
    rec = Recorder([backend] * 3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=(2,))
    out = run_agent_rollout(prompts_for(tokenizer), 2, params, rec, lambda tok: Calc(tok), tokenizer,
                            agent_cfg(max_turns=3), 3, 256, lambda e, t, b: turn_seed(0, 0, 0, e, t, b), router=router)
    assert sorted({t.engine for t in out}) == [1, 2]
    for t in out:
        prompt = prompts_for(tokenizer)[t.prompt_index].token_ids
        engines = {e for e, prompts, _, _ in rec.calls for p in prompts
                   if p[:len(prompt)] == prompt and p[len(prompt):] == t.token_ids[:len(p) - len(prompt)]}
        assert engines == {t.engine}
    assert [(e.sessions, e.calls, e.tokens) for e in router.engines] == [(1, 1, 500), (0, 0, 0), (0, 0, 0)]
    assert [e.chosen for e in router.engines] == [1, 1, 1]


# ---- experience: masks used everywhere, advantages across holes ------------------------------------------------------


def _experience(engine, n=2):
    backend, tokenizer, _ = engine
    out, _ = run(engine, n=n)
    prompts = prompts_for(tokenizer)
    return out, build_rollout_batch([prompts[t.prompt_index].token_ids for t in out], [t.token_ids for t in out],
                                    [t.logprobs for t in out], 0, [t.weight_version for t in out],
                                    [t.finish_reason for t in out], action_masks=[t.action_mask for t in out])


def test_engine_and_trainer_logprobs_agree_on_multi_turn_rows(engine):
    """Contract tolerance (tests/test_backend_contract.py LOGPROB_ATOL) on every action token of multi-turn rows,
    observations and the earlier turns in the context; packed and with shared prompts."""
    from test_backend_contract import LOGPROB_ATOL

    from rlhf_sg.packing import response_logprobs

    _, _, model = engine
    out, exp = _experience(engine)
    assert (~exp.action_mask & exp.attention_mask[:, -exp.response_width:].bool()).any(), "no holes in the rows"
    for share in (False, True):
        logp = response_logprobs(model, exp.sequences, exp.attention_mask, exp.response_width,
                                 share_prompts=share, attn_implementation="sdpa")
        gap = (logp - exp.rollout_logp).abs()[exp.action_mask]
        assert gap.max().item() < LOGPROB_ATOL


def test_values_at_masked_positions_change_no_loss(engine):
    from rlhf_sg import algorithms as algo

    out, exp = _experience(engine)
    m = exp.action_mask
    g = torch.Generator().manual_seed(0)
    fields = {k: torch.randn(m.shape, generator=g) for k in ("logp", "old", "adv", "ref", "ent", "val", "oldv", "ret")}
    fields["rollout"] = fields["old"] + 0.1 * torch.randn(m.shape, generator=g)
    cfg = algo.ActorLossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)

    def losses(f):
        normalizer = float(m.sum())
        a, am = algo.actor_loss(f["logp"], f["ent"], f["old"], f["adv"], m, cfg, normalizer, f["rollout"], f["ref"])
        v, _ = algo.value_loss(f["val"], f["oldv"], f["ret"], m, clip=0.2, normalizer=normalizer)
        return torch.stack([a, v, *am.values()])

    base = losses(fields)
    holes = ~m
    for k in fields:
        changed = dict(fields)
        changed[k] = torch.where(holes, fields[k] + 100.0, fields[k])
        assert torch.equal(losses(changed), base), k
    # the token-mean normaliser counts action tokens only
    assert algo.masked_aggregate(torch.ones(m.shape), m).item() == 1.0


def _compact(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's action-token values moved left, holes and padding dropped."""
    width = int(m.sum(dim=1).max())
    out, cm = torch.zeros(m.shape[0], width), torch.zeros(m.shape[0], width, dtype=torch.bool)
    for b in range(m.shape[0]):
        k = int(m[b].sum())
        out[b, :k], cm[b, :k] = x[b][m[b]], True
    return out, cm


@pytest.mark.parametrize("name", ["gae", "reinforce", "reinforce_baseline", "grpo"])
def test_advantages_across_holes_equal_their_compact_equivalents(name):
    from rlhf_sg.advantages import AdvantageInputs, advantage_estimator

    g = torch.Generator().manual_seed(1)
    B, T = 6, 14
    m = torch.rand(B, T, generator=g) < 0.6
    m[:, 0] = True
    m[0, 3:7] = False  # a long hole
    kl, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    kw = dict(scores=scores, kl_coef=0.05, group_size=3, gamma=0.9 if name in ("gae", "reinforce") else 1.0,
              lam=0.8)
    holed = AdvantageInputs(action_mask=m, kl=kl, values=values, **kw)
    ckl, cm = _compact(kl, m)
    cvals, _ = _compact(values, m)
    compact = AdvantageInputs(action_mask=cm, kl=ckl, values=cvals, **kw)
    adv, ret = advantage_estimator(name)(holed)
    cadv, cret = advantage_estimator(name)(compact)
    assert torch.allclose(_compact(adv, m)[0], cadv, atol=1e-5)
    assert (adv[~m] == 0).all()
    if ret is not None:
        assert torch.allclose(_compact(ret, m)[0], cret, atol=1e-5)


def test_metrics_and_finish_reasons(engine):
    out, _ = run(engine, n=2)
    m = agent_metrics(out)
    assert m["agent/turns"] == 3 and m["agent/finish_env_done"] == 1.0
    assert m["agent/action_tokens"] == sum(sum(t.action_mask) for t in out) / len(out)
    assert m["agent/observation_tokens"] > 0 and m["agent/tool_calls"] == 2


def test_reward_sees_the_model_text_only(engine):
    _, tokenizer, _ = engine
    for how in ("model", "all"):
        out, _ = run(engine, cfg=agent_cfg(reward_text=how), n=1)
        for t in out:
            model = tokenizer.decode([i for i, mk in zip(t.token_ids, t.action_mask) if mk], skip_special_tokens=True)
            whole = tokenizer.decode(t.token_ids, skip_special_tokens=True)
            assert t.reward_text == (model if how == "model" else whole)
            assert "=" in whole


def test_agent_flags_are_checked_before_ray(engine, tmp_path):
    from rlhf_sg.config import Config, ConfigError, validate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')

    def cfg_with(**agent):
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = engine[0].config.model_path, str(prompts), "m:f"
        cfg.agent = dataclasses.replace(cfg.agent, **agent)
        return cfg

    validate(cfg_with(env="rlhf_sg.agent:Environment"))
    validate(cfg_with())
    for agent, message in [
        (dict(env="no_such_module_anywhere:make"), "--agent.env 'no_such_module_anywhere:make': cannot import"),
        (dict(env="rlhf_sg.agent"), "give module:factory"),
        (dict(env="rlhf_sg.agent:nothing"), "has no callable 'nothing'"),
        (dict(env="rlhf_sg.agent:Environment", overflow="drop"), "--agent.overflow must be rollback or truncate"),
        (dict(env="rlhf_sg.agent:Environment", max_turns=0), "--agent.max_turns must be >= 1"),
        (dict(env="rlhf_sg.agent:Environment", max_hung_steps=-1), "--agent.max_hung_steps must be >= 0"),
        (dict(env="rlhf_sg.agent:Environment", reward_text="text"), "--agent.reward_text must be model or all"),
        (dict(env="rlhf_sg.agent:Environment", env_reward="x"), "--agent.env_reward must be ignore, add or replace"),
        (dict(env="rlhf_sg.agent:Environment", template_check="x"), "--agent.template_check must be off, warn or"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg_with(**agent))


def test_a_turn_cut_by_a_weight_sync_continues_and_the_sample_carries_the_oldest_version(engine):
    """Partial rollout: a turn the engine returns with finish "abort" (a weight sync cut it) goes on from its tokens
    so far with the new weights, within the same turn budget; the sample keeps every turn's version, the oldest
    as its own."""
    backend, tokenizer, _ = engine
    heads = [p.token_ids for p in prompts_for(tokenizer)]

    class CutFirstCalls(Recorder):
        def __call__(self, calls):
            out = []
            for engine_index, prompts, params in calls:
                if self.cuts < 2:  # the first two calls: two tokens, then a sync to the next version
                    short = backend.generate(prompts, dataclasses.replace(params, max_new_tokens=2))
                    completions = [dataclasses.replace(c, finish_reason="abort") for c in short]
                    self.cuts += 1
                    backend.finish_weight_update(backend.weight_version + 1)
                else:
                    completions = backend.generate(prompts, params)
                self.calls.append((engine_index, prompts, params, completions))
                out.append(completions)
            return out

    rec = CutFirstCalls([backend])
    rec.cuts = 0
    cfg = agent_cfg(max_turn_tokens=8, max_turns=2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, stop_token_ids=(2,))
    try:
        out = run_agent_rollout(prompts_for(tokenizer), 2, params, rec, lambda tok: Calc(tok), tokenizer, cfg, 1,
                                256, lambda e, t, b: turn_seed(0, 0, 0, e, t, b))
    finally:
        backend.finish_weight_update(0)
    for t in out:
        assert t.weight_version == 0 and t.turn_versions[0] == 0 and max(t.turn_versions) == 2
        assert len(t.turn_versions) == 4  # two cut segments of turn 1, the rest of it, turn 2
        # the continuation was asked from the prompt plus the tokens so far, for the rest of the turn's budget
        cont = [(p, params_) for _, ps, params_, _ in rec.calls[1:3] for p in ps if p[:len(heads[t.prompt_index])]
                == heads[t.prompt_index] and t.token_ids[:len(p) - len(heads[t.prompt_index])]
                == p[len(heads[t.prompt_index]):]]
        assert cont and all(q.max_new_tokens == 8 - (len(p) - len(heads[t.prompt_index])) for p, q in cont)
        assert t.turns == 2 and t.finish_reason in ("max_turns", "env_done")
        obs_start = t.action_mask.index(False)
        assert obs_start <= 8  # turn 1, its cut segments together, within its cap


def test_sync_mode_checks_every_turn_version_and_metrics_count_cache_hits():
    from backends.base import Completion
    from rlhf_sg.agent import Trajectory, sampled_versions
    from rlhf_sg.trainer.rollout import check_weight_versions

    def traj(versions, cached, sent, mask=(True, False, True)):
        return Trajectory(token_ids=[5, 6, 7], logprobs=[0.0] * 3, action_mask=list(mask), finish_reason="env_done",
                          weight_version=min(versions), prompt_index=0, turns=len(versions), turn_versions=versions,
                          cached_tokens=cached, prompt_tokens_sent=sent, tool_calls=1, tool_errors={"timeout": 1})

    ok = [traj([3, 3], 10, 40), traj([3, 3, 3], 30, 60)]
    check_weight_versions(sampled_versions(ok), 3)
    # the oldest version is the trainer's, a later turn's is not: still refused
    with pytest.raises(RuntimeError, match=r"weight version\(s\) \[4\]"):
        check_weight_versions(sampled_versions([*ok, traj([3, 4], 0, 10)]), 3)
    assert sampled_versions([Completion([1], [0.0], "stop", 2, 0)]) == [2]
    m = agent_metrics(ok)
    assert m["agent/prefix_cache_hit"] == 40 / 100 and m["agent/tool_error_frac"] == 1.0
    assert m["agent/observation_tokens"] == 1.0 and m["agent/turns"] == 2.5
    assert "agent/prefix_cache_hit" not in agent_metrics([traj([3], None, 10)])


def test_calculator_environment_of_the_recipe():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import calc_task

    from rlhf_sg.tiny import build_tokenizer

    tok = build_tokenizer()
    assert calc_task.calculate("417*38") == 15846 and calc_task.calculate("12-30") == -18
    # parsed with ast, never evaluated: code is a malformed call, not run
    for bad in ("__import__('os').getpid()", "2**3", "1*2*3", "a*b", "417*", "9999999*2", "(1).real*2"):
        with pytest.raises(ToolError) as err:
            calc_task.calculate(bad)
        assert err.value.kind == "malformed"
    env = calc_task.make_env(tok)
    env.reset(Prompt(tok.encode("417*38="), "417*38=", "15846"))
    call = env.step(tok.encode("{417*38}"), "{417*38}", "stop")
    assert tok.decode(call.observation_ids) == "=15846;" and call.tool_call and not call.done
    assert env.step(tok.encode("15846") + [tok.eos_token_id], "15846", "stop").done
    with pytest.raises(ToolError):
        env.step(tok.encode("417*38}"), "417*38}", "stop")
    assert tok.decode(env.error_observation("timeout", "slow")) == "=error;"
    broken = calc_task.make_broken_env(tok)
    broken.reset(None)
    with pytest.raises(RuntimeError):
        broken.step(tok.encode("{1*2}"), "{1*2}", "stop")
    # the reward reads the answer after the last call, in the model's text only
    assert calc_task.calc_reward([""] * 3, ["{417*38}15846", "15846", "{417*38}15847"], ["15846"] * 3) == [1, 1, 0]
    # the warm start never trains on the tool's observation
    assert [t for t, trained in calc_task.trace("417*38=", "15846", tool=True) if not trained] == ["=15846;"]


def test_agent_flags_on_the_command_line():
    from rlhf_sg.config import Config, apply_overrides, build_parser

    ns = vars(build_parser().parse_args(["--agent.env", "calc_task:make_env", "--agent.max_turns", "3",
                                         "--agent.stop_token_ids", "5,7", "--agent.overflow", "truncate",
                                         "--agent.tool_timeout_s", "2.5"]))
    ns.pop("config", None)
    cfg = apply_overrides(Config(), ns, "flag")
    assert (cfg.agent.env, cfg.agent.max_turns, cfg.agent.stop_token_ids) == ("calc_task:make_env", 3, [5, 7])
    assert cfg.agent.overflow == "truncate" and cfg.agent.tool_timeout_s == 2.5


@pytest.mark.parametrize("how", ["ignore", "add", "replace"])
def test_environment_reward_as_configured(engine, how):
    from rlhf_sg.config import Config
    from rlhf_sg.trainer.rollout import RolloutMaker

    _, tokenizer, _ = engine
    cfg = Config()
    cfg.agent.env, cfg.agent.env_reward = "rlhf_sg.agent:Environment", how
    called = []

    def score(prompts, completions, experience):
        called.append(len(completions))
        return torch.tensor([0.5] * len(completions))

    maker = RolloutMaker(cfg, [], None, 2, 0, score, tokenizer=tokenizer)
    out, _ = run(engine, n=2)  # Calc: env reward 1.0 per trajectory
    scores = maker._agent_scores(prompts_for(tokenizer), out, None)
    expected = {"ignore": 0.5, "add": 1.5, "replace": 1.0}[how]
    assert torch.equal(scores, torch.full((len(out),), expected))
    assert called == ([] if how == "replace" else [len(out)])


def chat_tokenizer():
    """The character tokenizer with Qwen's turn markers and a Qwen-style chat template."""
    from rlhf_sg.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


@pytest.mark.parametrize("mode", ["warn", "strict"])
def test_turn_boundaries_are_checked_against_the_chat_template(mode):
    from rlhf_sg.agent import Trajectory, check_turn_boundaries, turn_glue

    tok = chat_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    glue = turn_glue(tok)
    assert glue == (end, tok.encode("\n<|im_start|>tool\n", add_special_tokens=False))
    assert turn_glue(merged_tokenizer()) is None  # no chat template: nothing to compare with

    def traj(observation: str):
        turn = tok.encode('<tool_call>{"name": "calc"}</tool_call>', add_special_tokens=False) + [end]
        obs = tok.encode(observation, add_special_tokens=False)
        ids = turn + obs + tok.encode("42", add_special_tokens=False) + [end]
        mask = [True] * len(turn) + [False] * len(obs) + [True] * (len(ids) - len(turn) - len(obs))
        return Trajectory(ids, [0.0] * len(ids), mask, "env_done", 0, 0)

    good = traj("\n<|im_start|>tool\n=5;<|im_end|>\n<|im_start|>assistant\n")
    dropped = traj("<|im_start|>tool\n=5;<|im_end|>\n<|im_start|>assistant\n")  # the "\n" after <|im_end|> lost
    doubled = traj("<|im_end|>\n<|im_start|>tool\n=5;<|im_end|>\n<|im_start|>assistant\n")  # end token twice
    assert check_turn_boundaries([good], glue, mode) == 0
    if mode == "strict":
        with pytest.raises(ValueError, match="not the chat template's glue"):
            check_turn_boundaries([good, dropped], glue, mode)
    elif mode == "warn":
        assert check_turn_boundaries([good, dropped, doubled], glue, mode) == 2


def test_a_cut_turn_that_reached_its_cap_goes_to_the_environment(engine):
    backend, tokenizer, _ = engine
    steps = []

    class Seen(Calc):
        def step(self, turn_ids, turn_text, finish_reason):
            steps.append((len(turn_ids), finish_reason))
            return super().step(turn_ids, turn_text, finish_reason)

    def cut_first(calls):  # the first call's samples come back at the turn cap, labelled cut by a sync
        out = [backend.generate(ps, q) for _, ps, q in calls]
        if not steps and not cut_first.done:
            cut_first.done = True
            out = [[dataclasses.replace(c, finish_reason="abort") for c in cs] for cs in out]
        return out

    cut_first.done = False
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=60, stop_token_ids=())
    out = run_agent_rollout(prompts_for(tokenizer), 2, params, cut_first, lambda tok: Seen(tok), tokenizer,
                            agent_cfg(max_turn_tokens=6, max_turns=2), 1, 256, lambda e, t, b: 5 + t)
    assert cut_first.done and all(t.turns == 2 for t in out)
    full = [(n_ids, r) for n_ids, r in steps[:4]]
    assert all(r == "length" for _, r in full) and all(n_ids == 6 for n_ids, _ in full)


# ---- tools that never return -----------------------------------------------------------------------------------------

#: one agent rollout whose tool never returns, in a fresh interpreter that imports the agent module only (no torch:
#: the config and sampling parameters come as JSON from the real dataclasses, the engine is a script)
NEVER_RETURNS = r"""
import dataclasses, json, sys, threading, types
from rlhf_sg.agent import Environment, run_agent_rollout

spec = json.loads(sys.argv[1])
Params = dataclasses.make_dataclass("SamplingParams", [(k, object, dataclasses.field(default=tuple(v) if isinstance(
    v, list) else v)) for k, v in spec["params"].items()], frozen=True)

class Bytes:
    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode(errors="replace")

class NeverReturns(Environment):
    def step(self, turn_ids, turn_text, finish_reason):
        threading.Event().wait()

def generate_many(calls):
    return [[types.SimpleNamespace(token_ids=[65, 66], logprobs=[-1.0, -1.0], finish_reason="stop", weight_version=0)
             for _ in range(len(prompts) * params.n)] for _, prompts, params in calls]

prompt = types.SimpleNamespace(token_ids=[72, 105], text="Hi", label=None)
agent = types.SimpleNamespace(**spec["agent"])
out = run_agent_rollout([prompt], 2, Params(), generate_many, NeverReturns, Bytes(), agent, 1, 512, lambda e, t, b: t)
observations = [Bytes().decode([i for i, m in zip(t.token_ids, t.action_mask) if not m]) for t in out]
print(json.dumps([[t.finish_reason, t.turns, t.tool_errors, o] for t, o in zip(out, observations)]), flush=True)
"""


def test_a_tool_that_never_returns_does_not_hold_the_process_at_exit():
    """Each step times out into an error observation and a counter, and the interpreter exits when the rollout is
    done (a pool of non-daemon threads, as concurrent.futures has, would keep it waiting for the tool forever)."""
    import json
    import os
    import subprocess
    import sys

    spec = {"params": dataclasses.asdict(SamplingParams(n=2, max_new_tokens=200, stop_token_ids=(66,))),
            "agent": dataclasses.asdict(agent_cfg(tool_timeout_s=0.2, max_turns=2))}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", NEVER_RETURNS, json.dumps(spec)], capture_output=True, text=True,
                              timeout=20, env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit within 20 s of starting a rollout whose tool never returns; "
                    f"it printed {e.stdout!r}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out) == 2
    for finish, turns, errors, observations in out:
        assert (finish, turns, errors) == ("max_turns", 2, {"timeout": 2})
        assert observations.startswith("[error timeout: the tool did not answer within 0.2 s]")


def _poll(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.002)


def test_tool_pool_is_bounded_gives_up_steps_and_caps_the_hung_ones():
    """At most ``workers`` steps run at once; a step given up at its timeout frees its place (a running one keeps its
    daemon thread, a queued one never runs); one given-up step past ``max_hung`` still running stops the run."""
    import threading

    from rlhf_sg.agent import ToolPool

    pool = ToolPool(workers=2, max_hung=2, name="test-tool-pool")
    release, started = threading.Event(), []

    def step(name):
        started.append(name)
        release.wait(60)  # longer than any poll below: a step ends early only when released
        return name

    try:
        a, b, c = (pool.submit(step, x) for x in "abc")
        _poll(lambda: len(started) == 2, "two running steps")
        assert sorted(started) == ["a", "b"] and not c.running()  # the third waits: two threads at most
        threads = [t for t in threading.enumerate() if t.name.startswith("test-tool-pool")]
        assert len(threads) == 2 and all(t.daemon for t in threads)
        pool.abandon(a)  # its thread is left running; another takes the queue
        _poll(lambda: c.running(), "the queued step to start in the given-up one's place")
        assert pool.hung == 1
        d = pool.submit(step, "d")
        pool.abandon(d)  # still queued: never runs
        assert d.cancelled()
        pool.abandon(b)
        assert pool.hung == 2
        with pytest.raises(RuntimeError, match=r"3 environment steps .* --agent.max_hung_steps 2"):
            pool.abandon(c)
    finally:
        release.set()
    _poll(lambda: pool.hung == 0, "the given-up steps to return")
    assert (a.result(), b.result(), c.result()) == ("a", "b", "c") and "d" not in started
    pool.shutdown()
    _poll(lambda: not [t for t in threading.enumerate() if t.name.startswith("test-tool-pool")], "idle threads to end")


def test_the_trainers_environment_steps_run_on_daemon_threads():
    import threading

    from rlhf_sg.config import Config
    from rlhf_sg.tiny import build_tokenizer
    from rlhf_sg.trainer.rollout import RolloutMaker

    cfg = Config()
    cfg.agent.env, cfg.agent.env_workers, cfg.agent.max_hung_steps = "rlhf_sg.agent:Environment", 3, 5
    maker = RolloutMaker(cfg, [], None, 2, 0, None, tokenizer=build_tokenizer())
    pool = maker._env_pool
    assert (pool.workers, pool.max_hung) == (3, 5)
    assert pool.submit(lambda: threading.current_thread().daemon).result(timeout=10) is True
    pool.shutdown()


# ---- a real byte-level BPE tokenizer in Qwen2.5's chat format -------------------------------------------------------

QUESTION = [{"role": "user", "content": "What is 417*38?"}]
CALL = {"name": "calculator", "arguments": {"expression": "417*38"}}


def _recipe(name: str):
    import importlib
    import os
    import sys

    recipes = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    if recipes not in sys.path:
        sys.path.insert(0, recipes)
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def chat_tok():
    from rlhf_sg.tiny import build_chat_tokenizer

    return build_chat_tokenizer()


class ScriptedBackend:
    """An engine whose model is a script (the boundary: no tiny model writes a tool call on cue), held to the
    backend interface: a :class:`backends.base.RolloutBackend` whose ``generate`` checks its arguments as every
    backend does and returns :class:`Completion` s, n per prompt. The answer to a prompt is the script's turn for the
    number of assistant headers in it, exactly the scripted ids, cut after the first stop token (finish "stop") or
    at ``max_new_tokens`` (finish "length")."""

    def __new__(cls, tokenizer, turns: list[list[int]]):
        from backends.base import BackendConfig, Completion, RolloutBackend, check_generate_args

        class Scripted(RolloutBackend):
            name = "scripted"

            def generate(self, prompts, params):
                check_generate_args(prompts, params, len(tokenizer), self.config.max_model_len)
                header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
                out = []
                for i, p in enumerate(prompts):
                    turn = sum(p[j:j + len(header)] == header for j in range(len(p))) - 1
                    ids = []
                    for t in turns[turn][:params.max_new_tokens]:
                        ids.append(t)
                        if t in params.stop_token_ids:
                            break
                    finish = "stop" if ids[-1] in params.stop_token_ids else "length"
                    out += [Completion(list(ids), [-0.25] * len(ids), finish, self.weight_version, i)
                            for _ in range(params.n)]
                return out

        return Scripted(BackendConfig(model_path="scripted", max_model_len=1024))


def spelled(tok, text: str) -> list[int]:
    """``text`` as an engine may sample it: added tokens whole, every other character its own token, where the BPE
    joins them (``name``, `` answer``, ``"}}``). It decodes to ``text``."""
    import re

    added = tok.get_added_vocab()
    ids = []
    for part in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        ids += [added[part]] if part in added else [i for ch in part for i in tok.encode(ch, add_special_tokens=False)]
    return ids


def qwen_prompt(tok) -> Prompt:
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    return Prompt(tok.encode(text, add_special_tokens=False), text, "15846")


def qwen_run(tok, turns, n=2, stop_token_ids=()):
    backend = ScriptedBackend(tok, turns)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=400, stop_token_ids=(tok.eos_token_id,
                                                                                      tok.pad_token_id))
    cfg = agent_cfg(max_turns=4, max_turn_tokens=150, stop_token_ids=list(stop_token_ids))
    generate_many = lambda calls: [backend.generate(ps, q) for _, ps, q in calls]  # noqa: E731
    return run_agent_rollout([qwen_prompt(tok)], n, params, generate_many, _recipe("qwen_tools").make_env, tok, cfg, 1,
                             1024, lambda e, t, b: t)


def tool_response(tok, result: str) -> list[int]:
    """Qwen2.5's rendering of a tool result after the model's <|im_end|>, the next assistant header included."""
    return tok.encode(f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False)


def _special_segments(tok, ids, sampled):
    """ids cut at the special tokens: (special id or None, the ids of the piece, whether any was sampled)."""
    specials, out, piece, hit = set(tok.all_special_ids), [], [], False
    for t, m in zip(ids, sampled):
        if t in specials:
            out += [(None, piece, hit)] if piece else []
            out.append((t, [t], m))
            piece, hit = [], False
        else:
            piece.append(t)
            hit = hit or m
    return out + ([(None, piece, hit)] if piece else [])


def assert_matches_the_render(tok, ours, sampled, messages):
    """Our ids against the chat template's render of the same conversation, at the special-token boundaries: the
    same special tokens in the same places, the same text between them, and exactly the template's ids in every
    piece the engine did not sample (prompt, glue, observations)."""
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")  # the glue after the last turn, which no observation follows
    theirs = tok.encode(rendered[:-1], add_special_tokens=False)
    a, b = _special_segments(tok, ours, sampled), _special_segments(tok, theirs, [False] * len(theirs))
    assert [s for s, _, _ in a] == [s for s, _, _ in b]
    for (_, mine, was_sampled), (_, template, _) in zip(a, b):
        assert tok.decode(mine) == tok.decode(template)
        assert was_sampled or mine == template


@pytest.mark.parametrize("turn_stop", ["<|im_end|>", "</tool_call>"])
def test_qwen_tool_calls_keep_the_sampled_ids_and_match_the_chat_template(chat_tok, turn_stop):
    """A real byte-level BPE (merges) and Qwen's format: the engine's turns in a non-canonical segmentation stay
    exactly as sampled (a decode / re-encode would change them), <|im_end|> ends the model's turn (mask 1), the
    template's "\\n" after it opens the observation (mask 0), and the whole row is the chat template's render.
    With </tool_call> as a turn's stop token (--agent.stop_token_ids) the <|im_end|> the model did not write opens
    the observation."""
    import json

    from rlhf_sg.agent import check_turn_boundaries, turn_glue

    tok = chat_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = spelled(tok, f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>") + [end]
    turn2 = spelled(tok, "The answer is 15846.") + [end]
    for turn in (turn1, turn2):  # the engine's segmentation is not the tokenizer's
        assert tok.decode(turn) and tok.encode(tok.decode(turn), add_special_tokens=False) != turn
    obs = tool_response(tok, "15846")
    if turn_stop == "</tool_call>":  # the engine stops before the <|im_end|>, which the observation then opens with
        turn1, obs = turn1[:-1], [end] + obs
    out = qwen_run(tok, [turn1, turn2], stop_token_ids=[tok.convert_tokens_to_ids(turn_stop)])
    prompt = qwen_prompt(tok).token_ids
    messages = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
                {"role": "tool", "content": "15846"}, {"role": "assistant", "content": "The answer is 15846."}]
    for t in out:
        assert (t.finish_reason, t.turns, t.tool_calls, t.tool_errors) == ("env_done", 2, 1, {})
        assert t.token_ids == turn1 + obs + turn2
        assert t.action_mask == [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2)
        assert t.logprobs == [-0.25] * len(turn1) + [0.0] * len(obs) + [-0.25] * len(turn2)
        assert_matches_the_render(tok, prompt + t.token_ids, [False] * len(prompt) + t.action_mask, messages)
        # the reward sees the model's text: its call and its answer, no tool response
        assert t.reward_text == tok.decode(turn1 + turn2, skip_special_tokens=True)
        assert "<tool_call>" in t.reward_text and "<tool_response>" not in t.reward_text
    glue = turn_glue(tok)
    assert glue == (end, tok.encode("\n<|im_start|>user\n<tool_response>\n", add_special_tokens=False))
    assert check_turn_boundaries(out, glue, "strict") == 0


@pytest.mark.parametrize("call,kind,says", [
    ('{"name": "calculator", "arguments": {"expression": "417*38"}', "malformed", "not JSON"),
    ('["calculator", "417*38"]', "malformed", "a tool call is"),
    ('{"name": "search", "arguments": {"query": "417*38"}}', "unknown_tool", "no tool 'search'"),
    ('{"name": "calculator", "arguments": {"expr": "417*38"}}', "malformed", "missing a required argument"),
    ('{"name": "calculator", "arguments": {"expression": "__import__(0)"}}', "malformed", "is not INT*INT"),
])
def test_qwen_tool_call_errors_become_error_observations(chat_tok, call, kind, says):
    """A call that is not JSON, not a call, names no tool or misfits its tool is answered with an error in the
    template's <tool_response> block (mask 0) and counted; the trajectory goes on, and the model's next call works."""
    import json

    from rlhf_sg.agent import check_turn_boundaries, turn_glue

    tok = chat_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    bad = spelled(tok, f"<tool_call>\n{call}\n</tool_call>") + [end]
    good = spelled(tok, f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>") + [end]
    answer = spelled(tok, "15846") + [end]
    out = qwen_run(tok, [bad, good, answer])
    for t in out:
        assert (t.finish_reason, t.turns, t.tool_calls, t.tool_errors) == ("env_done", 3, 2, {kind: 1})
        error = t.token_ids[len(bad):t.action_mask.index(True, len(bad))]
        text = tok.decode(error)
        assert text.startswith(f"\n<|im_start|>user\n<tool_response>\nerror ({kind}): ") and says in text
        assert text.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert t.token_ids == bad + error + good + tool_response(tok, "15846") + answer
        assert not any(t.action_mask[len(bad):len(bad) + len(error)])
    assert check_turn_boundaries(out, turn_glue(tok), "strict") == 0


def _glue_dropped(tok):
    class GlueDropped(_recipe("qwen_tools").QwenToolEnv):  # the "\n" after <|im_end|> lost
        def tool_responses(self, results):
            return super().tool_responses(results)[1:]

    return GlueDropped(tok)


def _end_doubled(tok):
    class EndDoubled(_recipe("qwen_tools").QwenToolEnv):  # <|im_end|> in the observation too: counted twice
        def tool_responses(self, results):
            return [self.end_id] + super().tool_responses(results)

    return EndDoubled(tok)


def _wrong_role(tok):
    class WrongRole(_recipe("qwen_tools").QwenToolEnv):  # a "tool" turn: Qwen2.5 renders tool results in a user turn
        def tool_responses(self, results):
            text = self.tokenizer.decode(super().tool_responses(results))
            return self.encode(text.replace("<|im_start|>user", "<|im_start|>tool", 1))

    return WrongRole(tok)


@pytest.mark.parametrize("mode", ["off", "warn", "strict"])
def test_the_trainers_turn_boundary_check_on_the_bpe_tokenizer(chat_tok, mode):
    """RolloutMaker (the engines' Ray calls replaced by the scripted engine) with --agent.template_check: a Qwen
    environment passes; one that drops the glue, counts <|im_end|> twice or opens the wrong turn is counted (warn),
    stops the run (strict) or goes unchecked (off)."""
    import json

    from rlhf_sg.config import Config
    from rlhf_sg.trainer.rollout import RolloutMaker

    _recipe("qwen_tools")
    tok = chat_tok
    end = tok.convert_tokens_to_ids("<|im_end|>")
    backend = ScriptedBackend(tok, [spelled(tok, f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>") + [end],
                                    spelled(tok, "15846") + [end]])
    cfg = Config()
    cfg.agent.env, cfg.agent.template_check, cfg.agent.max_turn_tokens = "qwen_tools:make_env", mode, 150
    cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len = 2, 400, 1024
    maker = RolloutMaker(cfg, [backend], None, (end, tok.pad_token_id), tok.pad_token_id, None, tokenizer=tok)
    maker._generate_on = lambda calls: [backend.generate(ps, q) for _, ps, q in calls]
    out = maker.generate([qwen_prompt(tok)], step=0)
    assert [t.turns for t in out] == [2, 2] and maker.template_mismatches == 0
    for broken in (_glue_dropped, _end_doubled, _wrong_role):
        maker.env_factory = broken
        if mode == "strict":
            with pytest.raises(ValueError, match="not the chat template's glue"):
                maker.generate([qwen_prompt(tok)], step=0)
            continue
        out = maker.generate([qwen_prompt(tok)], step=0)
        assert [t.turns for t in out] == [2, 2]
        assert maker.template_mismatches == (2 if mode == "warn" else 0)
        assert maker._agent_stats(out)["agent/template_mismatch"] == maker.template_mismatches


def test_the_chat_tokenizer_is_deterministic_saves_and_loads(chat_tok, tmp_path):
    from rlhf_sg.data import load_tokenizer
    from rlhf_sg.tiny import CHAT_SPECIAL_TOKENS, CHAT_TOOL_TOKENS, build_chat_tokenizer

    tok = chat_tok
    assert build_chat_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    messages = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
                {"role": "tool", "content": "15846"}, {"role": "assistant", "content": "The answer is 15846."}]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert loaded.apply_chat_template(messages, tokenize=False) == rendered
    ids = tok.encode(rendered, add_special_tokens=False)
    assert loaded.encode(rendered, add_special_tokens=False) == ids and tok.decode(ids) == rendered
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert set(CHAT_SPECIAL_TOKENS) <= set(loaded.all_special_tokens)
    for t in CHAT_TOOL_TOKENS:  # one added token each, not special: kept in the text tool calls are parsed from
        (i,) = tok.encode(t, add_special_tokens=False)
        assert tok.decode([i], skip_special_tokens=True) == t and t not in tok.all_special_tokens
    assert len(tok.encode(" answer", add_special_tokens=False)) == 1  # a learned merge


# ---- the async producer, in one process -----------------------------------------------------------------------------


def test_async_producer_cuts_a_turn_at_a_sync_and_continues_it(engine, monkeypatch):
    """The trainer's async path with Ray replaced at its boundary only (tests/test_sync_spec.py's handles: the real
    EngineActor on the embedded engine, in this process): AsyncRollout's producer makes a multi-turn batch with the
    real RolloutMaker; the trainer's sync cuts the first turn mid-generation (partial rollout's abort), loads version
    1 and resumes; the turn goes on from its tokens with version 1, then the second turn. Every turn's version is kept,
    the sample carries the oldest, and the experience the trainer takes holds the trajectories' rows and masks."""
    import concurrent.futures
    import threading

    import ray
    from test_sync_spec import _Context, _get, _Handle, _wait

    from backends.base import BackendConfig as Config_
    from rlhf_sg.config import Config
    from rlhf_sg.data import PromptStream
    from rlhf_sg.engine_actor import EngineActor
    from rlhf_sg.timing import StepTimer
    from rlhf_sg.trainer.async_rollout import AsyncRollout
    from rlhf_sg.trainer.rollout import RolloutMaker

    backend, tokenizer, model = engine
    for name, fake in [("wait", _wait), ("get", _get), ("get_runtime_context", _Context),
                       ("get_gpu_ids", lambda: []), ("is_initialized", lambda: False)]:
        monkeypatch.setattr(ray, name, fake)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # EngineActor would export it into this process
    actor = EngineActor("hf", Config_(model_path=backend.config.model_path, max_model_len=256, num_threads=1))
    calls = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="engine-call")
    # the first generate blocks at its third forward (two tokens sampled) until the sync's abort reaches the engine
    mid_turn, forwards = threading.Event(), []

    def hold_mid_turn(module, args, output):
        forwards.append(1)
        if len(forwards) == 3:
            mid_turn.set()
            actor.backend._abort.wait(30)

    hook = actor.backend.model.register_forward_hook(hold_mid_turn)
    cfg = Config()
    cfg.agent.env, cfg.agent.max_turn_tokens, cfg.agent.max_turns = "rlhf_sg.agent:Environment", 8, 2
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 2, 2, 40
    stream = PromptStream(prompts_for(tokenizer), 2, seed=0)
    # an end-of-sequence id past the vocabulary: every turn runs to its cap (8), the cut falls inside the first
    maker = RolloutMaker(cfg, [_Handle(actor, calls)], stream, model.config.vocab_size + 1, 0,
                         lambda prompts, completions, exp: torch.zeros(len(completions)), on_policy=False,
                         tokenizer=tokenizer)
    maker.env_factory = lambda tok: Calc(tok, turns=2)
    made = []
    generate = maker.generate
    maker.generate = lambda prompts, step, draw=0: made.append(generate(prompts, step, draw)) or made[-1]
    producer = AsyncRollout(maker, first_step=0, last_step=1, engine_version=0, max_staleness=1, timeout_s=30,
                            data_state=stream.state, abort=actor.abort_generation, resume=actor.resume_generation)
    timer = StepTimer(sync=lambda: None)
    timer.start_step()
    try:
        producer.start()
        assert mid_turn.wait(30), "the first turn did not start"
        assert producer.sync(lambda: actor.finish_weight_update(1), version=1, timer=timer) == 1
        prompts, experience, metrics = producer.take(0)
    finally:
        producer.stop()
        hook.remove()
        calls.shutdown()
    (trajectories,) = made
    for t in trajectories:
        # the first turn: two tokens from version 0, the rest of its 8 after the sync; the second turn from version 1
        assert t.turn_versions == [0, 1, 1] and t.weight_version == 0 and t.turns == 2
        first = t.action_mask.index(False)
        assert first == 8 and t.finish_reason == "env_done"
    assert metrics["rollout/partial_samples"] == 4 and metrics["agent/turns"] == 2
    T = experience.response_width
    assert experience.weight_version.tolist() == [0] * 4
    assert experience.action_mask.tolist() == [t.action_mask + [False] * (T - len(t.action_mask)) for t in trajectories]
    assert [experience.sequences[i, -T:][:len(t.token_ids)].tolist() for i, t in enumerate(trajectories)] == [
        t.token_ids for t in trajectories]
