"""Partitioners: seeded, disjoint and complete; Dirichlet skew grows as α shrinks; #C=k; task allocation
A(n,t) for ζ=0 and ζ>0; build_federation and its min_samples check."""

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from hf_fedtask.data import (
    Task,
    build_federation,
    classes_per_client,
    dirichlet_classes,
    iid,
    task_allocation,
    task_shares,
)
from hf_fedtask.errors import DataError

LABELS = np.repeat(np.arange(10), 100)  # 10 balanced classes, 1000 samples


def assert_disjoint_complete(parts, n):
    flat = np.concatenate(parts)
    assert len(flat) == len(set(flat.tolist())) == n


def mean_class_entropy(parts, labels):
    ents = []
    for p in parts:
        q = np.bincount(labels[p], minlength=labels.max() + 1) / len(p)
        q = q[q > 0]
        ents.append(-(q * np.log(q)).sum())
    return float(np.mean(ents))


def test_iid_seeded_disjoint_complete_equal():
    parts = iid(103, 5, seed=1)
    assert_disjoint_complete(parts, 103)
    assert {len(p) for p in parts} <= {20, 21}
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid(103, 5, seed=1)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, iid(103, 5, seed=2)))


def test_iid_weights_set_sizes():
    assert [len(p) for p in iid(100, 3, seed=0, weights=[0.5, 0.3, 0.2])] == [50, 30, 20]


def test_dirichlet_seeded_disjoint_complete_min_size():
    parts = dirichlet_classes(LABELS, 10, alpha=0.5, seed=3, min_size=10)
    assert_disjoint_complete(parts, len(LABELS))
    assert min(map(len, parts)) >= 10
    again = dirichlet_classes(LABELS, 10, alpha=0.5, seed=3, min_size=10)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_dirichlet_small_alpha_is_more_skewed():
    skewed = mean_class_entropy(dirichlet_classes(LABELS, 10, alpha=0.1, seed=0), LABELS)
    medium = mean_class_entropy(dirichlet_classes(LABELS, 10, alpha=1.0, seed=0), LABELS)
    flat = mean_class_entropy(dirichlet_classes(LABELS, 10, alpha=100.0, seed=0), LABELS)
    assert skewed < medium < flat <= np.log(10)


def test_dirichlet_impossible_raises():
    with pytest.raises(DataError, match="cannot give each of 20 clients >= 60 samples"):
        dirichlet_classes(LABELS, 20, alpha=0.5, seed=0, min_size=60)


def test_classes_per_client_exactly_k():
    for k in (1, 2, 3):
        parts = classes_per_client(LABELS, 20, k, seed=4)
        assert_disjoint_complete(parts, len(LABELS))  # 20 clients >= 10 classes: every class is held
        for i, p in enumerate(parts):
            held = set(LABELS[p].tolist())
            assert len(held) == k and i % 10 in held
    again = classes_per_client(LABELS, 20, 2, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(classes_per_client(LABELS, 20, 2, seed=4), again))
    with pytest.raises(DataError, match="between 1 and"):
        classes_per_client(LABELS, 5, 11, seed=0)


def test_task_allocation_zeta0_one_task_each():
    a = task_allocation(30, 8, zeta=0.0, seed=0)
    assert a.shape == (30, 8) and a.dtype == bool
    assert (a.sum(axis=1) == 1).all() and (a.sum(axis=0) >= 1).all()
    assert np.array_equal(a, task_allocation(30, 8, zeta=0.0, seed=0))
    assert np.allclose(task_shares(30, 8, 0.0, 0).sum(axis=0), 1.0)
    with pytest.raises(DataError, match="cannot cover"):
        task_allocation(5, 8, zeta=0.0, seed=0)


def test_task_allocation_zeta_positive_multi_task():
    a = task_allocation(30, 8, zeta=0.5, seed=0)
    assert (a.sum(axis=1) >= 1).all() and (a.sum(axis=0) >= 1).all()
    assert (a.sum(axis=1) > 1).any()
    assert np.array_equal(a, task_allocation(30, 8, zeta=0.5, seed=0))
    shares = task_shares(30, 8, 0.5, 0)
    assert np.allclose(shares.sum(axis=0), 1.0) and np.array_equal(shares > 0, a)
    few = task_allocation(30, 30, zeta=0.05, seed=1).sum(axis=1).mean()
    many = task_allocation(30, 30, zeta=5.0, seed=1).sum(axis=1).mean()
    assert few < many


def make_task(name, n_classes=3, n=60):
    feats = Features({"text": Value("string"), "label": ClassLabel(names=[f"c{i}" for i in range(n_classes)])})
    split = lambda m, off: Dataset.from_dict(  # noqa: E731
        {"text": [f"{name} {i + off}" for i in range(m)], "label": [i % n_classes for i in range(m)]}, features=feats)
    return Task(name=name, dataset=DatasetDict({"train": split(n, 0), "test": split(12, 10_000)}))


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "classes"])
def test_build_federation_splits_each_task_among_its_clients(partition):
    tasks = [make_task("a"), make_task("b", n_classes=2, n=80), make_task("c", n=90)]
    fed = build_federation(tasks, 6, zeta=0.0, partition=partition, alpha=1.0, seed=0, min_samples=5)
    assert len(fed) == 6 and all(len(c) == 1 for c in fed)
    for t in tasks:
        parts = [c[t.name]["text"] for c in fed if t.name in c]
        assert len(parts) == 2
        flat = [x for p in parts for x in p]
        assert len(flat) == len(set(flat)) and set(flat) <= set(t.dataset["train"]["text"])
        if partition != "classes":
            assert len(flat) == len(t.dataset["train"])
    again = build_federation(tasks, 6, zeta=0.0, partition=partition, alpha=1.0, seed=0, min_samples=5)
    assert [{k: v["text"] for k, v in c.items()} for c in fed] == [{k: v["text"] for k, v in c.items()} for c in again]


def test_build_federation_multi_task_clients():
    tasks = [make_task(n, n=200) for n in "abcd"]
    fed = build_federation(tasks, 8, zeta=1.0, seed=2, min_samples=4)
    assert any(len(c) > 1 for c in fed) and all(len(c) >= 1 for c in fed)
    for t in tasks:
        assert sum(len(c[t.name]) for c in fed if t.name in c) == 200


def test_build_federation_min_samples_names_client_and_task():
    with pytest.raises(DataError, match=r"client \d+, task 'a': \d+ training samples < min_samples=40"):
        build_federation([make_task("a")], 3, min_samples=40)
    with pytest.raises(DataError, match="unknown partition"):
        build_federation([make_task("a")], 1, partition="shards")
