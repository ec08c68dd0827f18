"""``python -m rlhf_sg.bench models``: the model-family matrix.

For each family of :data:`rlhf_sg.tiny.FAMILIES` (tiny random-weight float32 models built from their config
classes) and each training layout, the largest |Δ| between what the layout gives and what each row gives alone
through the model's own forward: response log-probs, their entropy, the values of a critic head on the same
backbone (:class:`rlhf_sg.models.ValueHeadModel`), and the gradient of the summed log-probs.

Layouts: ``packed`` (sequences bin-packed into rows with a block-causal mask, ``share_prompts=False``),
``shared`` (rows with one prompt compute it once, ``share_prompts=True``, on the tree mask) and ``blocks`` (the same
rows with the model switched to :func:`rlhf_sg.packing.use_shared_prompt_attention`, as the trainer's workers
switch it: layers that can, compute the rows block by block; the count of those layers is printed). A layout
prints ``exact`` when every |Δ| is within float rounding, ``fell back`` when the model's recurrent layers made it
take one sequence per row (:func:`rlhf_sg.packing.one_sequence_per_row_reason`: recurrent layers, ALiBi),
``refused`` with the error when it raised, else ``WRONG``.
"""

from __future__ import annotations

import argparse

import torch

LAYOUTS = ("packed", "shared", "blocks")
#: |Δ| at or below this is float32 rounding
TOLERANCE = 1e-5


def rollout_batch(vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A rollout batch (left-padded prompts, right-padded responses) of 2 prompts x 2 samples, every sequence
    longer than :data:`rlhf_sg.tiny.FAMILY_WINDOW`, two of them short enough to share a packed
    row: (sequences [4, S], attention_mask [4, S], response width)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (5, 7)]
    rows = [(prompts[0], 6), (prompts[0], 3), (prompts[1], 4), (prompts[1], 13)]
    prompt_width, response_width = max(len(p) for p in prompts), max(n for _, n in rows)
    sequences = torch.zeros(len(rows), prompt_width + response_width, dtype=torch.long)
    mask = torch.zeros_like(sequences)
    for b, (prompt, n) in enumerate(rows):
        sequences[b, prompt_width - len(prompt) : prompt_width] = prompt
        sequences[b, prompt_width : prompt_width + n] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, prompt_width - len(prompt) : prompt_width + n] = 1
    return sequences, mask, response_width


def alone(model, sequences: torch.Tensor, mask: torch.Tensor, response_width: int, critic=None):
    """Log-probs, entropy and (with a ``critic``) values [B, T] of each row run alone (its real tokens only)
    through the model's own forward."""
    prompt_width = sequences.shape[1] - response_width
    logp = torch.zeros(sequences.shape[0], response_width)
    entropy = torch.zeros_like(logp)
    rows_logp, rows_entropy, rows_values = [], [], []
    for b in range(sequences.shape[0]):
        real = mask[b].bool()
        ids = sequences[b][real][None]
        start = int((~real[:prompt_width]).sum())  # first real column
        n = int(real[prompt_width:].sum())
        p = prompt_width - start
        logits = model(input_ids=ids, use_cache=False).logits[0, p - 1 : p - 1 + n].float()
        logsm = logits.log_softmax(-1)
        rows_logp.append((b, n, logsm.gather(-1, ids[0, p : p + n, None])[:, 0]))
        rows_entropy.append(-(logsm.exp() * logsm).sum(-1))
        if critic is not None:
            rows_values.append(critic(input_ids=ids, use_cache=False)[0, p - 1 : p - 1 + n].detach())
    values = torch.zeros_like(logp)
    for (b, n, lp), ent, val in zip(rows_logp, rows_entropy, rows_values or [None] * len(rows_logp)):
        index = (torch.tensor([b]), torch.arange(n))
        logp, entropy = logp.index_put(index, lp), entropy.index_put(index, ent)
        if val is not None:
            values = values.index_put(index, val)
    return logp, entropy, values


def _grads(model, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def check_family(family: str) -> dict[str, tuple[str, float, float]]:
    """layout -> (verdict, max |Δlogp|, max |Δ| over log-probs, entropy, values and gradients) for ``family``, and
    ``"block layers"`` -> (the attention calls of one ``blocks`` log-prob forward computed block by block, the
    model's layers, 0)."""
    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.packing import (
        counting_block_layers,
        critic_values,
        one_sequence_per_row_reason,
        response_logprobs,
        use_shared_prompt_attention,
    )
    from rlhf_sg.tiny import tiny_family_model

    model = tiny_family_model(family)
    critic = ValueHeadModel(model.base_model)
    sequences, mask, width = rollout_batch(model.config.vocab_size)
    ref_logp, ref_entropy, ref_values = alone(model, sequences, mask, width, critic)
    ref_grads = _grads(model, ref_logp.sum())
    ref_logp, ref_entropy = ref_logp.detach(), ref_entropy.detach()
    out = {}
    for layout in LAYOUTS:
        shared = layout != "packed"
        if layout == "blocks":
            use_shared_prompt_attention(model)  # the critic's backbone is the model's: switched with it
        try:
            with counting_block_layers() as block_calls:
                logp, entropy = response_logprobs(model, sequences, mask, width, with_entropy=True,
                                                  share_prompts=shared)
            if layout == "blocks":
                out["block layers"] = (str(block_calls[0]), float(model.config.num_hidden_layers), 0.0)
            with torch.no_grad():
                values = critic_values(critic, sequences, mask, width, share_prompts=shared)
        except (ValueError, TypeError) as e:
            out[layout] = (f"refused: {e}", float("nan"), float("nan"))
            continue
        grads = _grads(model, logp.sum())
        delta_logp = float((logp.detach() - ref_logp).abs().max())
        delta = max(delta_logp, float((entropy.detach() - ref_entropy).abs().max()),
                    float((values - ref_values).abs().max()),
                    max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)))
        if delta > TOLERANCE:
            verdict = "WRONG"
        else:
            verdict = "fell back" if one_sequence_per_row_reason(model) else "exact"
        out[layout] = (verdict, delta_logp, delta)
    return out


def main(argv: list[str] | None = None) -> None:
    from rlhf_sg.tiny import FAMILIES

    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench models", description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), help=f"a subset of {', '.join(FAMILIES)}")
    args = parser.parse_args(argv)
    print("max |Δlogp| / max |Δ| over log-probs, entropy, values and gradients, against each row alone")
    print(f"{'family':14s}" + "".join(f"{layout:>34s}" for layout in LAYOUTS) + f"{'block layers':>14s}")
    for family in args.families:
        cells = check_family(family)
        taken, layers, _ = cells.pop("block layers", ("-", 0.0, 0.0))
        print(f"{family:14s}" + "".join(f"{f'{v[:12]} {dl:.1e} / {d:.1e}':>34s}" for v, dl, d in cells.values())
              + f"{f'{taken}/{int(layers)}':>14s}", flush=True)


if __name__ == "__main__":
    main()
