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
          "output_mem/peft_ties_mem", "ties_work_mem/peft_ties_work_mem", "peft_ties_time/ties_batched_time",
          "ties_batched_time/ties_time", "stacked_unify_time/unify_batched_time",
          "peft_task_arithmetic_time/task_arithmetic_batched_time"}


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
    assert "ties_batched == ties, task_arithmetic_batched == task_arithmetic (bit for bit)" in out
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


def test_check_batched_refuses_a_batched_result_that_differs(bench):
    """The bench's equality gate before its batched ratios: equal outputs pass, one changed entry of
    ties, task arithmetic or a mask, or a rescaler off by 1e-5, voids the comparison."""
    from hf_fedtask.merge import task_arithmetic, ties, unify

    vectors, weights = bench.make_inputs(3, 3000, seed=1), [0.5, 1.0, 1.5]
    keys = list(vectors[0])
    outputs = {"ties": ties(vectors, weights, 0.2), "ties_batched": ties(vectors, weights, 0.2, backend="batched"),
               "task_arithmetic": task_arithmetic(vectors, weights, backend="torch"),
               "task_arithmetic_batched": task_arithmetic(vectors, weights, backend="batched"),
               "unify": unify(vectors), "unify_batched": unify(vectors, backend="batched")}
    assert bench.check_batched(outputs, keys) <= 1e-6
    for name in ("ties_batched", "task_arithmetic_batched"):
        broken = dict(outputs)
        broken[name] = outputs[name].apply(lambda t: t.clone())
        broken[name][keys[0]][0] += 1
        with pytest.raises(SystemExit, match=f"{name} and"):
            bench.check_batched(broken, keys)
    u = outputs["unify_batched"]
    flipped = [m.clone() for m in u.masks]
    flipped[1][0] ^= 1
    with pytest.raises(SystemExit, match="disagree"):
        bench.check_batched({**outputs, "unify_batched": type(u)(u.vector, flipped, u.rescalers)}, keys)
    off = type(u)(u.vector, u.masks, [r * (1 + 1e-5) for r in u.rescalers])
    with pytest.raises(SystemExit, match="rescalers"):
        bench.check_batched({**outputs, "unify_batched": off}, keys)


def test_measure_times_the_paired_floor_right_before_each_call(bench):
    """Ratios against the floor divide by floors timed in alternation with the method."""
    calls = []
    seconds, _, result, floor_seconds = bench.measure(lambda: calls.append("method") or 7, 3,
                                                      paired=lambda: calls.append("floor"))
    assert calls == ["floor", "method"] * 3 and result == 7
    assert 0 <= floor_seconds < math.inf and 0 <= seconds < math.inf
    assert bench.measure(lambda: None, 2)[3] == math.inf  # nothing paired: no floor time
