"""A stage's rows: read (JSONL / Parquet / a datasets directory), checked row by row with the file and row named,
rendered (:mod:`rlhf_sg.stages.render`) and fitted to ``--data.max_len``, all before any model loads."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from rlhf_sg.data import DataError, _messages_ok, _read_rows
from rlhf_sg.stages.render import Rendered, fit, render_messages, render_text


@dataclass
class StageRows:
    """A stage's rendered data. ``rows``: SFT rows, or for pairs chosen, rejected, chosen, ... (pair ``i`` is rows
    ``2i`` and ``2i + 1``); ``margins``: a margin per pair (reward models; None: none); ``source_rows``: each unit's
    row in its file; ``dropped`` / ``truncated``: units over ``--data.max_len`` dropped, or cut and marked."""

    rows: list[Rendered]
    pairs: bool
    margins: list[float] | None = None
    source_rows: list[int] | None = None
    dropped: int = 0
    truncated: int = 0

    @property
    def num_units(self) -> int:
        """Rows (SFT) or pairs."""
        return len(self.rows) // 2 if self.pairs else len(self.rows)

    def unit_rows(self, unit: int) -> list[int]:
        return [2 * unit, 2 * unit + 1] if self.pairs else [unit]

    def select(self, units: list[int]) -> StageRows:
        return StageRows([self.rows[r] for u in units for r in self.unit_rows(u)], self.pairs,
                         None if self.margins is None else [self.margins[u] for u in units],
                         None if self.source_rows is None else [self.source_rows[u] for u in units])

    def fingerprint(self) -> str:
        """SHA-256 of every row's ids, loss mask and truncation mark, in order: what the rows are, whatever
        file, template or settings gave them."""
        h = hashlib.sha256()
        for row in self.rows:
            h.update(repr((row.ids, row.loss_mask, row.truncated)).encode())
        return h.hexdigest()


def _as_messages(value: Any, role: str, apply_chat_template: bool, where: str, key: str) -> list[dict] | None:
    """``value`` as a message list (a string becomes one ``role`` turn with the chat template), or None for a plain
    string without it."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {key!r} is empty; give it text, or drop the row")
        return [{"role": role, "content": value}] if apply_chat_template else None
    if isinstance(value, list) and _messages_ok(value):
        return value
    raise DataError(f"{where}: {key!r} must be a string or a list of {{\"role\": ..., \"content\": ...}} messages "
                    f"(got {str(value)[:80]!r})")


def _need_keys(raw: Any, keys: list[str], where: str, flags: dict[str, str]) -> None:
    if isinstance(raw, DataError):
        raise raw
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in keys:
        if key not in raw:
            raise DataError(f"{where}: key {key!r} missing (keys: {', '.join(map(str, raw))}); set "
                            f"{flags.get(key, '--data.*_key')}")


def render_sft_row(raw: Any, where: str, tokenizer, eos: set[int], d) -> Rendered:
    """One SFT row: ``d.messages_key`` (a conversation), or ``d.prompt_key`` and ``d.completion_key``."""
    flags = {d.messages_key: "--data.messages_key", d.prompt_key: "--data.prompt_key",
             d.completion_key: "--data.completion_key"}
    if isinstance(raw, dict) and d.messages_key in raw:
        messages = raw[d.messages_key]
        if not (isinstance(messages, list) and _messages_ok(messages)):
            raise DataError(f"{where}: {d.messages_key!r} must be a list of {{\"role\": ..., \"content\": ...}} "
                            f"messages (got {str(messages)[:80]!r})")
        return render_messages(tokenizer, messages, eos, where)
    _need_keys(raw, [d.prompt_key, d.completion_key], where, flags)
    prompt = _as_messages(raw[d.prompt_key], "user", d.apply_chat_template, where, d.prompt_key)
    completion = _as_messages(raw[d.completion_key], "assistant", d.apply_chat_template, where, d.completion_key)
    if prompt is None and completion is None:
        return render_text(tokenizer, raw[d.prompt_key], raw[d.completion_key], eos, where, d.append_eos)
    if prompt is None or completion is None:
        raise DataError(f"{where}: one of {d.prompt_key!r} / {d.completion_key!r} is a message list and the other "
                        "plain text; give both as messages, or strings with --data.apply_chat_template")
    return render_messages(tokenizer, prompt + completion, eos, where)


