"""Every script in benchmarks/ has a `--quick` mode that runs the same measurement small: run each as
a user would (a subprocess, offline) and check it exits 0 and prints its ratio line(s) with usable
numbers. The goals are for the full sizes and are not asserted. merge_bench and simulation_speed (the small
MLP on Fashion-MNIST) take seconds; the others
load the real MiniLM and train it (minutes on a shared box), so they are marked slow. The scripts for a
GPU machine (device/) are tests/test_gpu_paper_scripts.py's."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NUMBER = r"(-?\d+(?:\.\d+)?)"

# script -> the ratio lines --quick must print (regexes whose group 1 is the ratio), and whether it is slow
SCRIPTS = {
    "merge_bench.py": ([rf"^RATIO +{re.escape(name)} +{NUMBER} " for name in (
        "ties_time/floor_time", "unify_time/floor_time", "peft_ties_time/ties_time", "ties_mem/peft_ties_mem",
        "stacked_unify_time/unify_time", "unify_mem/stacked_unify_mem")], False),
    "entk_bench.py": ([rf"^RATIO {name} batched/loop samples per second = {NUMBER} " for name in (
        "small-cnn-full/digits", "minilm-lora/vader_polarity")], False),
    "gauss_newton_bench.py": ([rf"^RATIO {name} matrix-free/jacobian removal time = {NUMBER} " for name in (
        "minilm-probe", "minilm-lora")], True),
    "f2l2_preconditioner.py": ([rf"^RATIO {form} plain/preconditioned removal time = {NUMBER} " for form in (
        "auto", "retained", "difference")], True),
    "f2l2_kept_gram.py": ([rf"^RATIO kept Gram / formed at removal: {NUMBER}$"], True),
    "f2l2_at_optimum.py": ([rf"^WITHIN (?:yes|no) ΔTA \S+ ΔBSR \S+ distance {NUMBER}: F²L² default \(H_s\)$"], True),
    "matu_findings.py": ([rf"^- pairwise sign agreement: {NUMBER}%"], True),
    "matu_start.py": ([rf"^RATIO per_task/unified score \(5 steps, η=0.2\) = {NUMBER}$",
                       rf"^RATIO per_task/unified bytes per round = {NUMBER}$"], False),
    "simulation_speed.py": ([rf"^RATIO mlp-\d+c {path}/plain seconds per round = {NUMBER} "
                             for path in ("trainer", "lean", "batched")], False),
    "hetero_lora.py": ([rf"^RATIO ranks_4_8_16/uniform_r8 mean accuracy = {NUMBER}"], True),
    "main_job_loops.py": ([rf"^RATIO main job lean/trainer seconds per round = {NUMBER} "], True),
    "client_overhead.py": ([rf"^RATIO ours/bare wall time \(median over pairs\) = {NUMBER} "], True),
    "linearize_bench.py": ([rf"^RATIO linearized/normal \(sdpa\) step time +: {NUMBER} ",
                            rf"^RATIO linearized/normal-eager step time +: {NUMBER} "], True),
    "mixed_precision.py": ([rf"^RATIO bf16 fp32_time/bf16_time = {NUMBER} "], True),
    "dp_noise_bench.py": ([rf"^RATIO chacha20/torch_randn time \({n} floats\) = {NUMBER}$" for n in (100000, 1000000)],
                          False),
    "memory_clients.py": ([rf"^RATIO {s} peak\(100\)/peak\(4\) = {NUMBER} .*\[per-client state {NUMBER} MiB x "
                           rf"(\d+) copies vs x (\d+)\]$" for s in ("fedavg", "matfl", "fedper")], True),
}


def test_every_benchmark_script_takes_quick():
    """Every script declares a --quick flag (a static check, so a new script is caught without
    running it); the scripts run below are a subset of what is there."""
    scripts = {p.name: p.read_text() for p in BENCHMARKS.glob("*.py")}
    assert set(SCRIPTS) <= set(scripts)
    without = [name for name, text in scripts.items()
               if not re.search(r"add_argument\(\s*[\"']--quick[\"']", text)]
    assert without == [], f"benchmarks without --quick: {without}"


def _run_quick(script: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"], cwd=BENCHMARKS, env=env,
                         capture_output=True, text=True, timeout=1800)
    print(out.stdout)  # the quick numbers, for `pytest -rP`
    assert out.returncode == 0, f"{script} --quick exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.parametrize("script", [
    pytest.param(name, marks=[pytest.mark.slow] if slow else []) for name, (_, slow) in SCRIPTS.items()])
def test_quick_mode_prints_its_ratios(script):
    stdout = _run_quick(script)
    for pattern in SCRIPTS[script][0]:
        match = re.search(pattern, stdout, re.MULTILINE)
        assert match, f"{script} --quick printed no line matching {pattern!r}:\n{stdout[-3000:]}"
        value = float(match.group(1))
        assert math.isfinite(value) and value > 0, match.group(0)
    if script == "f2l2_at_optimum.py":  # the simulation-only exact Newton step lands on the retrained minimizer
        assert re.search(r"^WITHIN yes ΔTA [+-]0\.0 ΔBSR [+-]0\.0 distance 0\.0\d\d: exact Newton step", stdout,
                         re.MULTILINE), stdout[-3000:]
    if script == "memory_clients.py":
        # by default every client holds its own per-client state: none for FedAvg, 4 vs 100 copies
        # of a non-empty state for MaT-FL (one model per client) and FedPer (personal layers + heads)
        copies = {s: re.search(rf"^RATIO {s} .*x (\d+) copies vs x (\d+)\]$", stdout, re.MULTILINE).groups()
                  for s in ("fedavg", "matfl", "fedper")}
        assert copies == {"fedavg": ("0", "0"), "matfl": ("100", "4"), "fedper": ("100", "4")}
        assert re.search(rf"^RATIO matfl .*per-client state {NUMBER} MiB", stdout, re.MULTILINE).group(1) != "0.000"


def test_client_overhead_quick_on_the_tiny_llama():
    """client_overhead.py's causal-LM mode on the tiny Llama (seconds, mostly imports): one client round
    through LocalTrainer (group_by_length, answer-only loss) against the bare PEFT loop on the same
    batches; the ratio line parses and both took the same steps (same batches, losses and parameters)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "client_overhead.py"), "--quick",
                          "--base-model", "hf-fedtask/tiny-llama"],
                         cwd=BENCHMARKS, env=env, capture_output=True, text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, f"tiny-llama --quick exited {out.returncode}:\n{out.stderr[-3000:]}"
    match = re.search(SCRIPTS["client_overhead.py"][0][0], out.stdout, re.MULTILINE)
    assert match, out.stdout[-3000:]
    assert math.isfinite(float(match.group(1))) and float(match.group(1)) > 0, match.group(0)
    assert re.search(r"^config: hf-fedtask/tiny-llama \(causal LM\) .*group_by_length, answer-only loss, 3 steps",
                     out.stdout, re.MULTILINE), out.stdout[-3000:]
    same = re.search(r"^SAME STEPS ours vs bare: batches identical, .* -> (PASS|FAIL)$", out.stdout, re.MULTILINE)
    assert same and same.group(1) == "PASS", out.stdout[-3000:]
