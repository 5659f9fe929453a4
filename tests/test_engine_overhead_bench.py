"""Smoke test of benchmarks/engine_overhead.py: its quick form, restricted to the in-process engine and
the in-process Flower Grid, runs as a script and prints its ratio line and JSON line (the timing goal
is for the full size on a quiet machine and is not asserted here)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_overhead.py"


@pytest.mark.slow  # a benchmark's smoke run, as the other MiniLM benchmarks' (tests/test_benchmarks_quick.py)
def test_engine_overhead_quick_prints_the_grid_ratio(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--engines", "inprocess,grid", "--workdir",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"^load average at start: [\d.]+ [\d.]+ [\d.]+", out, re.M)
    assert re.search(r"^load average at end: [\d.]+ [\d.]+ [\d.]+", out, re.M)
    line = re.search(r"^ratios \(median of 1\): grid/in-process (\d+\.\d+) \(goal <= 1\.15; CPU time (\d+\.\d+)\)$",
                     out, re.M)
    assert line, out[-3000:]
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in line.groups())
    result = json.loads(out.strip().splitlines()[-1])
    assert result["benchmark"] == "engine_overhead" and result["engines"] == ["inprocess", "grid"]
    assert set(result["ratios_median"]) == {"grid/inprocess", "grid/inprocess cpu"}
    assert result["deployment_startup_s"] is None  # no SuperLink was started