def render_pair(raw: Any, where: str, tokenizer, eos: set[int], d) -> tuple[Rendered, Rendered, float | None]:
    """One preference row: chosen and rejected (strings, or message lists: the completion's turns after the prompt,
    or whole conversations when there is no ``d.prompt_key``), and the margin (``d.margin_key``)."""
    flags = {d.chosen_key: "--data.chosen_key", d.rejected_key: "--data.rejected_key",
             d.prompt_key: "--data.prompt_key", d.margin_key: "--data.margin_key"}
    _need_keys(raw, [d.chosen_key, d.rejected_key] + ([d.margin_key] if d.margin_key else []), where, flags)
    margin = None
    if d.margin_key:
        margin = raw[d.margin_key]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
            raise DataError(f"{where}: {d.margin_key!r} must be a number, got {margin!r}")
        margin = float(margin)
    prompt = raw.get(d.prompt_key)
    out = []
    for key in (d.chosen_key, d.rejected_key):
        value = raw[key]
        if prompt is None:
            if not (isinstance(value, list) and _messages_ok(value)):
                raise DataError(f"{where}: no {d.prompt_key!r}, so {key!r} must be a whole conversation (a list of "
                                f"messages ending in the assistant's turn); got {str(value)[:80]!r}; or set "
                                "--data.prompt_key")
            out.append(render_messages(tokenizer, value, eos, where + f" ({key})"))
            continue
        p = _as_messages(prompt, "user", d.apply_chat_template, where, d.prompt_key)
        c = _as_messages(value, "assistant", d.apply_chat_template, where, key)
        if p is None and c is None:
            out.append(render_text(tokenizer, prompt, value, eos, where + f" ({key})", d.append_eos))
        elif p is None or c is None:
            raise DataError(f"{where}: {d.prompt_key!r} and {key!r} mix a message list and plain text; give both as "
                            "messages, or strings with --data.apply_chat_template")
        else:
            out.append(render_messages(tokenizer, p + c, eos, where + f" ({key})"))
    if out[0].ids == out[1].ids:
        raise DataError(f"{where}: chosen and rejected render to the same tokens; a pair must differ")
    return out[0], out[1], margin


def load_stage_rows(path: str, stage: str, tokenizer, eos: set[int], d, flag: str = "--data.train_data"
                    ) -> StageRows:
    """Every row of ``path`` rendered for ``stage`` ("sft": rows; "rm" / "dpo": pairs) and fitted to
    ``d.max_len`` (:func:`rlhf_sg.stages.render.fit`; a pair is dropped or kept whole). Raises DataError naming the
    file and row of the first bad row, or when no row is left."""
    try:
        raws, unit = _read_rows(path)
    except DataError as e:
        raise DataError(f"{flag}: {e}") from None
    pairs = stage != "sft"
    rows, margins, sources, dropped, truncated = [], [], [], 0, 0
    for i, raw in enumerate(raws, start=1 if unit == "line" else 0):
        if raw is None:
            continue  # a blank JSONL line
        where = f"{path} {unit} {i}"
        if pairs:
            chosen, rejected, margin = render_pair(raw, where, tokenizer, eos, d)
            fitted = [fit(chosen, d.max_len, d.overlong, where + " (chosen)"),
                      fit(rejected, d.max_len, d.overlong, where + " (rejected)")]
            margins.append(0.0 if margin is None else margin)
        else:
            fitted = [fit(render_sft_row(raw, where, tokenizer, eos, d), d.max_len, d.overlong, where)]
        if any(r is None for r in fitted):
            dropped += 1
            if pairs:
                margins.pop()
            continue
        truncated += any(r.truncated for r in fitted)
        rows += fitted
        sources.append(i)
    if not rows:
        raise DataError(f"{path}: no usable row ({dropped} over --data.max_len {d.max_len} dropped); raise "
                        "--data.max_len or set --data.overlong truncate")
    return StageRows(rows, pairs, margins if pairs and d.margin_key else None, sources, dropped, truncated)


def split_held_out(data: StageRows, fraction: float, seed: int) -> tuple[StageRows, StageRows | None]:
    """``fraction`` of the units held out (a seeded draw, at least one when fraction > 0), and the rest."""
    if fraction <= 0:
        return data, None
    units = list(range(data.num_units))
    random.Random(seed).shuffle(units)
    k = max(1, round(fraction * len(units)))
    if k >= len(units):
        raise DataError(f"--data.eval_fraction {fraction} holds out every one of the {len(units)} rows; lower it")
    held, kept = sorted(units[:k]), sorted(units[k:])
    train, held_out = data.select(kept), data.select(held)
    train.dropped, train.truncated = data.dropped, data.truncated
    return train, held_out
