"""Built-in verifiable rewards (``--reward.function math_answer`` etc.) on hand cases, and pass@k's reference values.

Each math case is a (label, completion, score) a user's reward would meet: equivalent forms that must match, near
misses that must not, and the formats that trip users (LaTeX fractions, trailing units, several boxed answers).
"""

import importlib.util
import math
import threading

import pytest

from rlhf_sg.config import Config, ConfigError, validate
from rlhf_sg.evaluation import pass_at_k
from rlhf_sg.rewards import RewardError, load_reward_function
from rlhf_sg.verifiable import exact_match, final_answer, math_answer, normalize_answer, think_format

needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason='math-verify is not installed (pip install -e ".[math]")')

MATH_CASES = [
    # equivalent forms
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 1.0),
    ("\\frac{1}{2}", "half of it: 1/2", 1.0),
    ("0.5", "$\\dfrac{1}{2}$", 1.0),
    ("12", "The answer is 12.", 1.0),
    ("12", "12 apples", 1.0),  # trailing units
    ("12", "\\boxed{12\\text{ apples}}", 1.0),
    ("12", "first 7, then 5 more: 12", 1.0),  # the last number is the answer
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
    ("1,000", "\\boxed{1000}", 1.0),
    # near misses
    ("\\frac{1}{2}", "\\boxed{0.51}", 0.0),
    ("12", "13", 0.0),
    ("12", "12 then 13", 0.0),
    ("4", "\\boxed{3} or maybe \\boxed{4}", 0.0),  # several boxed answers are a set: hedging earns nothing
    ("12", "I do not know", 0.0),
    ("12", "", 0.0),
]


@needs_math_verify
@pytest.mark.parametrize("label,completion,score", MATH_CASES)
def test_math_answer_hand_cases(label, completion, score):
    assert math_answer(["q"], [completion], [label]) == [score]


