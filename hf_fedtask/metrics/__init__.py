"""The run's metrics, computed by `evaluate` modules shipped in this package (loaded by path, so
offline): `accuracy`, `f1_macro` (the `f1` module with average="macro") and `exact_match` (strings).

    from hf_fedtask.metrics import load_metric
    load_metric("accuracy").compute(predictions=[0, 1], references=[0, 0])  # {'accuracy': 0.5}

`evaluate.load("accuracy")` resolves the name on the Hub; these files carry the same interface."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from hf_fedtask.errors import ConfigError

MODULES_DIR = Path(__file__).parent
METRICS = {  # run metric -> (evaluate module file, compute kwargs, result key)
    "accuracy": ("accuracy.py", {}, "accuracy"),
    "f1_macro": ("f1.py", {"average": "macro"}, "f1"),
    "exact_match": ("exact_match.py", {}, "exact_match"),  # a causal LM's greedy answers against its label words
}


def module_path(metric: str) -> str:
    """The file `evaluate.load` takes for a run metric."""
    if metric not in METRICS:
        raise ConfigError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    return str(MODULES_DIR / METRICS[metric][0])


@cache
def load_metric(metric: str):
    """The loaded `evaluate.EvaluationModule` behind a run metric (once per process)."""
    import evaluate

    path = module_path(metric)
    return evaluate.load(path)


def compute(metric: str, references, predictions) -> float:
    """The run metric of `predictions` against `references`, through its `evaluate` module."""
    module_path(metric)
    _, kwargs, key = METRICS[metric]
    result = load_metric(metric).compute(predictions=np.asarray(predictions).tolist(),
                                         references=np.asarray(references).tolist(), **kwargs)
    return float(result[key])
