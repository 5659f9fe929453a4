"""The run's metrics, computed by `evaluate` modules shipped in this package (loaded by path, so
offline): `accuracy`, `f1_macro` (the `f1` module with average="macro"), `exact_match` and `rougeL` (strings);
and a free-text task's `token_accuracy` (below).

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
    "rougeL": ("rouge.py", {}, "rougeL"),  # a causal LM's greedy responses against a free-text task's references
}


FREE_TEXT_METRICS = ("token_accuracy",)
"""Metrics of free-text answers (a causal LM's instruction tuning on prompt/response rows): scored on the
reference answers, teacher-forced, from each example's (correct tokens, answer tokens, summed negative
log-likelihood) (`free_text_scores`)."""


def check_metric(metric: str) -> None:
    """A ConfigError naming the choices for an unknown run metric."""
    if metric not in METRICS and metric not in FREE_TEXT_METRICS:
        raise ConfigError(f"unknown metric {metric!r}; choose one of {', '.join((*METRICS, *FREE_TEXT_METRICS))}")


def module_path(metric: str) -> str:
    """The file `evaluate.load` takes for a run metric."""
    check_metric(metric)
    if metric in FREE_TEXT_METRICS:
        raise ConfigError(f"metric {metric!r} is computed from token statistics (free_text_scores), not an "
                          "evaluate module")
    return str(MODULES_DIR / METRICS[metric][0])


def free_text_scores(stats) -> dict[str, float]:
    """`token_accuracy` (the share of reference answer tokens that are the model's greedy next token, teacher-
    forced, over all the examples' tokens) and `answer_loss` (the mean negative log-likelihood of an answer token,
    in nats: the log of the answers' perplexity) from per-example rows (correct, tokens, summed NLL).

    Written here: `evaluate`'s perplexity module loads a model by its Hub id itself; these are the same token
    sums over the PEFT model in memory, in one pass with the training's answer-only labels."""
    stats = np.asarray(stats, dtype=np.float64).reshape(-1, 3)
    tokens = stats[:, 1].sum()
    if tokens <= 0:
        raise ConfigError("free-text scoring: no reference answer tokens to score (every answer was cut away)")
    return {"token_accuracy": float(stats[:, 0].sum() / tokens), "answer_loss": float(stats[:, 2].sum() / tokens)}


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
