"""Per-model rendering: OpenAI messages to prompt ids with the model's own chat template, and a completion's ids back
to an OpenAI message, tool calls parsed by token id.

One renderer per tool-call format (:func:`renderer_for` picks it from the tokenizer's vocabulary):

* ``hermes``: Qwen2.5 / Qwen3 / Hermes, each call a JSON object ``{"name": ..., "arguments": {...}}`` between the
  ``<tool_call>`` and ``</tool_call>`` tokens;
* ``mistral``: a ``[TOOL_CALLS]`` token followed by a JSON list of such objects, to the end of the turn;
* ``plain``: no tool-call tokens in the vocabulary; a request with ``tools`` is refused.

Calls are found by the ids of those tokens, never by a regex on decoded text: a model (or a user) that writes the
characters ``<tool_call>`` one piece at a time has written text, not a call. A call whose JSON does not parse stays
in the content and is counted (``parse_errors``): a wrong parser fails silently otherwise.

Continuing a conversation (:meth:`Renderer.extend`): the ids of the earlier turns are the ones the engine was given
and sampled, never a re-encoding of their text; only the messages after the last assistant turn are rendered, as the
template's text after that turn's end-of-turn token, and encoded alone (a special token ends every BPE merge, so the
encoding of that text alone is what the whole conversation's encoding holds there).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ParsedTurn", "Renderer", "RenderError", "renderer_for"]


class RenderError(ValueError):
    """The messages or tools cannot be rendered for this model; the message says why (the endpoint answers 400)."""


@dataclass
class ParsedTurn:
    """A completion as an OpenAI assistant message: ``content`` (text outside tool calls, special tokens dropped),
    ``tool_calls`` (OpenAI's format: id, type, function name and arguments as a JSON string), ``parse_errors``
    (tool-call spans whose JSON did not parse; left in the content)."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_errors: int = 0

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def _call(obj: Any) -> dict[str, Any] | None:
    """One parsed tool call in OpenAI's format, or None when ``obj`` is not ``{"name": str, "arguments": ...}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: tool-call arguments as objects (OpenAI sends JSON strings, which
    a template's ``tojson`` would quote again)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", c))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError as e:
                        raise RenderError(f"tool call {fn.get('name')!r}: arguments are not JSON ({e})") from e
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


class Renderer:
    """The ``plain`` renderer: chat template, no tool calls. Subclasses parse their family's calls."""

    name = "plain"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the tokenizer has no chat template: /v1/chat/completions cannot render messages "
                              "(use /v1/completions with a prompt)")
        self.tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids)

    # ---- messages -> ids --------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids of the whole conversation, ending with the template's generation prompt."""
        return self._encode(self.text(messages, tools, generation_prompt=True))

    def text(self, messages, tools=None, generation_prompt: bool = False) -> str:
        if tools and self.name == "plain":
            raise RenderError("tools given, but this model's tokenizer has no tool-call tokens this endpoint can "
                              "parse (<tool_call> or [TOOL_CALLS]); send the request without tools")
        try:
            return self.tokenizer.apply_chat_template(_template_messages(messages), tools=tools or None,
                                                      add_generation_prompt=generation_prompt, tokenize=False)
        except RenderError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's own error (a role it refuses) is the request's fault
            raise RenderError(f"the model's chat template cannot render these messages: {type(e).__name__}: {e}") \
                from e

    def extend(self, messages: list[dict[str, Any]], tools, assistant_at: int, end_id: int) -> list[int] | None:
        """Ids of what follows the assistant turn ``messages[assistant_at]`` (which the engine ended with the
        token ``end_id``): the template's text after that token, through the generation prompt. None when the
        template's text of the turn does not end on that token's text (the caller renders afresh)."""
        before = self.text(messages[: assistant_at + 1], tools)
        after = self.text(messages, tools, generation_prompt=True)
        end = self.tokenizer.convert_ids_to_tokens(end_id)
        if end_id not in self._special or not after.startswith(before) or end not in before:
            return None
        cut = before.rindex(end) + len(end)
        return self._encode(after[cut:])

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- ids -> message ---------------------------------------------------------------------------------------
    def parse(self, ids: list[int]) -> ParsedTurn:
        return ParsedTurn(self._decode(ids).strip())

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self._special], skip_special_tokens=False)


class HermesRenderer(Renderer):
    """Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, found by the two tokens' ids."""

    name = "hermes"

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.open_id, self.close_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))

    def parse(self, ids: list[int]) -> ParsedTurn:
        text, calls, errors = [], [], 0
        i = 0
        while i < len(ids):
            if ids[i] != self.open_id:
                start = i
                while i < len(ids) and ids[i] != self.open_id:
                    i += 1
                text.append(self._decode(ids[start:i]))
                continue
            close = ids.index(self.close_id, i + 1) if self.close_id in ids[i + 1:] else len(ids)
            body = ids[i + 1 : close]
            try:
                call = _call(json.loads(self._decode(body)))
            except json.JSONDecodeError:
                call = None
            if call is None or close == len(ids):
                errors += 1
                text.append(self._decode(ids[i : close + 1]))
            else:
                calls.append(call)
            i = close + 1
        return ParsedTurn("".join(text).strip(), calls, errors)


class MistralRenderer(Renderer):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of calls to the end of the turn, found by that token's id."""

    name = "mistral"

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.open_id = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")

    def parse(self, ids: list[int]) -> ParsedTurn:
        if self.open_id not in ids:
            return ParsedTurn(self._decode(ids).strip())
        at = ids.index(self.open_id)
        content, body = self._decode(ids[:at]).strip(), self._decode(ids[at + 1 :]).strip()
        try:
            objs = json.loads(body)
        except json.JSONDecodeError:
            return ParsedTurn(self._decode(ids).strip(), [], 1)
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(o) for o in objs]
        if not calls or any(c is None for c in calls):
            return ParsedTurn(self._decode(ids).strip(), [], 1)
        return ParsedTurn(content, calls)


def renderer_for(tokenizer) -> Renderer:
    """The renderer of this tokenizer's tool-call format (the module docstring), by its vocabulary."""
    vocab = tokenizer.get_vocab()
    if "<tool_call>" in vocab and "</tool_call>" in vocab:
        return HermesRenderer(tokenizer)
    if "[TOOL_CALLS]" in vocab:
        return MistralRenderer(tokenizer)
    return Renderer(tokenizer)
