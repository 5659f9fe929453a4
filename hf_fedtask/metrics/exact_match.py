"""Exact match as an `evaluate` module that loads offline: `evaluate.load(<path of this file>)`.

The interface of the Hub's `evaluate-metric/exact_match` (predictions and references as strings;
`ignore_case`, `ignore_punctuation`), which `evaluate.load("exact_match")` can only fetch from the Hub;
shipped in the package so that a causal LM's greedy answers are scored through `evaluate` offline."""

import string

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Exact match: the share of predicted strings equal to their references (after optional normalizing)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): predicted texts.
    references (list of str): reference texts.
    ignore_case (bool): compare lowercased. Defaults to False.
    ignore_punctuation (bool): remove punctuation before comparing. Defaults to False.
Returns:
    exact_match (float): in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/spaces/evaluate-metric/exact_match"],
        )

    def _compute(self, predictions, references, ignore_case=False, ignore_punctuation=False):
        def normal(text: str) -> str:
            text = text.lower() if ignore_case else text
            return text.translate(str.maketrans("", "", string.punctuation)) if ignore_punctuation else text

        hits = [normal(p) == normal(r) for p, r in zip(predictions, references, strict=True)]
        return {"exact_match": float(np.mean(hits)) if hits else 0.0}
