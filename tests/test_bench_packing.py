"""``python -m rlhf_sg.bench packing`` on a tiny model: every side computes the same loss, and with groups and sdpa
the blocks side is printed beside the tree mask's."""

from __future__ import annotations

import re

from rlhf_sg.bench import packing


def _run(capsys, *args: str) -> str:
    packing.main(["--size", "tiny", "--batch", "8", "--rounds", "1", "--mix", "rlhf", "--threads", "1", *args])
    return capsys.readouterr().out


def test_the_sides_compute_one_loss_and_the_blocks_are_a_side_of_their_own(capsys):
    out = _run(capsys, "--group-size", "4")
    losses = dict(re.findall(r"(padded|packed|shared|blocks) (-?\d+\.\d+)", out.split("loss ")[1].splitlines()[0]))
    assert set(losses) == {"padded", "packed", "shared", "blocks"}
    assert max(abs(float(v) - float(losses["padded"])) for v in losses.values()) <= 1e-5
    assert re.search(r"ratio blocks / shared: \d+\.\d+x; blocks / packed: \d+\.\d+x", out)


def test_without_groups_or_on_eager_there_is_no_blocks_side(capsys):
    assert "blocks" not in _run(capsys)
    assert "blocks" not in _run(capsys, "--group-size", "4", "--attn", "eager")