@needs_math_verify
def test_math_answer_runs_in_a_worker_thread():
    """The trainer calls reward functions from a worker thread, where math-verify's signal-based timeouts raise;
    the built-in runs without them."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("scores", math_answer(["q"] * 2, ["\\boxed{3}", "4"],
                                                                                    ["3", "3"])))
    thread.start()
    thread.join(60)
    assert out["scores"] == [1.0, 0.0]


def test_math_answer_without_a_label_names_the_flag():
    with pytest.raises(ValueError, match="--data.label_key"):
        math_answer(["q"], ["1"], [None])


@pytest.mark.parametrize("completion,label,score", [
    ("Natalia sold 48 clips in April.\n#### 72", "72", 1.0),  # GSM8K's marker
    ("#### 1,234", "1234", 1.0),  # thousands commas
    ("The capital:\nParis.", "paris", 1.0),  # the last line; case and the trailing period
    ("work...\n\nanswer:   New   York", "answer: new york", 1.0),  # the last line, whitespace collapsed
    ("so \\boxed{42}", "42", 1.0),
    ("#### 72\n", "27", 0.0),
    ("#### 7.2", "72", 0.0),
    ("the capital is Lyon", "paris", 0.0),
])
def test_exact_match_hand_cases(completion, label, score):
    assert exact_match(["q"], [completion], [label]) == [score]


def test_final_answer_takes_the_last_marker_or_box():
    assert final_answer("#### 1 ... #### 2") == " 2"
    assert final_answer("\\boxed{1} then \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert normalize_answer("  $1,000,000.  ") == "1000000"


@pytest.mark.parametrize("completion,score", [
    ("<think>7 + 5 = 12</think> 12", 1.0),
    ("  <think>\nlong\nthought\n</think>\n\\boxed{12}", 1.0),
    ("<think>no answer after it</think>   ", 0.0),
    ("12 <think>late</think>", 0.0),
    ("<think>unclosed 12", 0.0),
])
def test_think_format_hand_cases(completion, score):
    assert think_format(["q"], [completion], [None]) == [score]


@needs_math_verify
def test_rewards_are_chosen_by_name_and_summed_with_weights():
    assert load_reward_function("math_answer") is math_answer
    mixed = load_reward_function("math_answer=0.9,think_format=0.1")
    scores = mixed(["q"] * 3, ["<think>x</think> \\boxed{3}", "\\boxed{3}", "<think>x</think> 4"], ["3"] * 3)
    assert scores == pytest.approx([1.0, 0.9, 0.1])
    # a module:function part sits beside the built-ins
    with_module = load_reward_function("exact_match=1,rlhf_sg.verifiable:think_format=0.5")
    assert with_module(["q"], ["<think>a</think>\nb"], ["b"]) == pytest.approx([1.5])


@pytest.mark.parametrize("spec,message", [
    ("math_answer=heavy", "weight 'heavy' of 'math_answer' is not a number"),
    ("math_answr=1", "'math_answr' is neither a built-in"),
    ("math_answer,think_format=1", "part 'math_answer' must be NAME=WEIGHT"),
])
def test_a_bad_reward_spec_is_named(spec, message):
    with pytest.raises(RewardError, match=message):
        load_reward_function(spec)


def test_validate_takes_a_built_in_name_and_refuses_a_bare_unknown_word(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    from rlhf_sg.tiny import save_tiny_model

    cfg = Config()
    cfg.data.prompt_data, cfg.model.pretrain = str(prompts), save_tiny_model(str(tmp_path / "m"))
    for spec in ("math_answer", "math_answer=0.9,think_format=0.1"):
        cfg.reward.function = spec
        validate(cfg)
    cfg.reward.function = "mathanswer"
    with pytest.raises(ConfigError, match="name a built-in reward"):
        validate(cfg)


# ---- pass@k ------------------------------------------------------------------------------------------------------
def _reference_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: 1 - C(n-c, k) / C(n, k), with exact integers."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_reference_values():
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert all(pass_at_k(10, 0, k) == 0.0 for k in range(1, 11))


@pytest.mark.parametrize("n", [1, 2, 5, 16, 64])
def test_pass_at_k_is_the_definition_and_monotone_in_k(n):
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == pytest.approx([_reference_pass_at_k(n, c, k) for k in range(1, n + 1)], abs=1e-12)
        assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
        assert values[0] == pytest.approx(c / n)  # pass@1 is the fraction correct


def test_pass_at_k_of_large_n_does_not_overflow():
    assert 0.0 < pass_at_k(2000, 3, 100) < 1.0


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


@needs_math_verify
def test_the_word_problem_recipe_holds_out_a_tenth_and_math_answer_scores_its_worked_answers(tmp_path):
    """``recipes/word_problems.py``'s data: the held-out problems are disjoint from the training ones (a tenth of
    them), the config reads both, and the built-in ``math_answer`` gives every worked answer ("3+4=7") 1 and the
    same worked answer with a wrong result 0, so the run's reward is the task's."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    import word_problems

    train_file, held_out, train_rows = word_problems.write_files(str(tmp_path))
    train = [json.loads(line) for line in open(train_file)]
    test = [json.loads(line) for line in open(held_out)]
    assert len(test) == len(word_problems.problems()) // 10 and len(train) + len(test) == len(word_problems.problems())
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    worked = [r["worked"] for r in train_rows[:60]]  # sums and differences alike (math-verify takes ~10 ms each)
    labels = [r["answer"] for r in train_rows[:60]]
    assert math_answer([""] * len(worked), worked, labels) == [1.0] * len(worked)
    wrong = [w.rsplit("=", 1)[0] + "=" + str(int(a) + 1) for w, a in zip(worked, labels)]
    assert math_answer([""] * len(wrong), wrong, labels) == [0.0] * len(wrong)
    cfg = word_problems.make_config(str(tmp_path), train_file, held_out, str(tmp_path / "out"), steps=2)
    assert (cfg.reward.function, cfg.eval.prompt_data, cfg.data.label_key) == ("math_answer", held_out, "answer")
