"""The embedded suites: 30 balanced, disjoint, deterministic tasks with groups and conflict groups,
cached as Arrow (never rebuilt once cached) and exportable with dataset cards."""

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from datasets import ClassLabel, Value, load_from_disk
from huggingface_hub import DatasetCard

from hf_fedtask.data import (
    BUILTIN_TASKS,
    SUITE_VERSION,
    SUITES,
    builtin,
    export_suite,
    load_builtin_task,
    load_suite,
    task_card,
)
from hf_fedtask.data.builtin_pools import text_key
from hf_fedtask.errors import DataError


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fedtask-cache")


@pytest.fixture(scope="session")
def suite(cache_dir):
    """builtin-30 built once per session (about 20 s) into a private cache."""
    return load_suite("builtin-30", cache_dir=cache_dir)


def rows(task, split):
    return list(zip(task.dataset[split]["text"], task.dataset[split]["label"]))


def test_thirty_distinct_tasks(suite):
    names = [t.name for t in suite]
    assert len(names) == 30 == len(set(names))
    assert names == SUITES["builtin-30"] == list(BUILTIN_TASKS)


def test_groups_and_conflict_groups(suite):
    groups = Counter(t.group for t in suite)
    assert sum(n >= 2 for n in groups.values()) >= 3
    conflicts = defaultdict(list)
    for t in suite:
        if t.extra["conflict_group"]:
            conflicts[t.extra["conflict_group"]].append(t)
    assert conflicts
    for members in conflicts.values():
        a, b = members[:2]
        assert a.extra["conflicts_with"] == [b.name]
        for split in ("train", "test"):
            assert a.dataset[split]["text"] == b.dataset[split]["text"]  # same inputs, same split
            # incompatible labels: every label of one task meets every label of the other equally often
            pairs = Counter(zip(a.dataset[split]["label"], b.dataset[split]["label"]))
            assert len(pairs) == a.num_labels * b.num_labels and len(set(pairs.values())) == 1


def test_every_task_balanced_disjoint_and_small(suite):
    for t in suite:
        feats = t.dataset["train"].features
        assert feats["text"] == Value("string") and isinstance(feats["label"], ClassLabel), t.name
        assert 2 <= t.num_labels <= 6, t.name
        assert 150 <= len(t.dataset["train"]) <= 400 and 150 <= len(t.dataset["test"]) <= 200, t.name
        for split in ("train", "test"):
            counts = Counter(t.dataset[split]["label"])
            assert len(counts) == t.num_labels and len(set(counts.values())) == 1, (t.name, split, counts)
        assert t.chance == pytest.approx(1 / t.num_labels)
        keys = {s: [text_key(x) for x in t.dataset[s]["text"]] for s in ("train", "test")}
        assert all(keys["train"]) and all(len(set(k)) == len(k) for k in keys.values()), t.name
        assert not set(keys["train"]) & set(keys["test"]), t.name
        assert max(len(x) for x in t.dataset["train"]["text"]) <= 40, t.name


def test_metadata_and_probe(suite):
    for t in suite:
        assert t.metric == "accuracy" and t.description and t.group
        assert set(t.extra["label_meanings"]) == set(t.label_names)
        assert t.extra["source"] and t.extra["license"] and t.extra["source_packages"]
        assert t.extra["suite_version"] == SUITE_VERSION and t.extra["seed"] == 0
        assert t.chance < t.extra["probe_accuracy"] < 1.0, t.name  # learnable, not trivial


def test_deterministic_by_seed(suite, tmp_path):
    fresh = {t.name: t for t in load_suite("builtin-8", cache_dir=tmp_path)}
    for t in suite:
        if t.name in fresh:
            for split in ("train", "test"):
                assert rows(fresh[t.name], split) == rows(t, split), t.name
    other = load_builtin_task("langid_es_pt", seed=1, cache_dir=tmp_path)
    same = next(t for t in suite if t.name == "langid_es_pt")
    assert rows(other, "train") != rows(same, "train")
    assert (tmp_path / "suites" / SUITE_VERSION / "seed1" / "langid_es_pt").is_dir()


