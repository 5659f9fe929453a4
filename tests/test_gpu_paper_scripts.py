"""The prepared full-scale GPU scripts (TCT's Fashion-MNIST columns, F²L²'s MNIST table) in their CPU
`--quick` mode: they run end to end through the recipes and write their reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tct_full_scale_script_quick(tmp_path):
    assert _script("gpu_tct_fmnist_full").main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tct_fmnist_full.json").read_text())
    assert set(report["columns"]) == {"c1", "a05"}
    for column in report["columns"].values():
        assert column["exit"] == 0 and set(column["accuracy"]) == {"fedavg", "tct"}
        assert all(0 <= acc <= 100 for acc in column["accuracy"].values())


@pytest.mark.slow
def test_f2l2_mnist_script_quick(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_FEDTASK_MNIST", raising=False)
    script = _script("gpu_f2l2_mnist")
    assert script.main(["--quick", "--dataset", "mnist", "--out", str(tmp_path / "refused")]) == 2
    assert script.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "f2l2_mnist.json").read_text())
    assert report["exit"] == 0 and report["task"] in ("fashion_mnist", "digits") and report["data"]
    rows = report["table"]["rows"]
    assert {"trained", "retrained", "f2l2 (λ=10 absolute)"} <= set(rows)
    default = next(name for name in rows if name.startswith("f2l2 (default"))
    assert rows[default]["messages"] == 0 and rows[default]["lambda"] > 0
