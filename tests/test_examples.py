"""The scripts in `examples/` (issue 53) run as a user runs them, at their small size, and print what their
docstrings promise: each in a fresh interpreter (`python examples/x.py ...`), offline, in a temporary folder,
its output read back and the files it wrote loaded. Each also says how to run it and is included in the docs
(`--8<-- "examples/x.py"`, pymdownx.snippets; `mkdocs build --strict` fails on a missing file).

Each run takes a few seconds to about 15 s on two busy CPU cores (one round of one or two local steps, builtin tasks
cut with --builtin-train-size 64 and 16 test examples a task), so none is marked slow."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
SMALL_BUILTIN = ["--rounds", "1", "--builtin-train-size", "64", "--max-test-samples", "16"]
TWO_TASKS = ["vader_polarity", "first_name_gender"]


def run_example(script: str, *args: str, cwd: Path) -> str:
    """`python examples/<script> ARGS` in `cwd` (the tests' offline environment, conftest.py); its stdout."""
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def load_example(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_says_how_to_run_it_and_is_included_in_the_docs():
    assert {"load_adapter.py", "train_on_my_csv.py", "step_rounds_by_hand.py", "merge_task_vectors.py",
            "private_federation.py"} <= set(SCRIPTS)
    pages = {p: p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md")}
    index = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
    for script in SCRIPTS:
        doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text(encoding="utf-8")))
        assert doc and f"python examples/{script}" in doc, f"{script}: its docstring must say how to run it"
        assert f"`examples/{script}`" in index, f"{script} is missing from docs/examples.md"
        assert any(f'--8<-- "examples/{script}"' in text for text in pages.values()), \
            f"{script} is included in no docs page"


def test_train_on_my_csv_then_load_its_adapter(tmp_path):
    out = run_example("train_on_my_csv.py", "--output-dir", "runs/csv", "--num-clients", "2", "--rounds", "1",
                      "--local-steps", "2", "--max-test-samples", "16", cwd=tmp_path)
    accuracy = re.search(r"^reviews: accuracy (\d\.\d{3}) on 16 test examples \(chance \d\.\d{3}\)$", out, re.M)
    assert accuracy and 0 <= float(accuracy.group(1)) <= 1, out
    adapter = tmp_path / "runs" / "csv" / "adapters" / "reviews"
    assert f"reviews: adapter {Path('runs/csv/adapters/reviews')}  labels negative, positive" in out
    assert (tmp_path / "runs" / "csv-data" / "reviews.csv").is_file()  # the toy file, beside the run folder
    assert json.loads((tmp_path / "runs" / "csv" / "results.json").read_text())["tasks"]["reviews"]["accuracy"] == \
        pytest.approx(float(accuracy.group(1)), abs=5e-4)

    texts = ["a lovely phone", "a broken chair"]
    lines = run_example("load_adapter.py", str(adapter), *texts, cwd=tmp_path).splitlines()
    assert [line.split(maxsplit=1)[1] for line in lines] == texts
    assert {line.split()[0] for line in lines} <= {"negative", "positive"}


def test_step_rounds_by_hand_prints_every_round(tmp_path, capsys):
    out = run_example("step_rounds_by_hand.py", "--tasks", *TWO_TASKS, "--local-steps", "1",
                      *SMALL_BUILTIN, "--rounds", "2", cwd=tmp_path)
    assert "fedavg: 2 tasks on 2 clients {0: ['vader_polarity'], 1: ['first_name_gender']}" in out
    rounds = re.findall(r"^round (\d): clients \[0, 1\]  train_loss \d+\.\d{4}  mean metric (\d\.\d{3})  "
                        r"bytes up [\d,]+ down [\d,]+  \|shared - init\| (\d+\.\d{4})", out, re.M)
    assert [r[0] for r in rounds] == ["1", "2"], out
    assert all(float(r[2]) > 0 for r in rounds)  # the shared modules moved from their init
    for task in TWO_TASKS:
        assert re.search(rf"^{task}: accuracy \d\.\d{{3}} on 16 test examples$", out, re.M), out
    assert list(tmp_path.iterdir()) == []  # nothing written

    # the early stop, in this process: a target of 0 is reached after the first of 3 rounds
    load_example("step_rounds_by_hand.py").main(["--tasks", *TWO_TASKS, "--local-steps", "1", *SMALL_BUILTIN,
                                                 "--rounds", "3", "--target", "0"])
    out = capsys.readouterr().out
    assert "reached the target 0.0 after round 1: stopping" in out and "round 2:" not in out


def test_merge_task_vectors_writes_merged_adapters_that_load(tmp_path):
    from hf_fedtask.core.taskvector import TaskVector

    out = run_example("merge_task_vectors.py", "--tasks", *TWO_TASKS, "--local-steps", "2", *SMALL_BUILTIN,
                      "--work-dir", "merge", cwd=tmp_path)
    work = tmp_path / "merge"
    for task in TWO_TASKS:
        row = re.search(rf"^{task} +(\d\.\d{{3}}) +(\d\.\d{{3}}) +(\d\.\d{{3}})$", out, re.M)
        assert row and all(0 <= float(x) <= 1 for x in row.groups()), out
        own = json.loads((work / "runs" / task / "results.json").read_text())["tasks"][task]["accuracy"]
        assert float(row.group(1)) == pytest.approx(own, abs=5e-4)  # stock PEFT reproduces the run's score
        for method in ("ties", "task_arithmetic"):
            assert (work / f"merged-{method}" / task / "adapter_config.json").is_file()

    # the task-vector files load checked, and task arithmetic (λ = 1) is the adapter's own init + both τ:
    # merged − the task's own adapter = the other task's τ on the shared modules, and the head is its own
    taus = {t: TaskVector.load(work / "task_vectors" / f"{t}.safetensors") for t in TWO_TASKS}
    assert all(tv.metadata["kind"] == "delta" and tv.metadata["task_ids"] == [t] for t, tv in taus.items())
    merged = load_file(str(work / "merged-task_arithmetic" / "vader_polarity" / "adapter_model.safetensors"))
    alone = load_file(str(work / "runs" / "vader_polarity" / "adapters" / "vader_polarity" /
                          "adapter_model.safetensors"))
    assert set(merged) == set(alone)
    other = taus["first_name_gender"]
    for key in merged:
        expected = alone[key] + other[key] if key in other else alone[key]
        assert (merged[key] - expected).abs().max() < 1e-5, key

    # a merged folder loads with stock transformers + PEFT, its label names from the task's own head
    labels = load_example("load_adapter.py").main(str(work / "merged-ties" / "vader_polarity"), ["sunshine"])
    assert labels[0] in {"negative", "positive"}


def test_private_federation_reports_the_epsilon_spent(tmp_path):
    out = run_example("private_federation.py", "--tasks", *TWO_TASKS, "--num-clients", "8", "--epsilon", "4",
                      "--local-steps", "1", *SMALL_BUILTIN, "--output-dir", "runs/dp", cwd=tmp_path)
    spent = re.search(r"^privacy spent: ε = (\d+\.\d{3}) at δ = 1e-05 after 1 rounds$", out, re.M)
    sigma = re.search(r"^noise multiplier σ (\d+\.\d{4}) \(calibrated to target ε 4\), clip 1, noise drawn on the "
                      r"server$", out, re.M)
    assert spent and sigma, out
    privacy = json.loads((tmp_path / "runs" / "dp" / "results.json").read_text())["privacy"]
    assert float(spent.group(1)) == pytest.approx(privacy["epsilon"], abs=5e-4)
    assert 3.5 < privacy["epsilon"] <= 4 + 1e-6 and privacy["target_epsilon"] == 4  # σ calibrated to the target
    assert privacy["noise_multiplier"] > 0 and float(sigma.group(1)) == pytest.approx(privacy["noise_multiplier"],
                                                                                     abs=5e-5)
    assert "sampling: 4 of 8 clients per round" in out
    card = (tmp_path / "runs" / "dp" / "adapters" / "vader_polarity" / "README.md").read_text(encoding="utf-8")
    assert "Differential privacy" in card


def test_docstring_rows_are_free_text_rows_a_free_text_task_loads(tmp_path):
    out = run_example("docstring_rows.py", "rows.jsonl", cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert out.startswith(f"{len(rows)} rows from 48 modules") and len(rows) > 1000
    assert all(set(r) == {"instruction", "input", "output"} and len(r["output"].split()) >= 4 for r in rows)
    assert len({r["instruction"] for r in rows}) == len(rows)  # one row per name
    first = {r["instruction"]: r for r in rows}["What does `textwrap.dedent` in Python's standard library do?"]
    assert first["input"] == "dedent(text)" and first["output"].startswith("Remove any common leading whitespace")
    from hf_fedtask.data import load_task

    task = load_task(str(tmp_path / "rows.jsonl"), text_column="instruction", answers="free_text")
    assert task.free_text and task.label_column == "output"

