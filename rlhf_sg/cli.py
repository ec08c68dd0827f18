"""``rlhf-sg``: the command line.

    rlhf-sg train-ppo --model PATH --prompt-data FILE --backend sglang [--config run.yaml] [--section.key V ...]
    rlhf-sg backends          list rollout backends and whether each can load here
    rlhf-sg bench NAME ...    run a benchmark (same as python -m rlhf_sg.bench NAME)
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
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
    elif command == "backends":
        from backends import available_backends

        for name, status in available_backends().items():
            print(f"{name:12s} {status}")
    elif command == "bench":
        from rlhf_sg.bench.__main__ import main as bench_main

        bench_main(rest)
    else:
        raise SystemExit(f"rlhf-sg: unknown command {command!r}; use train-ppo, backends or bench (see --help)")


if __name__ == "__main__":
    main()
