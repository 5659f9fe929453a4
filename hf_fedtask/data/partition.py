"""Seeded, reproducible data partitioners: which client holds which task (MaTU's allocation A(n,t), ζ_t)
and how a task's training split is divided among its clients (IID, NIID-Bench Dirichlet α, #C=k).

Hand-written rather than flwr-datasets: flwr-datasets 0.6.1 pins datasets<5 and huggingface_hub<2 and
would downgrade both. Every function takes an explicit seed and uses only numpy Generators.

Each class partitioner accepts optional client `weights` (summing to 1): the fraction of the data each
client should get. Uniform weights give the textbook algorithm; build_federation passes the task
allocation shares so that a client's part of a task grows with its share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from datasets import Dataset

from hf_fedtask.core.names import PARTITIONS
from hf_fedtask.data.task import Task
from hf_fedtask.errors import DataError

MAX_DIRICHLET_TRIES = 1000


def _weights(num_clients: int, weights: Sequence[float] | None) -> np.ndarray:
    if num_clients < 1:
        raise DataError(f"num_clients must be >= 1, got {num_clients}")
    if weights is None:
        return np.full(num_clients, 1.0 / num_clients)
    w = np.asarray(weights, dtype=float)
    if w.shape != (num_clients,) or (w < 0).any() or w.sum() <= 0:
        raise DataError(f"weights must be {num_clients} non-negative numbers with a positive sum")
    return w / w.sum()


def _split_by_weights(indices: np.ndarray, w: np.ndarray) -> list[np.ndarray]:
    cuts = np.round(np.cumsum(w)[:-1] * len(indices)).astype(int)
    return np.split(indices, cuts)


def iid(
    num_samples: int, num_clients: int, seed: int | Sequence[int], weights: Sequence[float] | None = None
) -> list[np.ndarray]:
    """A seeded permutation cut into consecutive parts (equal sizes, or proportional to `weights`)."""
    w = _weights(num_clients, weights)
    rng = np.random.default_rng(seed)
    return [np.sort(p) for p in _split_by_weights(rng.permutation(num_samples), w)]


def _dirichlet_try(labels: np.ndarray, w: np.ndarray, alpha: float, rng: np.random.Generator) -> list | None:
    """One NIID-Bench draw; None when a class's proportions vanish after capping."""
    n, k = len(labels), len(w)
    parts: list[list[int]] = [[] for _ in range(k)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(np.full(k, alpha))
        p = p * np.array([len(parts[j]) < w[j] * n for j in range(k)])  # cap: target size reached
        if p.sum() <= 0:
            return None
        for j, chunk in enumerate(_split_by_weights(idx, p / p.sum())):
            parts[j].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _dirichlet(labels, num_clients, alpha, rng, min_size, weights) -> tuple[list[np.ndarray], bool]:
    """Best of up to MAX_DIRICHLET_TRIES draws (one when min_size is out of reach anyway);
    (parts, True) as soon as every client has >= min_size samples."""
    labels = np.asarray(labels)
    w = _weights(num_clients, weights)
    if alpha <= 0:
        raise DataError(f"dirichlet alpha must be > 0, got {alpha}")
    best = [np.zeros(0, dtype=np.int64)] * num_clients
    for _ in range(MAX_DIRICHLET_TRIES if num_clients * min_size <= len(labels) else 1):
        parts = _dirichlet_try(labels, w, alpha, rng)
        if parts is None:
            continue
        if min(map(len, parts)) >= min_size:
            return parts, True
        if min(map(len, parts)) >= min(map(len, best)):
            best = parts
    return best, False


def dirichlet_classes(
    labels: Sequence[int],
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    weights: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """NIID-Bench label skew: for each class draw p ~ Dir_K(α) over the K clients, zero out clients that
    already hold their target size (N/K, or weight·N), renormalize and split the class by p. Redraw until
    every client holds >= min_size samples; give up with DataError after MAX_DIRICHLET_TRIES draws."""
    parts, ok = _dirichlet(labels, num_clients, alpha, np.random.default_rng(seed), min_size, weights)
    if not ok:
        reason = (f"only {len(labels)} samples for {num_clients} clients" if num_clients * min_size > len(labels)
                  else f"no draw in {MAX_DIRICHLET_TRIES} reached it (best: {min(map(len, parts))})")
        raise DataError(f"dirichlet partition (alpha={alpha}): cannot give each of {num_clients} clients "
                        f">= {min_size} samples: {reason}; raise alpha or lower num_clients/min_size")
    return parts


def classes_per_client(
    labels: Sequence[int], num_clients: int, k: int, seed: int | Sequence[int], weights: Sequence[float] | None = None
) -> list[np.ndarray]:
    """NIID-Bench #C=k: client i holds class i mod C plus k-1 other random classes; each class is split
    among the clients holding it (evenly, or in proportion to their weights). A class that no client
    draws (possible when num_clients < C) is left out."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    w = _weights(num_clients, weights)
    if not 1 <= k <= len(classes):
        raise DataError(f"classes_per_client k={k} must be between 1 and the number of classes ({len(classes)})")
    rng = np.random.default_rng(seed)
    held = []
    for i in range(num_clients):
        own = i % len(classes)
        others = rng.choice(np.delete(np.arange(len(classes)), own), size=k - 1, replace=False)
        held.append({own, *others.tolist()})
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for ci, c in enumerate(classes):
        holders = [i for i in range(num_clients) if ci in held[i]]
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        for i, chunk in zip(holders, _split_by_weights(idx, w[holders] / w[holders].sum())):
            parts[i].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


_classes_partition = classes_per_client  # build_federation's keyword argument shadows the name


def task_shares(num_clients: int, num_tasks: int, zeta: float, seed: int) -> np.ndarray:
    """(num_clients, num_tasks) matrix: the fraction of task t's training data that client n gets; each
    column sums to 1 and A(n,t) = shares > 0.

    zeta == 0: one task per client, round-robin over a seeded permutation of the tasks (every task gets
    >= 1 client; requires num_clients >= num_tasks); a task's clients share it equally.
    zeta > 0: per task, shares ~ Dir_N(ζ) over clients; a client holds the task when its share is at
    least the uniform share 1/N (so every task has >= 1 holder and each holder gets >= about |D_t|/N
    samples). A client left without a task takes the task where its share is largest, at share 1/N.
    Shares of holders are renormalized per task. Small ζ: few clients per task; large ζ: about half."""
    if num_tasks < 1 or num_clients < 1:
        raise DataError(f"need >= 1 client and >= 1 task, got {num_clients} clients and {num_tasks} tasks")
    if zeta < 0:
        raise DataError(f"zeta must be >= 0, got {zeta}")
    rng = np.random.default_rng(seed)
    shares = np.zeros((num_clients, num_tasks))
    if zeta == 0:
        if num_clients < num_tasks:
            raise DataError(f"zeta=0 gives one task per client: {num_clients} clients cannot cover {num_tasks} "
                            "tasks; use more clients, fewer tasks or zeta > 0")
        order = rng.permutation(num_tasks)
        shares[np.arange(num_clients), order[np.arange(num_clients) % num_tasks]] = 1.0
    else:
        draws = rng.dirichlet(np.full(num_clients, zeta), size=num_tasks).T  # (clients, tasks)
        shares = np.where(draws >= 1.0 / num_clients, draws, 0.0)
        for n in np.flatnonzero(shares.sum(axis=1) == 0):
            shares[n, np.argmax(draws[n])] = 1.0 / num_clients
    return shares / shares.sum(axis=0, keepdims=True)


def task_allocation(num_clients: int, num_tasks: int, zeta: float, seed: int) -> np.ndarray:
    """A(n,t): boolean (num_clients, num_tasks) matrix, True when client n holds task t (see task_shares)."""
    return task_shares(num_clients, num_tasks, zeta, seed) > 0


def build_federation(
    tasks: list[Task],
    num_clients: int,
    *,
    zeta: float = 0.0,
    partition: str = "iid",
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    min_samples: int = 8,
) -> list[dict[str, Dataset]]:
    """Client n's training data: {task name: its subset of that task's train split}.

    Tasks go to clients by task_shares(num_clients, len(tasks), zeta, seed); a task's train split is
    divided among its holders by `partition` with the holders' shares as weights: "iid" (sizes
    proportional to shares), "dirichlet" (NIID-Bench label skew with `alpha`, caps at share·N) or
    "classes" (#C = `classes_per_client`). Task t's partition uses seed [seed, t], so it does not depend
    on the other tasks' sizes. Every (client, task) pair must get >= min_samples samples."""
    if partition not in PARTITIONS:
        raise DataError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise DataError(f"task names must be unique, got {names}")
    shares = task_shares(num_clients, len(tasks), zeta, seed)
    clients: list[dict[str, Dataset]] = [{} for _ in range(num_clients)]
    for ti, task in enumerate(tasks):
        train = task.dataset["train"]
        if partition != "iid" and task.free_text:
            raise DataError(f"task {task.name!r}: partition {partition!r} skews labels, and its answers are free "
                            "text; use partition iid")
        labels = None if partition == "iid" else np.asarray(train[task.label_column])
        holders = np.flatnonzero(shares[:, ti])
        w = shares[holders, ti]
        task_seed = [seed, ti]
        if partition == "iid":
            parts = iid(len(train), len(holders), task_seed, weights=w)
        elif partition == "dirichlet":
            parts, _ = _dirichlet(labels, len(holders), alpha, np.random.default_rng(task_seed), min_samples, w)
        else:
            k = min(classes_per_client, len(np.unique(labels)))  # tasks differ in their number of classes
            parts = _classes_partition(labels, len(holders), k, task_seed, weights=w)
        for client, idx in zip(holders, parts):
            if len(idx) < min_samples:
                raise DataError(
                    f"client {client}, task {task.name!r}: {len(idx)} training samples < min_samples={min_samples} "
                    f"({len(train)} samples over {len(holders)} clients, partition={partition}); "
                    "use fewer clients, a larger zeta/alpha or a lower min_samples"
                )
            clients[client][task.name] = train.select(idx)
    return clients
