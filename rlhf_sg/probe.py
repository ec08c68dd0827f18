"""The start-up packing probe: a second line of defence behind :func:`rlhf_sg.packing.one_sequence_per_row_reason`.

At model load every worker runs three short sequences through the layouts its forwards use (sequences bin-packed
two to a row with the block-causal mask; with shared prompts, two responses after one prompt) and through the
model alone, one sequence at a time. If a layout's log-probs (a causal LM) or values (a value model) differ from
the sequences' own beyond float rounding, the model is marked to take one sequence per row
(:data:`PROBE_REASON_ATTRIBUTE`, read by ``one_sequence_per_row_reason``), with a warning naming the layout and the
difference; the probe then runs again, and if even one sequence per row is not exact the worker refuses to start
(float32; in half precision, where rounding cannot be told from a wrong forward as surely, it warns).
Cost: six forwards of at most nine tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: set on a model the probe found wrong when packed: its value is the reason, and every later forward takes one
#: sequence per row (:func:`rlhf_sg.packing.one_sequence_per_row_reason` reads it first)
PROBE_REASON_ATTRIBUTE = "_rlhf_sg_packing_probe"

#: the largest |Δ| (log-prob or value) the probe takes for rounding, by the model's dtype: float32 kernels of
#: different shapes differ by ~1e-6; bf16 by up to a few 1e-2 on a real model's log-probs. A sequence that reads
#: another's tokens or state differs by far more on a trained model
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 0.05}


def probe_batch(vocab_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """Three rollout rows (left-padded prompts, right-padded responses) of 9, 5 and 4 tokens: packed into rows of
    9 tokens the last two share a row, and they share one prompt. (sequences [3, S], attention_mask, width)."""
    gen = torch.Generator().manual_seed(20261125)
    high = max(4, min(int(vocab_size), 1000))
    prompts = [torch.randint(3, high, (3,), generator=gen), torch.randint(3, high, (2,), generator=gen)]
    rows = [(prompts[0], 6), (prompts[1], 3), (prompts[1], 2)]
    prompt_width, width = 3, 6
    sequences = torch.zeros(len(rows), prompt_width + width, dtype=torch.long)
    mask = torch.zeros_like(sequences)
    for b, (prompt, n) in enumerate(rows):
        sequences[b, prompt_width - len(prompt) : prompt_width] = prompt
        sequences[b, prompt_width : prompt_width + n] = torch.randint(3, high, (n,), generator=gen)
        mask[b, prompt_width - len(prompt) : prompt_width + n] = 1
    return sequences.to(device), mask.to(device), width


def _model_of(model: nn.Module) -> nn.Module:
    """The model inside a DeepSpeed engine and a PEFT (LoRA) wrapper: what the probe reads and marks (a wrapper
    hands attribute reads on to it, so the packing functions find the mark through either)."""
    from rlhf_sg.packing import _unwrap, unwrap_adapters

    return unwrap_adapters(_unwrap(model))


def _is_value_model(module: nn.Module) -> bool:
    from rlhf_sg.models import ValueHeadModel

    return isinstance(module, ValueHeadModel)


def _alone(model: nn.Module, module: nn.Module, sequences: torch.Tensor, mask: torch.Tensor,
           width: int) -> torch.Tensor:
    """Response log-probs (a causal LM) or values (a value model) [B, T] of each row run alone, its real tokens
    only, through the model's own forward."""
    prompt_width = sequences.shape[1] - width
    out = torch.zeros(sequences.shape[0], width, dtype=torch.float32, device=sequences.device)
    for b in range(sequences.shape[0]):
        real = mask[b].bool()
        ids = sequences[b][real][None]
        p = int(real[:prompt_width].sum())
        n = int(real[prompt_width:].sum())
        if _is_value_model(module):
            out[b, :n] = model(input_ids=ids, use_cache=False)[0, p - 1 : p - 1 + n].float()
        else:
            logits = model(input_ids=ids, use_cache=False).logits[0, p - 1 : p - 1 + n].float()
            out[b, :n] = logits.log_softmax(-1).gather(-1, ids[0, p : p + n, None])[:, 0]
    return out


def _layout(model: nn.Module, module: nn.Module, sequences: torch.Tensor, mask: torch.Tensor, width: int,
            share_prompts: bool, routes: torch.Tensor | None = None) -> torch.Tensor:
    """The layout's forward; shared prompts on a model switched to the shared-prompt attention take its blocks (on
    the probe's tiny batch they would not pay, and a run's batches may take them). ``routes`` (a mixture-of-experts
    causal LM, the packed layout): the experts each token took alone, replayed."""
    from rlhf_sg.packing import blocks_whatever_they_cost, critic_values, response_logprobs

    with blocks_whatever_they_cost():
        if _is_value_model(module):
            return critic_values(model, sequences, mask, width, share_prompts=share_prompts).float()
        if routes is not None and not share_prompts:
            from rlhf_sg.moe import RouteReplay

            replay = RouteReplay(module)
            with replay.active():
                return response_logprobs(model, sequences, mask, width, routes=routes, replay=replay).float()
        # a vision-language model: text rows with their explicit (M-RoPE) positions, as the run's forwards give them
        images = [None] * sequences.shape[0] if getattr(module.config, "vision_config", None) is not None else None
        return response_logprobs(model, sequences, mask, width, share_prompts=share_prompts, images=images).float()


