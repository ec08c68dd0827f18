"""TRL's ``GRPOTrainer`` on the e2e bench's work as a user runs it: a plain script, nothing of this project imported.

``python -m rlhf_sg.bench e2e`` runs it by path (``python rlhf_sg/bench/_trl_alone.py SPEC_JSON``) beside its own TRL
side, in the same rounds and with the same setting, and prints how far the bench's TRL side is from it: a ratio
against the bench's TRL side is only a ratio against TRL when the two agree. The bench's TRL side builds its
``GRPOConfig`` from :func:`grpo_config_kwargs` and scores with :func:`digit_reward`, so both run the same trainer on
the same settings; the bench's side adds only its phase timers.

SPEC_JSON: ``model_path``, ``prompt_file`` (JSONL rows with ``prompt``), ``output_dir``, ``samples``,
``max_new_tokens``, ``lr``, ``warmup``, ``steps``, ``threads``, ``seed`` and ``setting`` ([micro_batch,
accumulation, checkpointing, compile], ``compile`` the Trainer's ``torch_compile``). Prints one line,
:data:`RESULT_MARKER` then JSON: each timed step's seconds.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_MARKER = "E2E_TRL_ALONE_RESULT "


def digit_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """The fraction of digit characters in each completion (the bench's reward, in TRL's signature)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def grpo_config_kwargs(spec: dict[str, Any], micro_batch: int, accumulation: int, checkpointing: bool,
                       warmup: int, compile_model: bool = False) -> dict[str, Any]:
    """The bench's ``GRPOConfig``: one generation round of ``micro_batch x accumulation`` completions
    (``steps_per_generation`` defaults to the accumulation), then that many micro-batches and one optimizer step;
    sampling at temperature 1 with no top-p / top-k, no reference model (``beta=0``), float32 on the CPU."""
    return dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=checkpointing,
        num_generations=spec["samples"],
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        use_vllm=False,
        learning_rate=spec["lr"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        max_steps=warmup + spec["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
        torch_compile=compile_model,
    )


def main(argv: list[str] | None = None) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    torch.set_num_threads(spec["threads"])
    # AutoTokenizer would attach Qwen2's pre-tokenizer to the bench's character tokenizer and drop spaces
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32, attn_implementation="sdpa")
    with open(spec["prompt_file"]) as f:
        dataset = Dataset.from_list([{"prompt": json.loads(line)["prompt"]} for line in f if line.strip()])
    micro_batch, accumulation, checkpointing, compile_model = spec["setting"]
    config = GRPOConfig(**grpo_config_kwargs(spec, micro_batch, accumulation, checkpointing, spec["warmup"],
                                             compile_model))
    seconds: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(model=model, reward_funcs=[digit_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    print(RESULT_MARKER + json.dumps({"steps": seconds[spec["warmup"]:]}), flush=True)


if __name__ == "__main__":
    main()
