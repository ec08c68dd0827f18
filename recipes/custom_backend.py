"""Write your own rollout backend: a worked example.

A backend is a subclass of ``backends.base.RolloutBackend``. This one wraps transformers'
``generate`` (simple, slower than the built-in embedded engine) and takes new weights through the
"tensor" and "disk" transports; it leaves the collective transport out, and the base class then
answers such calls with a BackendError naming the transports it has.

Select it by ``module:Class`` or ``path/to/file.py:Class`` wherever a backend name goes::

    rlhf-sg ... --backend recipes/custom_backend.py:HFGenerateBackend

    from backends import BackendConfig, create_backend
    backend = create_backend("recipes/custom_backend.py:HFGenerateBackend", BackendConfig(model_path=...))

or ship it in a package with an entry point so it gets a plain name::

    [project.entry-points."rlhf_sg.backends"]
    hf-generate = "mypkg.backend:HFGenerateBackend"

Every backend must pass the contract suite: ``RLHF_SG_CONTRACT_BACKENDS=recipes/custom_backend.py:HFGenerateBackend
python -m pytest tests/test_backend_contract.py`` (this example is always included there).

Run this file to see it work on a tiny model: ``python recipes/custom_backend.py``.
"""

from __future__ import annotations

import glob
import os
import random

import torch

from backends.base import (
    BackendConfig,
    BackendError,
    BucketManifest,
    Completion,
    RolloutBackend,
    SamplingParams,
    check_generate_args,
)


class HFGenerateBackend(RolloutBackend):
    """Rollouts with ``model.generate``; weights by tensor hand-off or from safetensors on disk."""

    name = "hf-generate"
    transports = frozenset({"tensor", "disk"})

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        from transformers import AutoModelForCausalLM

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype).to(config.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.pad_id = self.model.config.pad_token_id or 0
        self.unseeded = random.Random(config.seed)  # seeds for calls that bring none

    # ---- rollout ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        # the same up-front checks as the built-in backends: empty prompts, bad ids, too long for the context
        check_generate_args(prompts, params, self.model.config.vocab_size, self.config.max_model_len)
        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        greedy = params.temperature == 0
        sampling = (
            {} if greedy else dict(temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p)
        )
        seed = params.seed if params.seed is not None else self.unseeded.getrandbits(63)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
            torch.manual_seed(seed)
            out = self.model.generate(
                # n rows per prompt, prompt-major (generate refuses num_return_sequences when greedy)
                input_ids=input_ids.repeat_interleave(params.n, dim=0),
                attention_mask=attention_mask.repeat_interleave(params.n, dim=0),
                do_sample=not greedy,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=sorted(stop_ids) or None,
                pad_token_id=self.pad_id,
                return_dict_in_generate=True,
                output_logits=True,  # raw logits: the log-prob convention wants them before truncation
                **sampling,
            )
        # logp of each generated token under softmax(logits / T), T = 1 for greedy: [B * n, steps]
        scale = 1.0 if greedy else params.temperature
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / scale
        logps = torch.log_softmax(logits, dim=-1).gather(2, new_tokens[:, :, None]).squeeze(2)

        completions = []
        for row, (tokens, row_logps) in enumerate(zip(new_tokens.tolist(), logps.tolist())):
            # generate pads finished rows; a row ends at its first stop token.
            end = next((j + 1 for j, t in enumerate(tokens) if t in stop_ids), None)
            completions.append(
                Completion(
                    token_ids=tokens[: end or len(tokens)],
                    logprobs=row_logps[: end or len(tokens)],
                    finish_reason="stop" if end else "length",
                    weight_version=self.weight_version,
                    prompt_index=row // params.n,
                )
            )
        return completions

    # ---- weights ---------------------------------------------------------------------------
    def _check(self, shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """Refuse a whole update before copying anything if one name or shape is off."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, shape in shapes.items():
            if name not in params:
                raise BackendError(f"{source}: tensor {name!r} is not a parameter of this model")
            if tuple(params[name].shape) != tuple(shape):
                raise BackendError(
                    f"{source}: tensor {name!r} has shape {tuple(shape)}, model has {tuple(params[name].shape)}"
                )

    @torch.no_grad()
    def _copy(self, named) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, value in named:
            params[name].copy_(value)

    def update_weights_from_tensor(self, manifest: BucketManifest, flat: torch.Tensor) -> None:
        self._check({t.name: t.shape for t in manifest.tensors}, "tensor bucket")
        self._copy(manifest.unflatten(flat))

    def update_weights_from_disk(self, path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise BackendError(f"update_weights_from_disk: no *.safetensors files in {path!r}")
        state = {}
        for file in files:
            state.update(load_file(file))
        self._check({k: v.shape for k, v in state.items()}, f"update_weights_from_disk({path!r})")
        self._copy(state.items())

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if name not in params:
            raise BackendError(f"get_weights_by_name: no parameter {name!r}")
        return params[name].detach().to("cpu", copy=True)

    def shutdown(self) -> None:
        self.model = None


if __name__ == "__main__":
    import tempfile

    from backends import available_backends, create_backend
    from rlhf_sg.tiny import load_tokenizer, save_tiny_model

    torch.set_num_threads(1)
    print("installed backends:", available_backends())
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(tmp, size="tiny")
        backend = create_backend(f"{os.path.abspath(__file__)}:HFGenerateBackend", BackendConfig(model_path=tmp))
        tokenizer = load_tokenizer(tmp)
        prompt = tokenizer("Hello, ")["input_ids"]
        for c in backend.generate([prompt], SamplingParams(n=2, max_new_tokens=12, seed=0)):
            print(f"{c.finish_reason:>6}  {tokenizer.decode(c.token_ids)!r}  sum logp {sum(c.logprobs):.2f}")
