"""The MoE router load-balancing loss over our packed and shared-prompt layouts equals the model's own ``aux_loss``
over the same sequences run padded with a 2D mask (transformers' ``load_balancing_loss_func``), and the actor's
micro-batch loss adds it with the coefficient in force."""

from __future__ import annotations

import pytest
import torch

from rlhf_sg.bench.models import rollout_batch
from rlhf_sg.moe import RouterLoad, has_router
from rlhf_sg.packing import response_logprobs
from rlhf_sg.tiny import tiny_family_model

#: the families of the matrix whose models route tokens to experts
MOE_FAMILIES = ("qwen3-moe", "qwen3-next", "mixtral", "gpt-oss")


def _unbalanced(family: str):
    """The family's tiny model with its routers' weights scaled up: random routers are nearly balanced (the loss
    near top_k whatever is counted); sharp ones make every token's routing weigh in the loss."""
    model = tiny_family_model(family)
    with torch.no_grad():
        for router, _ in RouterLoad(model).routers:
            router.weight.mul_(30.0)
    return model


@pytest.mark.parametrize("share_prompts", [False, True], ids=["packed", "shared"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_loss_equals_the_models_own_on_the_padded_batch(family, share_prompts):
    """Our loss over the packed rows (pad slots at the rows' ends) or the shared-prompt rows (each prompt once for
    two samples) equals the model's own aux_loss on the padded batch with its 2D mask (pads excluded, every row's
    prompt counted), value and gradient to float rounding. Counting pad slots, or a shared prompt once, fails it."""
    model = _unbalanced(family)
    sequences, mask, width = rollout_batch()
    routers = [router.weight for router, _ in RouterLoad(model).routers]
    own = model(input_ids=sequences, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    own_grads = torch.autograd.grad(own, routers)

    load = RouterLoad(model)
    response_logprobs(model, sequences, mask, width, share_prompts=share_prompts, router=load)
    ours = load.loss()
    ours_grads = torch.autograd.grad(ours, routers)
    assert ours.item() == pytest.approx(own.item(), rel=1e-5)
    for got, want in zip(ours_grads, own_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_the_model_defaults_and_the_flag():
    """None takes the model's training default (its coefficient only with output_router_logits on); a
    coefficient on a model without routers is refused."""
    from rlhf_sg.moe import default_router_aux_loss_coef
    from rlhf_sg.workers import router_aux_loss_coef

    model = tiny_family_model("qwen3-moe")
    model.config.router_aux_loss_coef = 0.02
    assert default_router_aux_loss_coef(model.config) == 0.0
    assert router_aux_loss_coef(model, None) == 0.0
    model.config.output_router_logits = True
    assert router_aux_loss_coef(model, None) == 0.02
    assert router_aux_loss_coef(model, 0.5) == 0.5
    assert router_aux_loss_coef(model, 0.0) == 0.0
    dense = tiny_family_model("qwen3")
    assert has_router(model) and not has_router(dense)
    assert router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        router_aux_loss_coef(dense, 0.1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_the_actor_loss_adds_the_router_loss_weighted_by_the_micro_batchs_share(aggregation):
    """loss(coef) - loss(0) = coef x aux x (the micro-batch's action tokens, or rows with a per-sequence
    aggregation) / normalizer, with aux the model's own on the padded batch; logged as router_aux_loss."""
    from rlhf_sg.algorithms import ActorLossConfig
    from rlhf_sg.experience import ActorUpdate, Experience
    from rlhf_sg.workers import actor_microbatch_loss

    model = _unbalanced("mixtral")
    sequences, mask, width = rollout_batch()
    action = mask[:, -width:].bool()
    mb = Experience(sequences=sequences, attention_mask=mask, action_mask=action,
                    rollout_logp=torch.zeros(sequences.shape[0], width))
    mb.advantages = torch.linspace(-1.0, 2.0, sequences.shape[0])[:, None].expand(-1, width) * action
    normalizer = 50.0
    losses, metrics = {}, {}
    for coef in (0.0, 0.3):
        update = ActorUpdate(loss=ActorLossConfig(aggregation=aggregation), old_logp_from_update=True,
                             share_prompts=True, router_aux_loss_coef=coef)
        with torch.no_grad():
            losses[coef], metrics[coef] = actor_microbatch_loss(model, mb, update, normalizer)
    with torch.no_grad():
        own = model(input_ids=sequences, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
    units = float(action.sum()) if aggregation == "token_mean" else sequences.shape[0]
    assert "router_aux_loss" not in metrics[0.0]
    assert metrics[0.3]["router_aux_loss"].item() == pytest.approx(own.item(), rel=1e-5)
    assert (losses[0.3] - losses[0.0]).item() == pytest.approx(0.3 * own.item() * units / normalizer, rel=1e-4)


def test_a_router_loss_on_a_dense_model_is_refused_before_ray(tmp_path):
    from rlhf_sg.config import Config, ConfigError, validate
    from rlhf_sg.tiny import save_tiny_model

    cfg = Config()
    cfg.model.pretrain = save_tiny_model(str(tmp_path / "dense"))
    cfg.train.router_aux_loss_coef = 0.01
    with pytest.raises(ConfigError, match="--train.router_aux_loss_coef 0.01: .* is not a mixture-of-experts"):
        validate(cfg)
    cfg.train.router_aux_loss_coef = -1.0
    with pytest.raises(ConfigError, match="--train.router_aux_loss_coef must be >= 0"):
        validate(cfg)


def test_gradient_checkpointing_records_each_router_once_and_gives_the_same_gradient():
    """The recompute in the backward runs the routers again after the recording ended: the loss and the router
    gradients equal those without checkpointing."""
    model = _unbalanced("qwen3-moe").train()
    sequences, mask, width = rollout_batch()
    results = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        load = RouterLoad(model)
        response_logprobs(model, sequences, mask, width, share_prompts=True, router=load)
        loss = load.loss()
        loss.backward()
        assert len(load.logits) == model.config.num_hidden_layers
        results.append((loss.item(), [router.weight.grad.clone() for router, _ in load.routers]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6)