#: config keys of a vision-language model's placeholder tokens (a text row must not hold them)
_VISION_TOKEN_KEYS = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id",
                      "vision_end_token_id")


def _ordinary_vocab(config) -> int:
    """Token ids below this are ordinary text tokens: the text model's vocabulary, below a vision-language model's
    first placeholder token."""
    vocab = config.get_text_config().vocab_size
    special = [v for k in _VISION_TOKEN_KEYS if isinstance(v := getattr(config, k, None), int)]
    return min([vocab, *special])


def _alone_routes(model: nn.Module, module: nn.Module, sequences: torch.Tensor, mask: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_alone` on a mixture-of-experts model, and the experts its routers chose for each real token
    [B, S, moe_layers, top_k] (-1 on padding). Replayed in the packed layout, they keep a router whose scores
    nearly tie from picking another expert there (a rounding difference, not a layout's fault, and what
    ``--train.routing_replay`` replays in the run's forwards)."""
    from rlhf_sg.moe import RouteRecorder

    recorder = RouteRecorder(module)
    with recorder.recording():
        reference = _alone(model, module, sequences, mask, width)
    per_row = recorder.take()
    routes = torch.full((*sequences.shape, *per_row[0].shape[1:]), -1, dtype=per_row[0].dtype)
    for b, row in enumerate(per_row):
        routes[b, mask[b].bool().cpu()] = row.cpu()
    return reference, routes


@torch.no_grad()
def measure(model: nn.Module, share_prompts: bool) -> dict[str, float]:
    """Largest |Δ| between each layout the forwards use (``packed``; ``shared`` with ``share_prompts``) and the
    probe's sequences run alone. Runs in eval mode and restores the mode."""
    module = _model_of(model)
    training = module.training
    module.eval()
    try:
        device = next(module.parameters()).device
        sequences, mask, width = probe_batch(_ordinary_vocab(module.config), device)
        from rlhf_sg.moe import has_router, replay_refusal

        routes = None
        if has_router(module) and not _is_value_model(module) and replay_refusal(module) is None:
            reference, routes = _alone_routes(model, module, sequences, mask, width)
        else:
            reference = _alone(model, module, sequences, mask, width)
        layouts = ["packed"] + (["shared"] if share_prompts else [])
        return {layout: float((_layout(model, module, sequences, mask, width, layout == "shared", routes)
                               - reference).abs().max()) for layout in layouts}
    finally:
        module.train(training)


def check_packing(model: nn.Module, share_prompts: bool, reduce: Callable[[list[float]], list[float]] | None = None
                  ) -> dict[str, float]:
    """The start-up probe (see the module doc). ``reduce``: combines the measured |Δ|s over the ranks of a group
    (their max), so every rank takes the same decision and runs the same forwards; None: this process alone.
    Returns the |Δ| per layout (after a fallback, the fallback's, under ``"one per row"``); raises RuntimeError
    when even one sequence per row differs."""
    module = _model_of(model)
    dtype = next(module.parameters()).dtype
    tolerance = PROBE_TOLERANCE.get(dtype, 0.1)

    def measured() -> dict[str, float]:
        deltas = measure(model, share_prompts)
        if reduce is not None:
            deltas = dict(zip(deltas, reduce(list(deltas.values()))))
        return deltas

    deltas = measured()
    wrong = {layout: d for layout, d in deltas.items() if not d <= tolerance}
    if not wrong:
        logger.info("%s: packing probe exact (%s)", type(module).__name__,
                    ", ".join(f"{k} {v:.1e}" for k, v in deltas.items()))
        return deltas
    described = ", ".join(f"{k} max |Δ| {v:.3g}" for k, v in wrong.items())
    reason = (f"the start-up packing probe found sequences packed together differ from each alone ({described}, "
              f"over the {dtype} tolerance {tolerance})")
    setattr(module, PROBE_REASON_ATTRIBUTE, reason)
    logger.warning("%s: %s; every forward now takes one sequence per row", type(module).__name__, reason)
    after = measured()
    if not all(d <= tolerance for d in after.values()):
        message = (f"{type(module).__name__}: {reason}, and one sequence per row still differs (max |Δ| "
                   f"{max(after.values()):.3g}): this model's forward on our rows is not its forward on each "
                   "sequence; check its attention implementation (--model.attn_implementation) or report the model")
        if dtype == torch.float32:
            raise RuntimeError(message)
        # in half precision a kernel's rounding on a trained model's unlikely tokens can pass the tolerance:
        # one sequence per row stays, and the run goes on with the warning
        logger.warning("%s (in %s this may be rounding; run the probe in float32 to tell)", message, dtype)
    return {**deltas, "one per row": max(after.values())}
