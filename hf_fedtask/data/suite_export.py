"""Dataset cards and on-disk export of a builtin suite: each task as a `save_to_disk` folder with a
README.md card (YAML front matter readable by `huggingface_hub.DatasetCard`), plus a suite.json index."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import yaml

from hf_fedtask.data.builtin import SUITE_VERSION, load_suite, save_quietly
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, SUITES
from hf_fedtask.data.task import Task
from hf_fedtask.errors import DataError

SUITE_INDEX = "suite.json"
PROBE_NOTE = (
    "frozen-embedding logistic-regression probe: scikit-learn LogisticRegression on mean-pooled, frozen "
    "sentence-transformers/all-MiniLM-L6-v2 embeddings (max_length 32), fit on train and scored on test "
    "at seed 0. A rough difficulty gauge, not a target."
)


def _size_category(n: int) -> str:
    return "n<1K" if n < 1000 else "1K<n<10K" if n < 10_000 else "10K<n<100K"


def _class_counts(task: Task, split: str) -> Counter:
    return Counter(task.dataset[split][task.label_column])


def task_card(task: Task) -> str:
    """Markdown dataset card: front matter (license, task_categories, language, size) and a body with
    source, license, label meanings, construction, sizes, per-class counts, chance level, group and
    conflict relations. Works for any Task; builtin tasks fill every field from Task.extra."""
    extra = task.extra
    n_train, n_test = len(task.dataset["train"]), len(task.dataset["test"])
    front = {
        "license": extra.get("license", "other"),
        "task_categories": ["text-classification"],
        "language": extra.get("languages") or ["und"],
        "size_categories": [_size_category(n_train + n_test)],
        "pretty_name": task.name,
        "tags": ["hf-fedtask", *([extra["suite_version"]] if "suite_version" in extra else [])],
        **({"instruction": task.instruction} if task.instruction else {}),  # what a causal LM is asked
    }
    meanings = extra.get("label_meanings", {})
    train_counts, test_counts = _class_counts(task, "train"), _class_counts(task, "test")
    rows = "\n".join(
        f"| {i} | {name} | {meanings.get(name, '')} | {train_counts[i]} | {test_counts[i]} |"
        for i, name in enumerate(task.label_names)
    )
    packages = ", ".join(f"{p} {v}" for p, v in extra.get("source_packages", {}).items()) or "n/a"
    related = [t.name for t in BUILTIN_TASKS.values() if task.group and t.group == task.group and t.name != task.name]
    conflicts = extra.get("conflicts_with") or []
    conflict_text = (
        f"Conflict group `{extra['conflict_group']}` with {', '.join(f'`{c}`' for c in conflicts)}: the same "
        "inputs and train/test split, labelled by an incompatible property, so a shared representation "
        "that separates this task's classes mixes the other task's classes."
        if conflicts else "No conflict group."
    )
    probe = extra.get("probe_accuracy")
    body = f"""# {task.name}

{task.description}

- **Source:** {extra.get('source', 'unknown')}
- **Source packages:** {packages}
- **License:** {front['license']}
- **Suite:** {extra.get('suite_version', 'n/a')}, seed {extra.get('seed', 'n/a')}; group `{task.group}`
- **Columns:** `{task.text_column}` (string), `{task.label_column}` (ClassLabel); metric: {task.metric}

## Labels

| id | label | meaning | train | test |
|---|---|---|---|---|
{rows}

## Construction

{extra.get('construction', 'n/a')} Texts are deduplicated within the task after case folding and accent
stripping (what the uncased tokenizer sees), and no folded text is in both train and test.

## Sizes

train: {n_train} examples, test: {n_test} examples, {task.num_labels} classes.

## Chance level

{task.chance:.3f} (majority-class accuracy on the test split; classes are balanced, so this is 1/{task.num_labels}).

## Probe accuracy

{f'{probe:.3f}' if probe is not None else 'n/a'}: {PROBE_NOTE}

## Group and conflict relations

Group `{task.group}`{': related tasks ' + ', '.join(f'`{r}`' for r in related) if related else ''}.
{conflict_text}
"""
    return f"---\n{yaml.safe_dump(front, sort_keys=False, allow_unicode=True)}---\n\n{body}"


def _index(name: str, seed: int, tasks: list[Task]) -> dict:
    return {
        "suite": name,
        "suite_version": SUITE_VERSION,
        "seed": seed,
        "tasks": [
            {
                "name": t.name,
                "group": t.group,
                "num_labels": t.num_labels,
                "label_names": t.label_names,
                "train_size": len(t.dataset["train"]),
                "test_size": len(t.dataset["test"]),
                "chance": t.chance,
                "conflict_group": t.extra.get("conflict_group"),
                "license": t.extra.get("license"),
                "probe_accuracy": t.extra.get("probe_accuracy"),
            }
            for t in tasks
        ],
    }


def _check_out_dir(out: Path, name: str, seed: int) -> None:
    """Only an empty folder, or an earlier export of the same suite and seed, may be written into."""
    if not out.exists() or not any(out.iterdir()):
        return
    index = out / SUITE_INDEX
    try:
        previous = json.loads(index.read_text())
        same = previous["suite"] == name and previous["seed"] == seed
    except (OSError, ValueError, KeyError, TypeError):
        same = False
    if not same:
        raise DataError(f"{out}: not empty and not an earlier export of suite {name!r} seed {seed}; "
                        "choose another folder")


def export_suite(name: str, out_dir, *, seed: int = 0, cache_dir=None) -> list[Path]:
    """Write every task of suite `name` to out_dir/<task>/ (save_to_disk + README.md card) and
    out_dir/suite.json. Returns the task folders followed by the suite.json path. Each folder is
    written to a temp name and renamed, so a re-export replaces folders whole."""
    if name not in SUITES:
        raise DataError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    out = Path(out_dir)
    _check_out_dir(out, name, seed)
    tasks = load_suite(name, seed=seed, cache_dir=cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the index goes first: a re-run after an interrupted export then recognises the folder as its own
    index = out / SUITE_INDEX
    tmp_index = out / f".{SUITE_INDEX}.tmp-{uuid.uuid4().hex[:8]}"
    tmp_index.write_text(json.dumps(_index(name, seed, tasks), indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp_index, index)
    written = []
    for task in tasks:
        dest = out / task.name
        tmp = out / f".{task.name}.tmp-{uuid.uuid4().hex[:8]}"
        save_quietly(task.dataset, tmp)
        (tmp / "README.md").write_text(task_card(task), encoding="utf-8")
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
        written.append(dest)
    return [*written, index]
