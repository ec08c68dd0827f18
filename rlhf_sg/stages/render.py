"""One renderer for every stage: token ids and the loss mask, from provenance.

A row is rendered into ``ids`` and a ``loss_mask`` (True on the tokens the model is trained to write) by knowing
where each token came from, never by searching or slicing rendered text:

* a conversation (chat messages) through the tokenizer's chat template: for each assistant turn ``i`` the
  conversation before it with the generation prompt and the conversation through it are rendered and tokenized
  whole; both must be token prefixes of the whole conversation's ids (a template that renders a turn differently
  once more turns follow is refused, naming the row), and the tokens between them are that turn's. The turn's
  mask ends at its first end-of-turn token (an EOS id, included: the model learns to stop), so template glue after
  it (a newline before the next turn) is not trained on. Every assistant turn of a multi-turn conversation counts;
* a prompt and a completion as plain text (no template): each tokenized alone, the completion's tokens and an EOS
  after them trained on.

A row longer than ``max_len`` is never given an EOS it did not have: it is dropped, refused, or truncated and
marked ``truncated`` (its EOS, if it had one, is then cut off with the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_sg.data import DataError

#: --data.overlong: a row over --data.max_len tokens is dropped (and counted), stops the run naming it, or is cut to
#: max_len and marked truncated (no EOS added)
OVERLONG = ("drop", "error", "truncate")


@dataclass
class Rendered:
    """One rendered row: ``ids`` and ``loss_mask`` of equal length; ``truncated``: cut at ``max_len``."""

    ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False

    @property
    def prompt_len(self) -> int:
        """Tokens before the first trained token (the packed rows' prompt block)."""
        return self.loss_mask.index(True)

    @property
    def last_response_index(self) -> int:
        """Column of the last trained token: where a reward model reads its score."""
        return len(self.loss_mask) - 1 - self.loss_mask[::-1].index(True)


def eos_ids(tokenizer, model_path: str | None = None) -> set[int]:
    """Every id that ends a turn: the tokenizer's EOS and those of the model's ``generation_config.json``."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_path:
        import json
        import os

        path = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return ids


def _tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_ids(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # a template's own checks (roles it refuses, ...) raise what they like
        raise DataError(f"{where}: the chat template fails on this conversation ({type(e).__name__}: {e})") from None
    return _tokens(tokenizer, text)


def render_messages(tokenizer, messages: list[dict], eos: set[int], where: str) -> Rendered:
    """``messages`` (role / content dicts, one or more assistant turns) through the chat template; see the module
    doc. ``where`` names the row in errors (``file line N``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat messages need a tokenizer with a chat template; this one has none (give "
                        "prompt / completion strings with --data.apply_chat_template false, or a model whose "
                        "tokenizer has a template)")
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise DataError(f"{where}: no assistant message, so nothing to train on (roles: "
                        f"{[m.get('role') for m in messages]})")
    if turns[0] == 0:
        raise DataError(f"{where}: the conversation opens with an assistant turn; a row needs a prompt (a system or "
                        "user message) before the first assistant turn")
    whole = _template_ids(tokenizer, messages, False, where)
    mask = [False] * len(whole)
    for i in turns:
        before = _template_ids(tokenizer, messages[:i], True, where)
        through = _template_ids(tokenizer, messages[: i + 1], False, where)
        for part, name in ((before, "before"), (through, "through")):
            if whole[: len(part)] != part:
                raise DataError(f"{where}: the chat template renders the conversation {name} assistant turn {i} "
                                "differently once later turns follow (its tokens are not a prefix of the whole "
                                "conversation's), so the turn's tokens cannot be told apart; render such rows "
                                "yourself as prompt / completion strings")
        if len(through) <= len(before):
            raise DataError(f"{where}: assistant turn {i} renders to no tokens of its own")
        end = len(through)
        for k in range(len(before), len(through)):
            if whole[k] in eos:
                end = k + 1
                break
        mask[len(before) : end] = [True] * (end - len(before))
    return Rendered(whole, mask)


def render_text(tokenizer, prompt: str, completion: str, eos: set[int], where: str,
                append_eos: bool = True) -> Rendered:
    """A plain prompt and completion: each tokenized alone; the completion (and ``tokenizer.eos_token_id`` after it,
    with ``append_eos``) is trained on."""
    p, c = _tokens(tokenizer, prompt), _tokens(tokenizer, completion)
    if not p:
        raise DataError(f"{where}: the prompt gives no tokens; a row needs a prompt before its completion")
    if append_eos:
        if tokenizer.eos_token_id is None:
            raise DataError(f"{where}: the tokenizer has no EOS token to end the completion with; set "
                            "--data.append_eos false or give the tokenizer one")
        c = c + [int(tokenizer.eos_token_id)]
    if not c:
        raise DataError(f"{where}: the completion gives no tokens; give it text or drop the row")
    return Rendered(p + c, [False] * len(p) + [True] * len(c))


def fit(row: Rendered, max_len: int, overlong: str, where: str) -> Rendered | None:
    """``row`` within ``max_len`` tokens: as it is, or (over it) None for ``drop``, a DataError for ``error``, or its
    first ``max_len`` tokens marked truncated for ``truncate`` (None if no trained token is left). No EOS is added."""
    if len(row.ids) <= max_len:
        return row
    if overlong == "error":
        raise DataError(f"{where}: {len(row.ids)} tokens, over --data.max_len {max_len}; raise it, or set "
                        "--data.overlong drop (skip such rows) or truncate (cut them, marked)")
    if overlong == "drop":
        return None
    cut = Rendered(row.ids[:max_len], row.loss_mask[:max_len], truncated=True)
    return cut if any(cut.loss_mask) else None
