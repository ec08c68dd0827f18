"""``rlhf-sg``: the command line.

    rlhf-sg train-ppo --model PATH --prompt-data FILE --backend sglang [--config run.yaml] [--section.key V ...]
    rlhf-sg eval --model DIR --data FILE --eval.reward_function NAME [--backend B] [--eval.n_samples N ...]
                              held-out evaluation of a saved model (pass@k, greedy accuracy), printed as a table
    rlhf-sg train-sft --model PATH --data FILE [--config stage.yaml] [--section.key V ...]   supervised fine-tuning
    rlhf-sg train-rm --model PATH --data PAIRS [...]   a reward model (loads as train-ppo's --reward.kind model)
    rlhf-sg train-dpo --model PATH --data PAIRS [...]  DPO / IPO against a frozen reference (rlhf_sg.stages)
    rlhf-sg backends          list rollout backends and whether each can load here
    rlhf-sg bench NAME ...    run a benchmark (same as python -m rlhf_sg.bench NAME)
"""

from __future__ import annotations

import logging
import os
import sys

COMMANDS = ("train-ppo", "train-sft", "train-rm", "train-dpo", "eval", "backends", "bench")
HELP = ("-h", "--help")


def _print_eval_help() -> None:
    """``rlhf-sg eval``'s flags: ``--data`` and every trainer setting (the evaluation runs as during training)."""
    from rlhf_sg.config import build_parser

    parser = build_parser("rlhf-sg eval")
    parser.usage = ("rlhf-sg eval --model DIR --data FILE --eval.reward_function NAME [--backend B] "
                    "[--section.key V ...]")
    parser.description = ("Held-out evaluation of a saved model (pass@k, greedy accuracy), printed as a table. Every "
                          "setting of rlhf-sg train-ppo applies; the eval section says how to sample and score.")
    parser.add_argument("--data", metavar="FILE", help="the held-out prompts (JSONL / Parquet, the training data's "
                        "formats); required")
    parser.print_help()


def _train_stage(command: str, rest: list[str]) -> None:
    """``rlhf-sg train-sft | train-rm | train-dpo``: bad flags, model directories and data rows stop the run with the
    message alone (exit status 1), before any model loads."""
    from rlhf_sg.config import ConfigError
    from rlhf_sg.data import DataError
    from rlhf_sg.stages import parse_stage_args
    from rlhf_sg.stages.run import run_stage

    stage = command.removeprefix("train-")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = parse_stage_args(stage, rest)
        run_stage(cfg)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"rlhf-sg {command}: {e}") from None
    print(f"logs, checkpoints and the exported model are in {cfg.log.output_dir}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in HELP:
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "train-ppo":
        from rlhf_sg.config import ConfigError, check_devices, check_gpu_install, parse_args
        from rlhf_sg.data import DataError
        from rlhf_sg.rewards import RewardError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # bad input (flags, YAML, devices, model and tokenizer, prompt file, reward function) stops the run
        # with the message alone and exit status 1; the data is read before Ray or any model starts
        try:
            cfg = parse_args(rest)
            check_devices(cfg)
            check_gpu_install(cfg)
            from rlhf_sg.trainer import train

            train(cfg)
        except (ConfigError, DataError, RewardError) as e:
            raise SystemExit(f"rlhf-sg train-ppo: {e}") from None
        print(f"logs, checkpoints and the exported policy are in {cfg.log.output_dir}")
    elif command in ("train-sft", "train-rm", "train-dpo"):
        _train_stage(command, rest)
    elif command == "eval" and any(a in HELP for a in rest):  # before the check that --data is given
        _print_eval_help()
    elif command == "eval":
        from rlhf_sg.config import ConfigError, check_devices, check_gpu_install, parse_args
        from rlhf_sg.data import DataError
        from rlhf_sg.evaluation import eval_argv, evaluate_model, format_table
        from rlhf_sg.rewards import RewardError

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        try:
            if not any(a.split("=", 1)[0] in ("--data", "--eval.prompt_data") for a in rest):
                raise ConfigError("--data FILE is required: the held-out prompts (JSONL / Parquet, the training "
                                  "data's formats) to evaluate on")
            argv = eval_argv(rest)
            data = argv[argv.index("--eval.prompt_data") + 1] if "--eval.prompt_data" in argv else None
            if data is not None and not os.path.exists(data):
                raise ConfigError(f"--data: {data!r} does not exist; give the held-out prompt file (JSONL / Parquet)")
            cfg = parse_args(argv)
            check_devices(cfg)
            check_gpu_install(cfg)
            metrics = evaluate_model(cfg)
        except (ConfigError, DataError, RewardError) as e:
            raise SystemExit(f"rlhf-sg eval: {e}") from None
        print(f"\nevaluation of {cfg.model.pretrain} on {cfg.eval.prompt_data}:\n{format_table(metrics)}")
        print(f"samples: {os.path.join(cfg.log.output_dir, 'eval', 'step0.jsonl')}")
    elif command == "backends" and any(a in HELP for a in rest):
        print("usage: rlhf-sg backends\n\nList the rollout backends and whether each can load here.")
    elif command == "backends":
        from backends import available_backends

        for name, status in available_backends().items():
            print(f"{name:12s} {status}")
    elif command == "bench":
        from rlhf_sg.bench.__main__ import main as bench_main

        bench_main(rest)
    else:
        raise SystemExit(f"rlhf-sg: unknown command {command!r}; use one of {', '.join(COMMANDS)} (see --help)")


if __name__ == "__main__":
    main()
