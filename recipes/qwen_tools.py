"""Tool calls in Qwen2.5's chat format: the calculator of ``calc_task.py`` behind ``<tool_call>`` JSON.

A model turn ends on ``<|im_end|>`` (Qwen's end of turn, one of its EOS ids): that token is the turn's last sampled
token (mask 1). A turn that holds a tool call is answered the way Qwen2.5's chat template renders a tool result,
and everything the template puts after the model's ``<|im_end|>`` belongs to the observation (mask 0)::

    prompt       <|im_start|>user\\nWhat is 417*38?<|im_end|>\\n<|im_start|>assistant\\n
    model        <tool_call>\\n{"name": "calculator", "arguments": {"expression": "417*38"}}\\n</tool_call><|im_end|>
    observation  \\n<|im_start|>user\\n<tool_response>\\n15846\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    model        The answer is 15846.<|im_end|>                                            (no tool call: done)

A turn without a tool call is the final answer and ends the trajectory. A call that is not JSON, names no known
tool or does not fit its arguments is answered with an error in the same ``<tool_response>`` block (and counted by
the loop). With ``--agent.stop_token_ids`` set to ``</tool_call>``'s id a turn may end there instead; the
observation then starts with the ``<|im_end|>`` the model did not write.

    rlhf-sg train-ppo --model.pretrain Qwen/Qwen2.5-0.5B-Instruct --data.apply_chat_template true \\
        --agent.env qwen_tools:make_env --agent.max_turns 3 --agent.max_turn_tokens 128 ...   (recipes/ on PYTHONPATH)

``rlhf_sg.tiny.build_chat_tokenizer()`` builds a local byte-level BPE tokenizer in this format (the tests use it).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re

from rlhf_sg.agent import Environment, StepResult, ToolError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
END_OF_TURN = "<|im_end|>"
_OPS = {ast.Mult: operator.mul, ast.Add: operator.add, ast.Sub: operator.sub}


def calculator(expression: str) -> int:
    """``a*b``, ``a+b`` or ``a-b`` of two integers, as ``calc_task.calculate``: parsed with ``ast``, never ``eval``
    (that module is not imported: it sets up a CPU run)."""
    try:
        tree = ast.parse(str(expression), mode="eval").body
    except SyntaxError as e:
        raise ToolError("malformed", f"cannot parse {expression!r}") from e
    if not (isinstance(tree, ast.BinOp) and type(tree.op) in _OPS
            and all(isinstance(x, ast.Constant) and type(x.value) is int for x in (tree.left, tree.right))):
        raise ToolError("malformed", f"{expression!r} is not INT*INT, INT+INT or INT-INT")
    if max(abs(tree.left.value), abs(tree.right.value)) >= 10**6:
        raise ToolError("malformed", "operands too large")
    return _OPS[type(tree.op)](tree.left.value, tree.right.value)


#: the tools a model may call, by name
TOOLS = {"calculator": calculator}


def parse_tool_call(body: str) -> tuple[str, dict]:
    """The (name, arguments) of one ``<tool_call>`` body, ``{"name": ..., "arguments": {...}}``; ToolError
    ``malformed`` otherwise."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolError("malformed", f"the tool call is not JSON ({e.msg} at character {e.pos})") from e
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        raise ToolError("malformed", 'a tool call is {"name": NAME, "arguments": {...}}')
    return call["name"], call["arguments"]


class QwenToolEnv(Environment):
    """One trajectory: each ``<tool_call>`` of a turn is run and its result answered in Qwen2.5's format."""

    tools = TOOLS

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if end is None or end == tokenizer.unk_token_id:
            raise ValueError(f"qwen_tools: the tokenizer has no {END_OF_TURN} token; use a Qwen2 / Qwen2.5 / Qwen3 "
                             "tokenizer (or rlhf_sg.tiny.build_chat_tokenizer())")
        self.end_id = end
        self.turn_closed = True  # the last turn ended on <|im_end|>

    def reset(self, prompt) -> None:
        self.calls = 0
        self.turn_closed = True

    def step(self, turn_ids, turn_text, finish_reason):
        self.turn_closed = bool(turn_ids) and turn_ids[-1] == self.end_id
        bodies = TOOL_CALL.findall(turn_text)
        if finish_reason != "stop" or not bodies:
            return StepResult(done=True)  # the final answer (or a turn the budget cut)
        self.calls += len(bodies)
        return StepResult(observation_ids=self.tool_responses([self.call(b) for b in bodies]), tool_call=True)

    def call(self, body: str) -> str:
        name, arguments = parse_tool_call(body)
        tool = self.tools.get(name)
        if tool is None:
            raise ToolError("unknown_tool", f"no tool {name!r}; tools: {', '.join(sorted(self.tools))}")
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as e:
            raise ToolError("malformed", f"{name}: {e}") from e
        return str(tool(**arguments))

    def tool_responses(self, results: list[str]) -> list[int]:
        """The observation: the template's glue after the model's ``<|im_end|>`` (its ``\\n``; ``<|im_end|>\\n`` when
        the turn ended on another stop token), one user turn of ``<tool_response>`` blocks, the next assistant
        header."""
        glue = "\n" if self.turn_closed else END_OF_TURN + "\n"
        blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
        return self.encode(f"{glue}<|im_start|>user{blocks}{END_OF_TURN}\n<|im_start|>assistant\n")

    def error_observation(self, kind: str, message: str) -> list[int]:
        return self.tool_responses([f"error ({kind}): {message}"])


def make_env(tokenizer) -> QwenToolEnv:
    """``--agent.env qwen_tools:make_env``: one environment per trajectory."""
    return QwenToolEnv(tokenizer)
