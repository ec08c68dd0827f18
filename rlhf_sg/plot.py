"""Pictures of a run from its ``metrics.jsonl``: reward and KL per step, where each step's time went, and how far each
phase is from the machine's ceiling (the ``perf/*_of_peak`` fractions of :mod:`rlhf_sg.flops`)."""

from __future__ import annotations

import json
import statistics

from rlhf_sg.flops import FRACTIONS
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


def phase_fractions(rows: list[dict]) -> dict[str, list[float | None]]:
    """Per phase that any row has, its fraction of the ceiling in percent per row (None where a row lacks it):
    generation against the memory bandwidth, the FLOP phases against the matmul peak."""
    out = {}
    for key, label in FRACTIONS:
        if any(key in r for r in rows):
            out[label] = [100 * float(r[key]) if key in r else None for r in rows]
    return out


def plot_run(metrics_path: str, png_path: str, title: str = "") -> str:
    """Write a PNG of :func:`run_figure`; returns ``png_path``."""
    import matplotlib.pyplot as plt

    fig = run_figure(metrics_path, title)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def run_figure(metrics_path: str, title: str = ""):
    """A matplotlib Figure (the Agg backend's, open until ``plt.close``): reward, held-out pass@1 (when the run
    evaluated) and KL curves per step (left), stacked phase times per step and the weight-sync share of each step
    (middle), each phase's fraction of the ceiling per step (right; runs logged with ``--perf.accounting``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logged = read_metrics(metrics_path)
    rows = [r for r in logged if "reward/mean" in r]  # training steps (an evaluation before step 1 is a row too)
    evals = [r for r in logged if "eval/pass@1" in r]
    steps = [r["step"] for r in rows]
    # constrained layout fits each panel's titles, labels and the legend beside the bars inside the figure
    fig, (ax_r, ax_t, ax_p) = plt.subplots(1, 3, figsize=(18, 4.5), layout="constrained")
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
        ax_t.set_title(f"time per step, by phase\nweight_sync median {100 * statistics.median(shares):.0f} % of step")
    fractions = phase_fractions(rows)
    for label, values in fractions.items():
        points = [(s, v) for s, v in zip(steps, values) if v is not None]
        ax_p.plot([s for s, _ in points], [v for _, v in points], "o-", label=label)
    ax_p.set_xlabel("step")
    ax_p.set_ylabel("% of the ceiling")
    ax_p.set_title("each phase against the machine\n(FLOPs; generate: bandwidth)" if fractions
                   else "no perf/* metrics in this log")
    if fractions:
        ax_p.set_ylim(0, max(1.0, 1.1 * max(v for vs in fractions.values() for v in vs if v is not None)))
        ax_p.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig
