"""The data of colors.yaml: colors.jsonl beside this file as the test split (lm-eval's `custom_dataset`), so the
task folder loads from wherever it is (a `dataset_path: json` task's `data_files` are relative to the cwd) and
nothing is written to the datasets cache."""

import json
from pathlib import Path

import datasets


def load(**kwargs) -> datasets.DatasetDict:
    lines = Path(__file__).with_name("colors.jsonl").read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in lines])})
