"""The docs' generated tables are the benchmarks' results rendered, not hand-edited: each generated block equals what
benchmarks/doc_tables.py renders from the committed results file, and the scores it prints are its points'."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    path = ROOT / "benchmarks" / "doc_tables.py"
    spec = importlib.util.spec_from_file_location("doc_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_tables"] = module
    spec.loader.exec_module(module)
    return module


def test_the_pages_are_the_results_rendered():
    tables = _tables()
    for block in tables.BLOCKS:
        assert block.generated() == block.rendered(), (
            f"{block.page.relative_to(ROOT)}'s generated block differs from {block.results.relative_to(ROOT)} "
            "rendered: run `python benchmarks/doc_tables.py --write` (never edit a block by hand)"
        )


def test_the_scores_read_the_points():
    tables = _tables()
    results = {
        "command": "python benchmarks/predict_accuracy.py",
        "versions": {"tensorflow": "2.21.0", "keras": "3.15.1", "cores": 2},
        "minutes": 1.0,
        "anchor": 32,
        "models": [
            {
                "model": "m",
                "style": "arrays",
                "budget": 200,
                "runs": {"64": [100, 104], "128": [200, 200]},
                "cells": [
                    {
                        "analytic": {"64": 130, "128": 190},
                        "analytic band": {"64": 0.3, "128": 0.3},
                        "analytic named": None,
                        "calibrated": {"64": 101, "128": 210},
                        "calibrated band": {"64": 0.15, "128": 0.15},
                        "calibrated basis": "replay (2 probes)",
                        "calibrated named": 64,
                    }
                ],
                "named runs": {"64": [100, 104]},
                "named tf": {"64": [90, 94]},
                "grown": {"64": [100, 104], "128": [200, 200]},
            }
        ],
    }
    points = {(p.basis, p.batch): p for p in tables.points(results)}
    assert round(points["analytic", 64].error, 3) == 0.275  # 130 against the median 102
    assert points["analytic", 64].covered and not points["analytic", 64].over_peak
    assert points["analytic", 128].over_peak and not points["analytic", 128].over_band  # 200 > 190, < 247
    assert not points["calibrated", 128].over_peak
    named = {a.basis: a for a in tables.named(results)}
    assert named["analytic"].used == 0.0 and named["calibrated"].used == 0.51 and not named["calibrated"].over
    block = tables.render(results)
    assert "| m | arrays | 2 | 4% |" in block and "none fits: 0%" in block and "64: 51%" in block
