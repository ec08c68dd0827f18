"""Prompt datasets: JSONL, Parquet or a ``datasets`` directory -> token-id prompts, in a resumable order."""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

from rlhf_sg.config import OVERLONG_PROMPTS, ConfigError

__all__ = ["DataError", "Prompt", "PromptStream", "load_prompts"]

log = logging.getLogger("rlhf_sg")

#: the row key that lists a prompt's images (rlhf_sg.vision); a text model's prompts have none
IMAGE_KEY = "images"
#: files a model directory's tokenizer is made from (or a *.tiktoken file)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


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
    if not os.path.exists(path):
        raise DataError(f"--data.prompt_data: {path!r} does not exist; give a JSONL / Parquet file or a "
                        "datasets directory")
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError as e:
            raise DataError(f"{path}: a directory needs the `datasets` package (pip install datasets)") from e
        try:
            ds = datasets.load_from_disk(path)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: not a dataset saved with datasets' save_to_disk ({e}); give a JSONL / "
                            "Parquet file or such a directory") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {list(ds)})")
            ds = ds["train"]
        return list(ds), "row"
    if path.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), "row"
        except (OSError, pyarrow.ArrowException) as e:
            raise DataError(f"{path}: cannot read it as Parquet ({e})") from None
    if path.endswith((".jsonl", ".json")):
        rows: list[Any] = []
        try:
            with open(path, "rb") as f:  # decoded line by line, so a bad byte is reported on its own line
                for line_no, raw_line in enumerate(f, start=1):
                    try:
                        line = raw_line.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(f"{path} line {line_no}: not UTF-8 text ({e.reason} at column {e.start + 1});"
                                        " save the file as UTF-8") from None
                    if not line.strip():
                        rows.append(None)
                        continue
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        rows.append(DataError(f"{path} line {line_no}: not valid JSON ({e.msg} at column {e.colno}); "
                                              "each line must be one JSON object (JSONL)"))
                    except RecursionError:
                        rows.append(DataError(f"{path} line {line_no}: JSON nested too deeply"))
        except OSError as e:
            raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
        return rows, "line"
    raise DataError(f"{path}: unknown format; use .jsonl, .parquet or a datasets directory")


