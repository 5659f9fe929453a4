"""A run killed with SIGKILL mid-flight resumes to the same result as an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def _argv(cfg, output_dir, rounds):
    return [sys.executable, "-m", "hf_fedtask.cli", "run", "--tasks", *cfg.tasks, "--base-model", cfg.base_model,
            "--base-model-id", cfg.base_model_id, "--num-clients", "4", "--rounds", str(rounds), "--batch-size", "8",
            "--local-steps", "3", "--max-length", "16", "--min-samples", "4", "--no-export",
            "--output-dir", str(output_dir)]


def test_sigkill_then_resume_equals_uninterrupted(tiny_config, tmp_path):
    env = {**os.environ}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(_argv(tiny_config, straight, 4), check=True, env=env, capture_output=True)

    proc = subprocess.Popen(_argv(tiny_config, killed, 4), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(metrics.read_text().splitlines())
    assert 2 <= done < 4, "the kill must land mid-run"

    subprocess.run(_argv(tiny_config, killed, 4) + ["--resume"], check=True, env=env, capture_output=True)
    a, b = load_file(straight / "checkpoint.safetensors"), load_file(killed / "checkpoint.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    headers = []
    for path in (straight, killed):
        with safe_open(str(path / "checkpoint.safetensors"), "pt") as f:
            headers.append({k: v for k, v in f.metadata().items() if k != "timings"})  # wall clock apart
    assert headers[0] == headers[1]
    rounds = lambda p: [{k: v for k, v in json.loads(x).items() if k != "seconds"}  # noqa: E731
                        for x in (p / "metrics.jsonl").read_text().splitlines()]
    assert rounds(straight) == rounds(killed)
    assert not list(Path(killed).glob("*.tmp*")) and not list(Path(killed).glob(".*tmp*"))
