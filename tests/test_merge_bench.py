"""Smoke test of benchmarks/merge_bench.py at a tiny size: it runs and its ratios are usable numbers
(the timing and memory goals are for the full size and are not asserted here)."""

import importlib.util
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_bench.py"


def test_merge_bench_returns_finite_positive_ratios(capsys):
    spec = importlib.util.spec_from_file_location("merge_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ratios = bench.main(["--n", "3", "--d", "5000", "--repeat", "1"])
    names = {name for ours in ("ties", "unify") for name in (f"{ours}/floor", f"peft/{ours}", f"{ours}_mem/peft_mem")}
    assert set(ratios) == names
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    out = capsys.readouterr().out
    assert "max |ties - peft ties|" in out and "peft/ties" in out
