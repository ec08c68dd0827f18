"""Prompt datasets: JSONL, Parquet or a ``datasets`` directory -> token-id prompts, in a resumable order."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["DataError", "Prompt", "PromptStream", "load_prompts"]


class DataError(ValueError):
    """A prompt file or row is malformed; the message names the file, the row and what to do."""


@dataclass
class Prompt:
    token_ids: list[int]
    text: str
    label: Any = None
    row: int = -1  # row number in the source file (1-based for JSONL lines, 0-based for tables)


def _read_rows(path: str) -> tuple[list[Any], str]:
    """Raw rows and how to name a row in errors ("line" for JSONL, "row" for tables)."""
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError as e:
            raise DataError(f"{path}: a directory needs the `datasets` package (pip install datasets)") from e
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {list(ds)})")
            ds = ds["train"]
        return list(ds), "row"
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist(), "row"
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    rows.append(None)
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    rows.append(DataError(f"{path} line {line_no}: not valid JSON ({e.msg} at column {e.colno})"))
        return rows, "line"
    raise DataError(f"{path}: unknown format; use .jsonl, .parquet or a datasets directory")


def load_tokenizer(path: str):
    """The model's tokenizer. A plain ``tokenizer.json`` saved as PreTrainedTokenizerFast is loaded as
    such: AutoTokenizer would attach the architecture's own pre-tokenizer to it (and a character-level
    tokenizer would silently lose its spaces)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            if json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_prompts(
    path: str,
    tokenizer,
    input_key: str = "prompt",
    label_key: str | None = None,
    apply_chat_template: bool = False,
    max_prompt_len: int = 1024,
    skip_bad_rows: bool = False,
) -> tuple[list[Prompt], int]:
    """Read and tokenise every prompt; returns (prompts, number of rows skipped).

    A malformed row (bad JSON, missing key, empty or over-long prompt) raises DataError naming
    the file and row, unless ``skip_bad_rows``, which skips and counts it. Nothing is truncated.
    """
    rows, unit = _read_rows(path)
    first = 1 if unit == "line" else 0
    prompts: list[Prompt] = []
    skipped = 0
    for i, raw in enumerate(rows, start=first):
        if raw is None:  # blank JSONL line
            continue
        try:
            prompts.append(
                _make_prompt(raw, path, unit, i, tokenizer, input_key, label_key, apply_chat_template, max_prompt_len)
            )
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if not prompts:
        raise DataError(f"{path}: no usable prompt ({skipped} bad rows skipped)")
    return prompts, skipped


def _make_prompt(raw, path, unit, i, tokenizer, input_key, label_key, apply_chat_template, max_prompt_len) -> Prompt:
    where = f"{path} {unit} {i}"
    if isinstance(raw, DataError):
        raise raw
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with key {input_key!r}, got {type(raw).__name__}")
    if input_key not in raw:
        raise DataError(f"{where}: key {input_key!r} missing (keys: {', '.join(raw)}); set --data.input_key")
    if label_key is not None and label_key not in raw:
        raise DataError(f"{where}: key {label_key!r} missing (keys: {', '.join(raw)}); set --data.label_key")
    content = raw[input_key]
    if apply_chat_template:
        messages = content if isinstance(content, list) else [{"role": "user", "content": str(content)}]
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{where}: --data.apply_chat_template is on but the tokenizer has no chat template")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        if not isinstance(content, str):
            raise DataError(f"{where}: {input_key!r} must be a string (got {type(content).__name__}); "
                            "set --data.apply_chat_template for message lists")
        text = content
    if not text:
        raise DataError(f"{where}: {input_key!r} is empty")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_len:
        raise DataError(f"{where}: prompt is {len(ids)} tokens, over --data.max_prompt_len {max_prompt_len}; "
                        "raise it or use --data.skip_bad_rows")
    return Prompt(token_ids=ids, text=text, label=raw.get(label_key) if label_key else None, row=i)


class PromptStream:
    """Batches of prompts in a seeded, resumable order: epoch e uses permutation seed + e.

    ``state()`` / ``load_state()`` capture the exact position, so a resumed run gets the batch
    that would have come next.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > len(prompts):
            raise DataError(f"prompts_per_step {batch_size} is larger than the dataset ({len(prompts)} prompts)")
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Prompt]:
        if self.position + self.batch_size > len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.prompts[i] for i in idx]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state(self, state: dict[str, int]) -> None:
        if state.get("seed") != self.seed:
            raise DataError(f"resume: checkpoint data seed {state.get('seed')} differs from --train.seed {self.seed}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
