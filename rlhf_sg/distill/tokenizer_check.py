"""On-policy distillation's pre-flight check: the teacher must read the policy's token ids as the policy does.

The teacher scores the token ids the policy sampled (``--distill.teacher``), so both models need one tokenizer:
the same vocabulary (token -> id), the same special tokens, and the same padded vocabulary size (the rows of the
embedding and the output head, ``vocab_size`` in config.json: a log-softmax over other rows is another
distribution, and one family's sizes differ, e.g. 152064 and 151936). :func:`check_teacher` runs in
:func:`rlhf_sg.config.validate`, before Ray starts. The per-token advantage itself is
:func:`rlhf_sg.algorithms.distill_advantages`.
"""

from __future__ import annotations

import json
import os

from rlhf_sg.config import ConfigError

__all__ = ["check_teacher", "tokenizer_differences"]

#: the special tokens compared by id
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def padded_vocab_size(path: str) -> int | None:
    """``vocab_size`` of the model directory's config.json (its text part for a multimodal model): the rows of its
    embedding and output head."""
    from backends.checkpoint_names import text_config

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        size = getattr(text_config(json.load(f)), "vocab_size", None)
    return None if size is None else int(size)


def tokenizer_differences(student, teacher, student_vocab_size: int | None,
                          teacher_vocab_size: int | None, other: str = "teacher") -> list[str]:
    """What differs between two tokenizers and padded vocabulary sizes, one phrase each (empty: they agree):
    the vocabulary (token -> id), the ids of :data:`SPECIAL_TOKENS` and the special ids, the padded size.
    ``other``: what the phrases call the second model (the teacher; DPO's reference)."""
    diffs = []
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        differing = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        first = differing[0]
        where = "the policy's" if first in a.items() else f"the {other}'s"
        diffs.append(f"vocabulary: {len(a)} tokens in the policy's, {len(b)} in the {other}'s, "
                     f"{len(set(a.items()) ^ set(b.items()))} (token, id) pairs in one only (first: {first[0]!r} -> "
                     f"{first[1]} in {where} only)")
    for name in SPECIAL_TOKENS:
        x, y = getattr(student, name, None), getattr(teacher, name, None)
        if x != y:
            diffs.append(f"{name}: {x} in the policy's, {y} in the {other}'s")
    xs, ys = sorted(set(student.all_special_ids)), sorted(set(teacher.all_special_ids))
    if xs != ys:
        diffs.append(f"special token ids: {xs} in the policy's, {ys} in the {other}'s")
    if student_vocab_size != teacher_vocab_size:
        diffs.append(f"padded vocab size (config.json vocab_size, the embedding's rows): {student_vocab_size} in the "
                     f"policy's, {teacher_vocab_size} in the {other}'s")
    return diffs


def check_teacher(student_path: str, teacher_path: str) -> None:
    """Raise a ConfigError naming ``--distill.teacher``, its path and what differs unless the teacher's tokenizer and
    padded vocabulary size are the policy's (``--model.pretrain``)."""
    from rlhf_sg.data import load_tokenizer

    student = load_tokenizer(student_path)
    teacher = load_tokenizer(teacher_path, flag="--distill.teacher")
    diffs = tokenizer_differences(student, teacher, padded_vocab_size(student_path), padded_vocab_size(teacher_path))
    if diffs:
        raise ConfigError(
            f"--distill.teacher: {teacher_path!r} does not share the tokenizer of --model.pretrain {student_path!r}: "
            f"{'; '.join(diffs)}. The teacher scores the policy's sampled token ids, so both need one tokenizer and "
            "one padded vocabulary size: choose a teacher saved with the policy's tokenizer and vocab_size")
