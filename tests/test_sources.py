"""load_task: builtin names, save_to_disk folders, local files, Hub ids (offline: one-line DataError)."""

import time

import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from hf_fedtask.data import load_task
from hf_fedtask.errors import DataError


def test_builtin_name_and_prefix(tmp_path):
    task = load_task("english_name_gender", cache_dir=tmp_path)
    assert task.name == "english_name_gender" and task.group == "person-names"
    again = load_task("builtin:english_name_gender", cache_dir=tmp_path)
    assert again.dataset["test"]["text"] == task.dataset["test"]["text"]
    with pytest.raises(DataError, match="english_name_gender"):
        load_task("builtin:english_name_gendr", cache_dir=tmp_path)


def write_csv(path, n=50):
    lines = ["text,label"] + [f"review number {i},{['bad', 'good'][i % 2]}" for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_local_csv_seeded_stratified_split(tmp_path):
    path = tmp_path / "reviews.csv"
    write_csv(path)
    task = load_task(str(path), seed=3, test_size=0.2)
    assert task.name == "reviews" and task.text_column == "text" and task.label_column == "label"
    assert task.label_names == ["bad", "good"]  # sorted string labels -> ClassLabel
    assert len(task.dataset["train"]) == 40 and len(task.dataset["test"]) == 10
    assert sorted(task.dataset["test"]["label"]) == [0] * 5 + [1] * 5
    assert not set(task.dataset["train"]["text"]) & set(task.dataset["test"]["text"])
    assert load_task(str(path), seed=3).dataset["test"]["text"] == task.dataset["test"]["text"]
    assert load_task(str(path), seed=4).dataset["test"]["text"] != task.dataset["test"]["text"]


def test_jsonl_needs_explicit_columns_when_not_detectable(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(f'{{"sentence": "s{i}", "topic": "t{i % 3}"}}\n' for i in range(30)))
    with pytest.raises(DataError, match="no label column found"):
        load_task(str(path))
    with pytest.raises(DataError, match="label column 'kind' not found"):
        load_task(str(path), label_column="kind")
    task = load_task(str(path), label_column="topic")
    assert task.text_column == "sentence" and task.label_names == ["t0", "t1", "t2"]


@pytest.mark.parametrize("header,missing,accepted", [
    ("review,stars", "label", "label, labels, class, answer"),
    ("body,label", "input", "an Image column, text, sentence, content, review, document, tweet, utterance, "
                            "question, prompt"),
])
def test_a_csv_with_unknown_columns_is_one_line_naming_what_to_rename_via_the_cli(
        header, missing, accepted, tiny_bert_dir, tmp_path, capsys):
    from hf_fedtask.cli import main

    path = tmp_path / "reviews.csv"
    path.write_text(header + "\n" + "".join(f"review {i},{i % 2}\n" for i in range(20)))
    rc = main(["run", "--tasks", str(path), "--suite", "", "--base-model", tiny_bert_dir,
               "--output-dir", str(tmp_path / "run")])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (a loading progress bar may come first)
    flag = "label" if missing == "label" else "text"
    assert rc == 2 and last == (
        f"hf-fedtask: error: {path}: no {missing} column found (looked for {accepted}; its columns are "
        f"{header.replace(',', ', ')}); rename its {missing} column to one of those names (from Python: "
        f"load_task(ref, {flag}_column=NAME))")
    assert not (tmp_path / "run").exists()


def test_save_to_disk_round_trip(tmp_path):
    feats = Features({"text": Value("string"), "label": ClassLabel(names=["no", "yes"])})
    dd = DatasetDict({
        "train": Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": [0, 1, 0, 1]}, features=feats),
        "test": Dataset.from_dict({"text": ["e", "f"], "label": [1, 0]}, features=feats),
    })
    dd.save_to_disk(tmp_path / "dd")
    task = load_task(str(tmp_path / "dd"))
    assert task.name == "dd" and task.label_names == ["no", "yes"]
    assert task.dataset["train"].to_dict() == dd["train"].to_dict()
    assert task.dataset["test"].to_dict() == dd["test"].to_dict()
    single = Dataset.from_dict({"text": [f"x{i}" for i in range(20)], "label": [i % 2 for i in range(20)]})
    single.save_to_disk(tmp_path / "single")
    split = load_task(str(tmp_path / "single"), test_size=0.25)
    assert len(split.dataset["train"]) == 15 and len(split.dataset["test"]) == 5
    assert split.label_names == ["0", "1"]


def test_missing_file_and_unknown_hub_id_offline(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_task(str(tmp_path / "missing.csv"))
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        load_task("no-such-task-or-dataset-xyz")
    assert time.perf_counter() - start < 20
    message = str(err.value)
    assert "no-such-task-or-dataset-xyz" in message and "\n" not in message
