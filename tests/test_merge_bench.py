"""Smoke test of benchmarks/merge_bench.py at a tiny size: it runs, compares like with like (our
ties with peft's ties, our streaming unify with a plain stacked unify whose output it checks equal)
and its ratios are usable numbers (the timing and memory goals are for the full size and are not
asserted here)."""

import importlib.util
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_bench.py"
RATIOS = {"ties_time/floor_time", "unify_time/floor_time", "peft_ties_time/ties_time", "ties_mem/peft_ties_mem",
          "ties_select_time/floor_time", "ties_model_time/floor_time", "ties_torch_time/ties_time",
          "unify_torch_time/unify_time", "model_select_radix_time/model_select_time",
          "stacked_unify_time/unify_time", "unify_mem/stacked_unify_mem", "mean_time/floor_time",
          "mean_stream_time/floor_time", "agreement_time/floor_time", "mean_torch_time/mean_time",
          "mean_torch_time/mean_stream_time", "agreement_torch_time/agreement_time",
          "output_mem/peft_ties_mem", "ties_work_mem/peft_ties_work_mem"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("merge_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_bench_returns_finite_positive_ratios(bench, capsys):
    ratios = bench.main(["--n", "3", "--d", "5000", "--repeat", "1"])
    assert set(ratios) == RATIOS
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    out = capsys.readouterr().out
    assert "max |ties - peft_ties|" in out and "unify == stacked_unify" in out
    assert "mean, mean_stream == mean_torch" in out
    for name in RATIOS:  # every ratio is printed under its unambiguous name
        assert f"RATIO {name} " in " ".join(out.split()), name
    assert "peft/unify" not in out and "peft_ties_time/unify_time" not in out  # no unlike-with-like row


def test_stacked_unify_is_unify(bench):
    """The stacked reference computes unify's math: same vector, masks and rescalers, also where
    tasks tie to a zero sum (sign 0) and on the 8-tensor layout with unaligned offsets."""
    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.merge import unify

    vectors = bench.make_inputs(5, 4000, seed=3)
    vectors.append(TaskVector({k: -v for k, v in vectors[0].items()}))  # τ_0 + τ_5 = 0 everywhere
    ours, reference = unify(vectors), bench.stacked_unify(vectors)
    assert bench.check_unify_matches_stacked(ours, reference, len(vectors)) <= 1e-6

    broken = (reference[0], reference[1].clone(), reference[2])
    broken[1][2, 7] = ~broken[1][2, 7]
    with pytest.raises(SystemExit, match="task 2's mask"):
        bench.check_unify_matches_stacked(ours, broken, len(vectors))
    with pytest.raises(SystemExit, match="rescalers"):
        bench.check_unify_matches_stacked(ours, (reference[0], reference[1], reference[2] * 1.01), len(vectors))
    with pytest.raises(SystemExit, match="unified vector"):
        bench.check_unify_matches_stacked(ours, (reference[0] + 1, *reference[1:]), len(vectors))
    assert not (reference[1][0] & reference[1][5]).any()  # opposite tasks never both agree

    opposite = [vectors[1], TaskVector({k: -v for k, v in vectors[1].items()})]  # Σ = 0: sign 0 everywhere
    ours, reference = unify(opposite), bench.stacked_unify(opposite)
    bench.check_unify_matches_stacked(ours, reference, 2)
    assert not reference[0].any() and not reference[1].any() and reference[2].tolist() == ours.rescalers == [0.0, 0.0]


def test_measure_times_the_paired_floor_right_before_each_call(bench):
    """Ratios against the floor divide by floors timed in alternation with the method."""
    calls = []
    seconds, _, result, floor_seconds = bench.measure(lambda: calls.append("method") or 7, 3,
                                                      paired=lambda: calls.append("floor"))
    assert calls == ["floor", "method"] * 3 and result == 7
    assert 0 <= floor_seconds < math.inf and 0 <= seconds < math.inf
    assert bench.measure(lambda: None, 2)[3] == math.inf  # nothing paired: no floor time
