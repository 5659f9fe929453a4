"""The scripts for a GPU machine (device/) in their CPU `--quick` mode: the prepared full-scale GPU scripts
(TCT's Fashion-MNIST columns, F²L²'s MNIST table) run end to end through the recipes and write their reports,
and gpu_check.py runs every section (its CUDA sections report that they were skipped)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "device"


def test_every_device_script_takes_quick():
    """Every Python script in device/ declares a --quick flag, its CPU smoke run (a static check)."""
    scripts = {p.name: p.read_text() for p in DEVICE.glob("*.py")}
    assert {"gpu_check.py", "gpu_f2l2_mnist.py", "gpu_tct_fmnist_full.py"} <= set(scripts)
    without = [name for name, text in scripts.items() if not re.search(r"add_argument\(\s*[\"']--quick[\"']", text)]
    assert without == [], f"device scripts without --quick: {without}"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, DEVICE / f"{name}.py")
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
    """device/gpu_paper_run.sh with the project already installed and every job in --quick mode: five
    jobs side by side, each one's exit and time in gpu_paper.json, logs and metrics in details.tar.gz."""
    import tarfile

    env = {**os.environ, "GPU_PAPER_INSTALL": "0", "GPU_PAPER_ARGS": "--quick", "GPU_PAPER_DEADLINE": "400",
           "OUT": str(tmp_path / "out"), "GPU_PAPER_WORK": str(tmp_path / "work"), "PATH": os.environ["PATH"]}
    env.pop("HF_FEDTASK_MNIST", None)
    done = subprocess.run(["bash", str(DEVICE / "gpu_paper_run.sh")], env=env, capture_output=True,
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


@pytest.mark.slow
def test_gpu_check_quick_on_the_cpu(tmp_path):
    """device/gpu_check.py --device cpu --quick runs every section end to end (0.5-2 min on 2
    cores): the sections that need CUDA say so, and the strategies' "device" runs, here a second CPU
    run each, equal the first exactly."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OUT", None)
    report = tmp_path / "gpu_check.json"
    out = subprocess.run([sys.executable, str(DEVICE / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--assets", str(tmp_path / "assets"), "--out", str(report)],
                         cwd=DEVICE, env=env, capture_output=True, text=True, timeout=1800)
    print(out.stdout)
    assert out.returncode == 0, f"gpu_check.py exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    sections = json.loads(report.read_text())["sections"]
    assert {name: r["status"] for name, r in sections.items()} == {
        "strategies": "pass", "entk": "pass", "linearize": "pass", "merge": "pass", "qlora": "skipped: no CUDA",
        "main_job": "pass", "pytest_cuda": "skipped: no CUDA"}
    from hf_fedtask.strategies import STRATEGIES

    rows = sections["strategies"]["details"]["rows"]
    assert sorted(rows) == sorted(STRATEGIES)
    assert all(r["checks"]["exact"] and r["checks"]["metric_delta"] == 0 for r in rows.values())
    assert "reloads on the CPU" in rows["fedavg"]["checks"]["reload"]  # a stock PeftModel.from_pretrained
    assert "refused" in rows["ntkfedavg"]["bf16"]  # mixed precision for a linearized strategy: one-line refusal
    assert "refused on the CPU" in sections["qlora"]["summary"]
    for pattern in (r"^RATIO entk/small-cnn-full/digits batched/loop samples per second = (\d+\.\d+)",
                    r"^RATIO linearize/tiny linearized/normal \(sdpa\) step time = (\d+\.\d+)",
                    r"^RATIO merge/cpu peft_ties_time/ties_time = (\d+\.\d+)",
                    r"^section +status +seconds +summary$"):
        assert re.search(pattern, out.stdout, re.MULTILINE), pattern