def test_cache_is_reused_without_building(suite, cache_dir, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a cached task was rebuilt")

    monkeypatch.setattr(builtin, "build_task_dataset", no_build)
    again = load_suite("builtin-30", cache_dir=cache_dir)
    assert [rows(t, "test") for t in again] == [rows(t, "test") for t in suite]
    seed_dir = cache_dir / "suites" / SUITE_VERSION / "seed0"
    assert sorted(p.name for p in seed_dir.iterdir()) == sorted(SUITES["builtin-30"])  # no temp leftovers


def test_a_larger_train_size_draws_more_of_the_pool_and_keeps_the_test_rows(suite, tmp_path):
    """`train_size` extends the default training rows with more of the pool (equal per cell), caches apart
    from the default, and leaves the test split as it is, rows and order, so sizes compare on one test set."""
    default = next(t for t in suite if t.name == "vader_polarity")
    large = load_builtin_task("vader_polarity", train_size=3200, cache_dir=tmp_path)
    assert len(large.dataset["train"]) == 3200 == large.extra["train_size"]
    assert default.extra["train_size"] == builtin.TRAIN_SIZE
    assert rows(large, "test") == rows(default, "test")
    assert set(rows(default, "train")) < set(rows(large, "train"))
    assert Counter(large.dataset["train"]["label"]) == {0: 1600, 1: 1600}
    keys = {split: {text_key(t) for t in large.dataset[split]["text"]} for split in ("train", "test")}
    assert not keys["train"] & keys["test"]
    assert (tmp_path / "suites" / SUITE_VERSION / "seed0" / "vader_polarity-train3200").is_dir()
    assert not (tmp_path / "suites" / SUITE_VERSION / "seed0" / "vader_polarity").exists()
    short = load_builtin_task("city_ru_ua", train_size=100_000, cache_dir=tmp_path)  # the pool runs out first
    assert 400 < short.extra["train_size"] < 100_000


@pytest.mark.parametrize("size", [1, 0, "400", True, 2.5])
def test_a_bad_train_size_is_one_line_error(size, tmp_path):
    with pytest.raises(DataError, match="train_size must be an integer >= 2"):
        load_builtin_task("vader_polarity", train_size=size, cache_dir=tmp_path)
    assert not (tmp_path / "suites").exists()


def test_builtin_train_size_is_refused_for_other_tasks(tmp_path):
    from hf_fedtask.data import load_task

    with pytest.raises(DataError, match="fashion_mnist: builtin_train_size 1000 applies to builtin tasks only"):
        load_task("fashion_mnist", builtin_train_size=1000, cache_dir=tmp_path)


def test_a_run_config_sets_the_builtin_train_size(monkeypatch, tmp_path):
    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.environment import load_tasks
    from hf_fedtask.errors import ConfigError

    monkeypatch.setenv("HF_FEDTASK_CACHE", str(tmp_path))
    (task,) = load_tasks(RunConfig(tasks=["kaomoji_valence"], builtin_train_size=1000))
    assert len(task.dataset["train"]) == 1000
    (suite_task, *_) = load_tasks(RunConfig(suite="builtin-8", builtin_train_size=600))
    assert len(suite_task.dataset["train"]) == 600
    with pytest.raises(ConfigError, match="builtin_train_size"):
        RunConfig.from_dict({"tasks": ["kaomoji_valence"], "builtin_train_size": 1})


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_FEDTASK_CACHE", str(tmp_path))
    assert builtin.task_cache_dir("x", 3) == tmp_path / "suites" / SUITE_VERSION / "seed3" / "x"


def test_failed_build_leaves_no_partial_cache(tmp_path, monkeypatch):
    def broken_save(dataset, path):
        path.mkdir()
        (path / "half-written").write_text("")
        raise OSError("disk full")

    monkeypatch.setattr(builtin, "save_quietly", broken_save)
    with pytest.raises(OSError):
        load_builtin_task("english_name_gender", cache_dir=tmp_path)
    assert list((tmp_path / "suites" / SUITE_VERSION / "seed0").iterdir()) == []


def test_builtin8_is_a_documented_subset(suite):
    small = SUITES["builtin-8"]
    assert len(small) == 8 and set(small) <= set(SUITES["builtin-30"])
    specs = [BUILTIN_TASKS[n] for n in small]
    assert len({s.group for s in specs}) >= 3
    conflict = Counter(s.conflict_group for s in specs if s.conflict_group)
    assert any(n >= 2 for n in conflict.values())


def test_unknown_names():
    with pytest.raises(DataError, match="builtin-30"):
        load_suite("builtin-31")
    with pytest.raises(DataError, match="langid_romance"):
        load_builtin_task("langid_romanse")


def test_sample_cells_drops_ambiguous_and_folded_duplicates():
    cells = {("a",): ["Café", "cafe", "x1", "x2", "x3", "shared"], ("b",): ["shared", "y1", "y2", "y3", "y4"]}
    splits = builtin.sample_cells(cells, builtin._rng(0, "t"))
    texts = [t for split in splits.values() for t, _ in split]
    assert "shared" not in texts
    assert len([t for t in texts if text_key(t) == "cafe"]) <= 1
    assert Counter(c for split in splits.values() for _, c in split) == {("a",): 4, ("b",): 4}


def test_export_suite_writes_loadable_folders_with_cards(suite, cache_dir, tmp_path):
    out = tmp_path / "export"
    paths = export_suite("builtin-8", out, cache_dir=cache_dir)
    assert paths[-1] == out / "suite.json" and [p.name for p in paths[:-1]] == SUITES["builtin-8"]
    index = json.loads((out / "suite.json").read_text())
    assert index["suite"] == "builtin-8" and index["seed"] == 0 and len(index["tasks"]) == 8
    by_name = {t.name: t for t in suite}
    for entry, path in zip(index["tasks"], paths):
        task = by_name[entry["name"]]
        loaded = load_from_disk(str(path))
        assert loaded["test"]["text"] == task.dataset["test"]["text"]
        assert entry["num_labels"] == task.num_labels and entry["label_names"] == task.label_names
        assert entry["chance"] == pytest.approx(1 / task.num_labels)
        readme = (path / "README.md").read_text()
        sizes = (f"train: {len(task.dataset['train'])}", f"test: {len(task.dataset['test'])}")
        for needle in ("**Source:**", "**License:**", *sizes, "## Chance level",
                       "frozen-embedding logistic-regression probe"):
            assert needle in readme, (task.name, needle)
        card = DatasetCard(readme)
        assert card.data.license == task.extra["license"]
        assert card.data.task_categories == ["text-classification"]
        assert card.data.language == task.extra["languages"]
    export_suite("builtin-8", out, cache_dir=cache_dir)  # re-export of the same suite+seed is allowed
    with pytest.raises(DataError, match="not empty"):
        export_suite("builtin-8", out, seed=1, cache_dir=cache_dir)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        export_suite("builtin-8", other, cache_dir=cache_dir)


def test_task_card_lists_conflicts_and_labels(suite):
    task = next(t for t in suite if t.name == "vader_polarity")
    card = task_card(task)
    assert "`vader_intensity`" in card and "Conflict group `word-affect`" in card
    for name, meaning in task.extra["label_meanings"].items():
        assert f"| {name} | {meaning} |" in card


def test_suite_overview_card_lists_every_task():
    overview = (Path(builtin.__file__).parent / "cards" / "builtin-suite.md").read_text()
    for name in BUILTIN_TASKS:
        assert f"| `{name}` |" in overview, name
