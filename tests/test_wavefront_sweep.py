"""benchmarks/wavefront_sweep.py runs end to end on the tiny checkpoint and reports every field."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import wavefront_sweep


def test_sweep_reports_accuracy_tpf_and_forwards(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    wavefront_sweep.main(["--model-path", str(tiny_model_dir), "--device", "cpu",
                          "--sizes", "1", "2", "--thetas", "0.5", "--num-problems", "4",
                          "--max-new-tokens", "40", "--output", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["wavefront_size"], r["spawn_threshold"]) for r in runs] == [(1, None), (2, 0.5)]
    for r in runs:
        assert 0.0 <= r["exact_match"] <= 1.0
        assert r["tokens_per_forward"] > 0 and r["forwards_per_request_mean"] > 0
        assert r["blocks"] >= 4
