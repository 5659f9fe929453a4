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
    assert {"trained", "retrained", "f2l2 difference (λ=10 absolute)"} <= set(rows)
    default = next(name for name in rows if name.startswith("f2l2 (default"))
    assert rows[default]["messages"] == 0 and rows[default]["lambda"] > 0


@pytest.mark.slow
def test_gpu_paper_run_script_quick(tmp_path):
    """benchmarks/gpu_paper_run.sh with the project already installed and every job in --quick mode: five
    jobs side by side, each one's exit and time in gpu_paper.json, logs and metrics in details.tar.gz."""
    import os
    import subprocess
    import tarfile

    env = {**os.environ, "GPU_PAPER_INSTALL": "0", "GPU_PAPER_ARGS": "--quick", "GPU_PAPER_DEADLINE": "400",
           "OUT": str(tmp_path / "out"), "GPU_PAPER_WORK": str(tmp_path / "work"), "PATH": os.environ["PATH"]}
    env.pop("HF_FEDTASK_MNIST", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_paper_run.sh")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "gpu_paper.json").read_text())
    jobs = {job["job"]: job for job in summary["jobs"]}
    assert set(jobs) == {"tct_c1_fedavg", "tct_c1_tct", "tct_a05_fedavg", "tct_a05_tct", "f2l2"}
    assert all(job["exit"] == 0 and "report" in job for job in jobs.values())
    assert set(jobs["tct_c1_tct"]["report"]["columns"]["c1"]["accuracy"]) == {"tct"}
    assert (tmp_path / "out" / "f2l2_backdoor.md").read_text().startswith("**")
    with tarfile.open(tmp_path / "out" / "details.tar.gz") as tar:
        names = tar.getnames()
    assert "f2l2.log" in names and any(name.endswith("metrics.jsonl") for name in names)
