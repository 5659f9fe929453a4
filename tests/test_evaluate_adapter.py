"""`hf-fedtask evaluate` checks the task against the adapter and reproduces the run's number: its defaults
(task, max_length, the seeded test subset, the base folder) come from what the adapter or its run
records, it says what it scores, and a task with other labels or inputs, or another base model, is one
line naming both sides, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_fedtask.cli import main


@pytest.fixture(scope="module")
def capped_run(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory) -> Path:
    """A finished 1-round FedAvg whose test splits were capped (max_test_samples 10 of 18) and whose
    max_length (16) is not evaluate's old default (32)."""
    from conftest import make_config

    from hf_fedtask.engine.run import run

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory.mktemp("capped") / "run", max_test_samples=10)
    run(config)
    return Path(config.output_dir)


def evaluate(argv, capsys):
    """Exit code, the JSON printed (or None) and stderr's lines of `hf-fedtask evaluate ARGV`."""
    capsys.readouterr()
    code = main(["evaluate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err.strip().splitlines()


def test_defaults_come_from_the_adapter_and_reproduce_the_run(capped_run, capsys, monkeypatch):
    monkeypatch.setattr("hf_fedtask.client.evaluation.PROGRESS_DELAY", 0)  # show the bar at once
    expected = json.loads((capped_run / "results.json").read_text())["tasks"]["colors"]
    adapter = capped_run / "adapters" / "colors"
    code, got, err = evaluate([adapter], capsys)  # no --task, no --max-length, no --max-test-samples
    assert code == 0, err
    assert got["task"] == "colors" and got["max_length"] == 16
    assert got["num_examples"] == expected["num_examples"] == 10 and got["split_examples"] == 18
    assert got["accuracy"] == expected["accuracy"]
    said = next(line for line in err if line.startswith("evaluate: scoring"))
    assert "10 of 18 test examples" in said and "max_test_samples 10" in said and "--max-test-samples all" in said
    assert any("evaluate colors" in line and "10/10" in line for line in err)  # the progress bar

    code, whole, _ = evaluate([adapter, "--max-test-samples", "all", "--max-length", "8"], capsys)
    assert code == 0 and whole["num_examples"] == 18 and whole["max_length"] == 8
    card = (adapter / "README.md").read_text()
    assert "seeded subset of 10 test examples" in card  # the card says its number is of a subset

    # an export older than hf_fedtask.json: the run folder around it gives the same defaults
    copy = capped_run.parent / "old-export"
    shutil.copytree(capped_run, copy, ignore=shutil.ignore_patterns(".hf_fedtask.lock"))
    (copy / "adapters" / "colors" / "hf_fedtask.json").unlink()
    code, old, err = evaluate([copy / "adapters" / "colors"], capsys)
    assert code == 0, err
    assert (old["num_examples"], old["max_length"], old["accuracy"]) == (10, 16, expected["accuracy"])


def _task(folder: Path, names: list[str], image: bool = False) -> str:
    """A tiny saved task with these label names (text, or 8x8 images)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

    n = 2 * len(names)
    if image:
        from PIL import Image as PILImage

        column = {"image": [PILImage.new("RGB", (8, 8), (40 * i, 0, 0)) for i in range(n)]}
        feats = Features({"image": Image(), "label": ClassLabel(names=names)})
    else:
        column = {"text": [f"word {i}" for i in range(n)]}
        feats = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    split = Dataset.from_dict({**column, "label": [i % len(names) for i in range(n)]}, features=feats)
    DatasetDict({"train": split, "test": split}).save_to_disk(folder)
    return str(folder)


def test_a_task_with_other_labels_or_inputs_or_another_base_is_refused(capped_run, tiny_tasks_dir, tiny_vit_dir,
                                                                       tmp_path, capsys):
    adapter = capped_run / "adapters" / "colors"  # 3 labels: red, blue, green
    before = {p: p.read_bytes() for p in adapter.rglob("*") if p.is_file()}
    cases = [
        ([adapter, "--task", tiny_tasks_dir[1]],  # moods: 2 labels
         ["has 3 labels [red, blue, green]", "task 'moods' has 2 [happy, sad]", f"--task {tiny_tasks_dir[0]}"]),
        ([adapter, "--task", _task(tmp_path / "farben", ["rot", "blau", "grün"])],  # 3 labels, other names
         ["labels [red, blue, green]", "task 'farben' has [rot, blau, grün]"]),
        ([adapter, "--task", _task(tmp_path / "pictures", ["red", "blue", "green"], image=True)],
         ["a text classifier's", "task 'pictures' has image inputs"]),
        ([adapter, "--base-model", tiny_vit_dir], ["base model", tiny_vit_dir, "is not the one", "tiny-bert"]),
    ]
    for argv, says in cases:
        code, _, err = evaluate(argv, capsys)
        assert code == 2 and len(err) == 1 and err[0].startswith("hf-fedtask: error: "), err
        assert all(s in err[0] for s in says), (says, err[0])
    assert {p: p.read_bytes() for p in adapter.rglob("*") if p.is_file()} == before
