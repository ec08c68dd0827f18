"""Training on samples of older weights (async rollout): which samples may start generating (:mod:`.admission`:
AReaL's capacity rule, counted in samples; :mod:`.inflight`: applied one prompt group at a time, and the samples
made and not trained, as checkpoints hold them) and how stale each token is (:mod:`.versions`: the weights that sampled
every token, through partial rollouts and multi-turn). The loss that corrects for it is
:func:`rlhf_sg.algorithms.decoupled_policy_loss`."""

from rlhf_sg.offpolicy.admission import Admission
from rlhf_sg.offpolicy.inflight import InFlight
from rlhf_sg.offpolicy.versions import token_staleness

__all__ = ["Admission", "InFlight", "token_staleness"]
