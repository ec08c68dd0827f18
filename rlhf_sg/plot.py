"""Pictures of a run from its ``metrics.jsonl``: reward and KL per step, and where each step's time went."""

from __future__ import annotations

import json
import statistics

from rlhf_sg.timing import PHASES


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sync_share(row: dict) -> float:
    """The share of one step's time spent on weight sync (0 when the row has no step time)."""
    if "perf/weight_sync_share" in row:
        return float(row["perf/weight_sync_share"])
    step = row.get("time/step", 0.0)
    return row.get("time/weight_sync", 0.0) / step if step else 0.0


def plot_run(metrics_path: str, png_path: str, title: str = "") -> str:
    """Write a PNG: reward, held-out pass@1 (when the run evaluated) and KL curves per step (left), stacked
    phase times per step and the weight-sync share of each step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = read_metrics(metrics_path)
    rows = [r for r in logged if "reward/mean" in r]  # training steps (an evaluation before step 1 is a row too)
    evals = [r for r in logged if "eval/pass@1" in r]
    steps = [r["step"] for r in rows]
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_r.plot(steps, [r["reward/mean"] for r in rows], "o-", color="tab:blue", label="mean reward")
    if evals:  # on the reward's axis: both are 0..1 for a 0/1 reward
        ax_r.plot([r["step"] for r in evals], [r["eval/pass@1"] for r in evals], "D-", color="tab:green",
                  label="held-out pass@1")
        ax_r.legend(fontsize=8, loc="lower right")
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("mean reward" + (", held-out pass@1" if evals else ""), color="tab:blue")
    if any("kl" in r for r in rows):
        ax_kl = ax_r.twinx()
        ax_kl.plot(steps, [r.get("kl", 0.0) for r in rows], "s--", color="tab:red", label="KL to reference")
        ax_kl.set_ylabel("KL to reference", color="tab:red")
    ax_r.set_title("reward, held-out pass@1 and KL" if evals else "reward and KL")
    bottom = [0.0] * len(rows)
    for phase in (*PHASES, "other"):
        heights = [r.get(f"time/{phase}", 0.0) for r in rows]
        if any(heights):
            ax_t.bar(steps, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("seconds")
    ax_t.set_title("time per step, by phase")
    ax_t.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.2, 1.0), borderaxespad=0.0)  # beside the bars
    shares = [sync_share(r) for r in rows]
    if any(shares):
        ax_s = ax_t.twinx()  # the cost weight sync exists to keep small, as a share of each step
        ax_s.plot(steps, [100 * s for s in shares], "k.-", linewidth=1, label="weight_sync share")
        ax_s.set_ylabel("weight_sync share of step (%)")
        ax_s.set_ylim(0, max(10.0, 110 * max(shares)))
        ax_t.set_title(f"time per step, by phase; weight_sync median {100 * statistics.median(shares):.0f} % of step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
