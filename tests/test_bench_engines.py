"""The engines bench's summary and the quickstart plot's weight-sync share, on hand-written metrics rows."""

from __future__ import annotations

import json

import pytest

from rlhf_sg.bench.engines import format_table, phase_medians
from rlhf_sg.plot import phase_fractions, plot_run, sync_share


def _rows(sync_s: float, step_s: float = 1.0, n: int = 6) -> list[dict]:
    # step 1 is a slow start-up step the medians must leave out
    return [
        {"step": i, "time/step": step_s * (10 if i == 1 else 1), "time/generate": 0.2, "time/weight_sync": sync_s}
        for i in range(1, n + 1)
    ]


def test_phase_medians_skip_the_start_and_give_the_sync_share():
    medians = phase_medians(_rows(sync_s=0.3), skip=1)
    assert medians["steps"] == 5
    assert medians["step"] == pytest.approx(1.0)
    assert medians["weight_sync"] == pytest.approx(0.3)
    assert medians["share"] == pytest.approx(0.3)


def test_table_puts_backends_side_by_side_with_ratios_to_the_first():
    table = format_table({"hf": phase_medians(_rows(0.03), 1), "sglang": phase_medians(_rows(0.3), 1)})
    header, hf, sglang = table.splitlines()
    assert "sync share" in header and "sync x" in header
    assert hf.split()[0] == "hf" and "3.0%" in hf
    assert sglang.split()[0] == "sglang" and "30.0%" in sglang
    assert float(sglang.split()[-1]) == pytest.approx(10.0)  # weight_sync, sglang over hf


def test_plot_shows_the_sync_share(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        dict(r, **{"reward/mean": 0.5, "perf/weight_sync_share": r["time/weight_sync"] / r["time/step"]})
        for r in _rows(0.1)
    ]
    assert sync_share(rows[1]) == pytest.approx(0.1)
    assert sync_share({"time/step": 2.0, "time/weight_sync": 0.5}) == pytest.approx(0.25)  # logs from before the key
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_run(str(metrics), str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 0 and png.endswith("run.png")


def test_plot_shows_each_phases_fraction_of_the_ceiling(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": 1, "reward/mean": 0.5, "time/step": 2.0, "perf/train_of_peak": 0.42,
             "perf/generate_of_roofline": 0.05},
            {"step": 2, "reward/mean": 0.6, "time/step": 2.0, "perf/train_of_peak": 0.5}]
    assert phase_fractions(rows) == {"generate (roofline)": [5.0, None], "train": [42.0, 50.0]}
    assert phase_fractions([{"step": 1}]) == {}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run(str(metrics), str(tmp_path / "run.png")).endswith("run.png")
    assert (tmp_path / "run.png").stat().st_size > 0


def _quickstart_rows(steps: int = 40) -> list[dict]:
    """Metrics rows as the quickstart logs them: an evaluation before step 1 and every 10 steps, every phase's
    time, the weight-sync share and each phase's fraction of the ceiling."""
    from rlhf_sg.flops import FRACTIONS
    from rlhf_sg.timing import PHASES

    rows = [{"step": 0, "eval/pass@1": 0.2, "eval/greedy_accuracy": 0.2}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": 0.3 + 0.01 * s, "kl": 0.001 * s, "time/step": 2.0, "time/other": 0.1,
               "perf/weight_sync_share": 0.05, **{f"time/{p}": 0.2 for p in PHASES},
               **{key: 0.01 * (s % 7 + 1) for key, _ in FRACTIONS}}
        if s % 10 == 0:
            row["eval/pass@1"] = 0.3 + 0.01 * s
        rows.append(row)
    return rows


def test_every_text_of_the_quickstart_plot_lies_inside_the_figure(tmp_path, monkeypatch):
    """Every title, label, tick label and legend entry drawn lies inside the figure (the right panel's title ran
    past the figure's right edge)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from rlhf_sg.plot import run_figure

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _quickstart_rows()))
    fig = run_figure(str(metrics), title="gae on single-digit addition, backend hf, sync rollout")
    drawn = []  # the texts a draw renders (tick labels outside the axis' view are kept but not drawn)
    draw = Text.draw

    def recording_draw(self, renderer):
        draw(self, renderer)
        if self.get_visible() and self.get_text():
            drawn.append((self.get_text(), self.get_window_extent(renderer)))

    monkeypatch.setattr(Text, "draw", recording_draw)
    try:
        fig.canvas.draw()
    finally:
        plt.close(fig)
    width, height = fig.bbox.width, fig.bbox.height
    outside = [(text, box.bounds) for text, box in drawn
               if box.x0 < 0 or box.y0 < 0 or box.x1 > width or box.y1 > height]
    assert len(drawn) > 50 and not outside, (outside, (width, height))
