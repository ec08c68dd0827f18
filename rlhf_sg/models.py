"""The value-head model: critic and reward model on a causal-LM backbone.

:class:`ValueHeadModel` is a plain ``nn.Module`` holding a transformers base model (a causal LM without
its lm_head) and a linear value head [hidden -> 1]. On disk it is the backbone in the ordinary
transformers format (``config.json`` + safetensors, written by the backbone's own ``save_pretrained``)
plus ``value_head.safetensors`` beside it ({"value_head.weight": [1, hidden]}).

Why a wrapper and a side file rather than a ``PreTrainedModel`` subclass: a subclass would need one class
per backbone config class, its own ``architectures`` entry and key-renaming rules for transformers'
loader, and its checkpoints would not open with ``AutoModel``. This way the backbone loads and saves
through transformers' own code paths, including partitioned loading under DeepSpeed ZeRO-3 (a live
``HfDeepSpeedConfig`` makes ``from_pretrained`` build it with ``zero.Init``); the head is an ordinary
parameter that ``deepspeed.initialize`` partitions like any other; and any tool can still read the
backbone with ``AutoModel.from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_KEY = "value_head.weight"
#: a trained reward model's score statistics ({"mean": m, "std": s, ...}), written beside the head by
#: ``rlhf-sg train-rm``: a reward group scores ``(value - mean) / std``
REWARD_NORMALIZATION_FILE = "reward_normalization.json"
#: the head of a transformers ``*ForSequenceClassification`` checkpoint with ``num_labels=1``
SEQUENCE_CLASSIFICATION_HEAD_KEY = "score.weight"


def attention_implementation(config, requested: str) -> str:
    """The attention implementation to load a model of ``config`` with: ``requested``, except eager where sdpa is
    requested and transformers has no sdpa attention for the family (gpt-oss, whose attention sinks only its eager
    and flex kernels take); logged, since the run then computes the mask's whole square."""
    if requested != "sdpa":
        return requested
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        cls = auto._model_mapping.get(type(config), None) if type(config) in auto._model_mapping else None
        if cls is not None:
            if getattr(cls, "_supports_sdpa", True):
                return requested
            logger.warning("%s has no sdpa attention in transformers; it runs with eager attention "
                           "(--model.attn_implementation eager)", cls.__name__)
            return "eager"
    return requested


