"""Mixture-of-experts policies: the router load-balancing loss over our packed layouts (:mod:`.router_loss`) and
rollout routing replay, the experts an engine chose replayed in the trainer's forward (:mod:`.replay`)."""

from rlhf_sg.moe.replay import RouteRecorder, RouteReplay, replay_refusal, router_layers
from rlhf_sg.moe.router_loss import RouterLoad, default_router_aux_loss_coef, has_router, load_balancing_loss

__all__ = ["RouteRecorder", "RouteReplay", "RouterLoad", "default_router_aux_loss_coef", "has_router",
           "load_balancing_loss", "replay_refusal", "router_layers"]
