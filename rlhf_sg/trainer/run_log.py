"""Where a run's metrics go: ``metrics.jsonl`` in the output directory (one line per step), and
TensorBoard and Weights & Biases when asked for."""

from __future__ import annotations

import json
import os

from rlhf_sg.config import Config


class RunLog:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._file = None
        self._writer = None

    def _open(self) -> None:
        out = self.cfg.log.output_dir
        self._file = open(os.path.join(out, "metrics.jsonl"), "a")
        if self.cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(os.path.join(out, "tensorboard"))
        if self.cfg.log.wandb_project:
            import wandb

            wandb.init(project=self.cfg.log.wandb_project, config=self.cfg.to_dict())

    def resume_at(self, step: int) -> int:
        """A resumed run goes on after ``step``: drop the records of later steps (a run stopped after its
        last checkpoint logged them, and they are about to run again), so each step is logged once. The file
        is replaced atomically. Returns the number of records dropped."""
        from rlhf_sg.trainer.checkpoint import write_atomic

        path = os.path.join(self.cfg.log.output_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            return 0
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by a kill
        if len(kept) != len(lines):
            write_atomic(path, "".join(kept))
        return len(lines) - len(kept)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append step ``step``'s metrics to every sink."""
        if self._file is None:
            self._open()
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._writer is not None:
            for k, v in metrics.items():
                self._writer.add_scalar(k, v, step)
            self._writer.flush()
        if self.cfg.log.wandb_project:
            import wandb

            wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