def _checkpoint_tensor(path: str, name: str) -> torch.Tensor | None:
    """Tensor ``name`` from a local safetensors checkpoint (single file or sharded), or None."""
    from safetensors import safe_open

    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shard = json.load(f)["weight_map"].get(name)
        files = [shard] if shard else []
    else:
        files = ["model.safetensors"]
    for file in files:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        with safe_open(full, framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


class ValueHeadModel(nn.Module):
    """A transformers base model + ``value_head`` (``nn.Linear(hidden, 1, bias=False)``).

    ``forward`` returns one value per position, float32 [batch, seq]. Used as the PPO critic (values of
    response states, :func:`rlhf_sg.packing.critic_values`) and as the reward model (value at a row's
    last token, :func:`rlhf_sg.packing.reward_scores`).
    """

    def __init__(self, backbone: nn.Module, value_head: nn.Linear | None = None):
        super().__init__()
        self.model = backbone
        #: the score statistics a reward model was saved with (:data:`REWARD_NORMALIZATION_FILE`); 0 and 1: none
        self.reward_mean, self.reward_std = 0.0, 1.0
        hidden = backbone.config.hidden_size
        if value_head is None:
            value_head = nn.Linear(hidden, 1, bias=False, dtype=backbone.dtype)
            std = getattr(backbone.config, "initializer_range", 0.02)
            nn.init.normal_(value_head.weight, mean=0.0, std=std)
        if tuple(value_head.weight.shape) != (1, hidden):
            raise ValueError(f"value_head weight must be [1, {hidden}], got {tuple(value_head.weight.shape)}")
        self.value_head = value_head

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.model, "is_gradient_checkpointing", False))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """values: [batch, seq] float32 for ``input_ids`` [batch, seq]; other arguments go to the backbone."""
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def normalize_rewards(self, scores: torch.Tensor) -> torch.Tensor:
        """``(scores - reward_mean) / reward_std``: a reward model's scores as it was trained to give them
        (the identity for a model saved without statistics)."""
        return (scores - self.reward_mean) / self.reward_std

    @classmethod
    def from_pretrained(cls, path: str, **hf_kwargs) -> ValueHeadModel:
        """Load from a local directory: our own checkpoint, a causal LM, or a sequence classifier.

        The head comes from ``value_head.safetensors`` when present, else from ``score.weight`` of a
        ``*ForSequenceClassification`` checkpoint with one label (the usual reward-model format), else it
        is freshly initialised (normal, std = the config's ``initializer_range``) with a warning.
        ``hf_kwargs`` (``dtype``, ``attn_implementation``, ...) go to ``AutoModel.from_pretrained``.
        """
        from transformers import AutoModel

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: no config.json; expected a saved transformers model directory")
        backbone = AutoModel.from_pretrained(path, **hf_kwargs)
        model = cls(backbone)
        head_file = os.path.join(path, VALUE_HEAD_FILE)
        if os.path.isfile(head_file):
            from safetensors.torch import load_file

            weight, source = load_file(head_file).get(VALUE_HEAD_KEY), head_file
            if weight is None:
                raise ValueError(f"{head_file}: no tensor {VALUE_HEAD_KEY!r}")
        else:
            weight, source = _checkpoint_tensor(path, SEQUENCE_CLASSIFICATION_HEAD_KEY), path
        norm_file = os.path.join(path, REWARD_NORMALIZATION_FILE)
        if os.path.isfile(norm_file):
            with open(norm_file) as f:
                stats = json.load(f)
            mean, std = stats.get("mean"), stats.get("std")
            if not (isinstance(mean, (int, float)) and isinstance(std, (int, float)) and std > 0):
                raise ValueError(f"{norm_file}: needs a number 'mean' and a number 'std' > 0, got {stats}")
            model.reward_mean, model.reward_std = float(mean), float(std)
        if weight is None:
            logger.warning("%s: no value head found; value head freshly initialised", path)
            return model
        if tuple(weight.shape) != tuple(model.value_head.weight.shape):
            raise ValueError(
                f"{source}: value head of shape {tuple(weight.shape)}, expected "
                f"{tuple(model.value_head.weight.shape)} (one output, the backbone's hidden size)"
            )
        with torch.no_grad():
            model.value_head.weight.copy_(weight)
        logger.info("%s: value head restored", source)
        return model

    def save_pretrained(
        self, path: str, state_dict: dict[str, torch.Tensor] | None = None, **hf_kwargs
    ) -> None:
        """Save the backbone (transformers format) and ``value_head.safetensors`` under ``path``, and the score
        statistics (:data:`REWARD_NORMALIZATION_FILE`) when this model has any.

        ``state_dict``: full weights with this module's names (``model.*``, ``value_head.weight``), for
        when the live parameters are partitioned (ZeRO-3) and were gathered elsewhere; default: this
        module's own. ``hf_kwargs`` go to the backbone's ``save_pretrained``.
        """
        from safetensors.torch import save_file

        if state_dict is None:
            state_dict = self.state_dict()
        if VALUE_HEAD_KEY not in state_dict:
            raise KeyError(f"state_dict has no {VALUE_HEAD_KEY!r}; pass this module's full state dict")
        backbone_state = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path, state_dict=backbone_state, **hf_kwargs)
        head = state_dict[VALUE_HEAD_KEY].detach().to("cpu").contiguous()
        save_file({VALUE_HEAD_KEY: head}, os.path.join(path, VALUE_HEAD_FILE))
        if (self.reward_mean, self.reward_std) != (0.0, 1.0):
            with open(os.path.join(path, REWARD_NORMALIZATION_FILE), "w") as f:
                json.dump({"mean": self.reward_mean, "std": self.reward_std}, f)