def load_tokenizer(path: str, flag: str = "--model.pretrain"):
    """The model's tokenizer. A plain ``tokenizer.json`` saved as PreTrainedTokenizerFast is loaded as
    such: AutoTokenizer would attach the architecture's own pre-tokenizer to it (and a character-level
    tokenizer would silently lose its spaces). A directory without a loadable tokenizer is a ConfigError
    naming it and ``flag``, the setting that named the directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # without these transformers may build an empty tokenizer from config.json alone, and every prompt would
    # encode to nothing
    files = os.listdir(path) if os.path.isdir(path) else []
    if not any(f in TOKENIZER_FILES or f.endswith(".tiktoken") for f in files):
        raise ConfigError(f"{flag}: {path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "save the tokenizer next to the model (tokenizer.save_pretrained)")
    try:
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                if json.load(f).get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend"):
                    return PreTrainedTokenizerFast.from_pretrained(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{flag}: no tokenizer loads from {path!r} ({type(e).__name__}: {e}); save the "
                          "tokenizer next to the model (tokenizer.save_pretrained) or point at a directory that "
                          "has one") from None


def load_run_prompts(cfg, path: str, tokenizer) -> tuple[list[Prompt], int]:
    """A run's prompt file ``path`` read with the run's ``--data.*`` settings: (prompts, rows skipped). A
    vision-language ``--model.pretrain`` reads it with the model's processor
    (:func:`rlhf_sg.vision.load_vision_prompts`: each prompt's ids and images from one processor call); a text model
    with ``tokenizer``."""
    from rlhf_sg.config import is_vision_language

    d = cfg.data
    if is_vision_language(cfg.model.pretrain):
        from rlhf_sg.vision import load_processor, load_vision_prompts

        model_config, processor = load_processor(cfg.model.pretrain)
        return load_vision_prompts(
            path, model_config, processor, input_key=d.input_key, label_key=d.label_key, image_key=d.image_key,
            apply_chat_template=d.apply_chat_template, max_prompt_len=d.max_prompt_len,
            overlong_prompts=d.overlong_prompts, allow_urls=d.allow_image_urls, skip_bad_rows=d.skip_bad_rows)
    return load_prompts(path, tokenizer, input_key=d.input_key, label_key=d.label_key,
                        apply_chat_template=d.apply_chat_template, max_prompt_len=d.max_prompt_len,
                        skip_bad_rows=d.skip_bad_rows, overlong_prompts=d.overlong_prompts)


def load_prompts(
    path: str,
    tokenizer,
    input_key: str = "prompt",
    label_key: str | None = None,
    apply_chat_template: bool = False,
    max_prompt_len: int = 1024,
    skip_bad_rows: bool = False,
    overlong_prompts: str = "error",
) -> tuple[list[Prompt], int]:
    """Read and tokenise every prompt; returns (prompts, number of malformed rows skipped).

    A malformed row (bad JSON, missing key, empty prompt) raises DataError naming the file and row, unless
    ``skip_bad_rows``, which skips and counts it. A prompt over ``max_prompt_len`` tokens is such an error
    too (``overlong_prompts="error"``), unless ``overlong_prompts`` is ``"drop"`` (left out) or
    ``"truncate"`` (its last ``max_prompt_len`` tokens kept); how many were dropped or truncated is logged.
    """
    if overlong_prompts not in OVERLONG_PROMPTS:
        raise DataError(f"--data.overlong_prompts must be one of {list(OVERLONG_PROMPTS)}, got {overlong_prompts!r}")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        model = getattr(tokenizer, "name_or_path", "") or "the model"
        raise DataError(f"--data.apply_chat_template is on but the tokenizer of {model!r} has no chat template; "
                        "turn the flag off (prompts are then used as written) or use a model whose "
                        "tokenizer_config.json has a chat_template")
    rows, unit = _read_rows(path)
    first = 1 if unit == "line" else 0
    prompts: list[Prompt] = []
    skipped = dropped = truncated = 0
    for i, raw in enumerate(rows, start=first):
        if raw is None:  # blank JSONL line
            continue
        try:
            prompt = _make_prompt(raw, path, unit, i, tokenizer, input_key, label_key, apply_chat_template)
            if len(prompt.token_ids) > max_prompt_len:
                if overlong_prompts == "drop":
                    dropped += 1
                    continue
                if overlong_prompts == "truncate":
                    prompt.token_ids = prompt.token_ids[-max_prompt_len:]
                    prompt.text = tokenizer.decode(prompt.token_ids)
                    truncated += 1
                else:
                    raise DataError(
                        f"{path} {unit} {i}: prompt is {len(prompt.token_ids)} tokens, over --data.max_prompt_len "
                        f"{max_prompt_len}; raise it, or set --data.overlong_prompts drop (or truncate), or "
                        "--data.skip_bad_rows")
            prompts.append(prompt)
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
    if dropped:
        log.warning("%s: dropped %d prompts longer than --data.max_prompt_len %d (--data.overlong_prompts drop)",
                    path, dropped, max_prompt_len)
    if truncated:
        log.warning("%s: truncated %d prompts to their last %d tokens (--data.max_prompt_len, "
                    "--data.overlong_prompts truncate)", path, truncated, max_prompt_len)
    if not prompts:
        if not skipped and not dropped:
            raise DataError(f"{path}: no prompts in it (the file is empty); give one row per prompt with key "
                            f"{input_key!r}")
        raise DataError(f"{path}: no usable prompt ({skipped} bad rows skipped with --data.skip_bad_rows, "
                        f"{dropped} over --data.max_prompt_len {max_prompt_len} dropped); fix the rows or the flags")
    return prompts, skipped


def _messages_ok(content: Any) -> bool:
    return bool(content) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in content
    )


def check_prompt_row(raw, where: str, input_key: str, label_key: str | None) -> None:
    """A prompt row is an object with the input key (and the label key when one is set); raises DataError naming
    ``where`` and the flag to set, or re-raises the row's own read error."""
    if isinstance(raw, DataError):
        raise raw
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with key {input_key!r}, got {type(raw).__name__}")
    if input_key not in raw:
        raise DataError(f"{where}: key {input_key!r} missing (keys: {', '.join(map(str, raw))}); set --data.input_key")
    if label_key is not None and label_key not in raw:
        raise DataError(f"{where}: key {label_key!r} missing (keys: {', '.join(map(str, raw))}); set --data.label_key")


def _make_prompt(raw, path, unit, i, tokenizer, input_key, label_key, apply_chat_template) -> Prompt:
    where = f"{path} {unit} {i}"
    check_prompt_row(raw, where, input_key, label_key)
    if raw.get(IMAGE_KEY):  # these prompts are a text model's: its tokenizer would take the images' markers as text
        raise DataError(f"{where}: the row has images ({IMAGE_KEY!r}) but the model is text-only; use a "
                        "vision-language model (rlhf_sg.vision) or drop the images")
    content = raw[input_key]
    if isinstance(content, str) and not content.strip() or isinstance(content, list) and not content:
        raise DataError(f"{where}: {input_key!r} is empty; give it text, or drop the row (or --data.skip_bad_rows)")
    if apply_chat_template:
        if isinstance(content, str):
            messages = [{"role": "user", "content": content}]
        elif isinstance(content, list) and _messages_ok(content):
            messages = content
        else:
            raise DataError(f"{where}: with --data.apply_chat_template, {input_key!r} must be a string or a list of "
                            f'{{"role": ..., "content": ...}} messages (got {str(content)[:80]!r})')
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template's own checks (roles it refuses, ...) raise what they like
            raise DataError(f"{where}: the chat template of {getattr(tokenizer, 'name_or_path', '')!r} fails on "
                            f"this row ({type(e).__name__}: {e})") from None
    else:
        if not isinstance(content, str):
            raise DataError(f"{where}: {input_key!r} must be a string (got {type(content).__name__}); "
                            "set --data.apply_chat_template for message lists")
        text = content
    try:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception as e:  # the tokenizer library's own error (e.g. text it cannot encode)
        raise DataError(f"{where}: the tokenizer cannot encode this prompt ({type(e).__name__}: {e})") from None
    if not ids:
        raise DataError(f"{where}: {input_key!r} gives no tokens; give it text, or drop the row "
                        "(or --data.skip_bad_rows)")
    return Prompt(token_ids=ids, text=text, label=raw.get(label_key) if label_key else None, row=i)


class PromptStream:
    """Batches of prompts in a seeded, resumable order: epoch e uses permutation seed + e.

    ``state()`` / ``load_state()`` capture the exact position, so a resumed run gets the batch
    that would have come next.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > len(prompts):
            raise DataError(f"--rollout.prompts_per_step {batch_size} is larger than the dataset ({len(prompts)} "
                            "usable prompts); lower it or add prompts")
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
