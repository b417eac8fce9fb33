"""The run report's experts section and chart, with hand numbers."""

from __future__ import annotations

import dataclasses

from reports import plots
from stages.report import experts
from tests.unit.test_study_report import train_result


def moe_train():  # noqa: ANN201
    """Two MoE layers of four experts: one balanced, one sending 3 of every 8 slots to expert 0."""
    return dataclasses.replace(train_result("ddp", 2, 100.0),
                               expert_load={"layers.0.experts": [4, 4, 4, 4], "layers.1.experts": [6, 2, 4, 4]},
                               expert_imbalance=[1.0, 1.5], expert_rank_imbalance={"2": 1.0, "4": 1.25})


def test_the_experts_section_gives_each_layers_busiest_and_idlest_expert_against_the_mean():
    lines = experts(moe_train())
    assert "| layers.0.experts | 4 | 16 | 1.000 | 1.000 |" in lines
    assert "| layers.1.experts | 4 | 16 | 1.500 | 0.500 |" in lines
    text = "\n".join(lines)
    assert "1.000 to 1.500, mean 1.250" in text
    assert "ep=2: 1.000, ep=4: 1.250" in text


def test_the_expert_load_chart_is_drawn_for_a_mixture_of_experts_only(tmp_path):
    assert plots.expert_load(moe_train(), tmp_path / "e.png") == "e.png"
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.expert_load(train_result("ddp", 2, 100.0), tmp_path / "dense.png") is None
    assert not (tmp_path / "dense.png").exists()
