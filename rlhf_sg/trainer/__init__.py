"""The controller: one process drives the PPO loop over Ray actor groups and rollout engines.

Rooms by job:

* :mod:`~rlhf_sg.trainer.layout`: which groups a run starts, which share devices, threads and resources;
* :mod:`~rlhf_sg.trainer.cluster`: Ray, the model groups and engines, the device hand-over between them;
* :mod:`~rlhf_sg.trainer.rollout`: prompts -> completions -> rewards (seeds, dynamic sampling, versions);
* :mod:`~rlhf_sg.trainer.ppo`: the step (scoring forwards, advantages, updates, sync) and the loop;
* :mod:`~rlhf_sg.trainer.run_log` and :mod:`~rlhf_sg.trainer.checkpoint`: what a run leaves on disk.
"""

from rlhf_sg.data import load_tokenizer
from rlhf_sg.experience import Experience, build_rollout_batch
from rlhf_sg.trainer.ppo import PPOTrainer, train
from rlhf_sg.trainer.rollout import check_weight_versions, has_signal, rollout_seed, select_groups

__all__ = ["Experience", "PPOTrainer", "build_rollout_batch", "check_weight_versions", "has_signal",
           "load_tokenizer", "rollout_seed", "select_groups", "train"]
