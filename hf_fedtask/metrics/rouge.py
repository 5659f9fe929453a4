"""ROUGE-L as an `evaluate` module that loads offline: `evaluate.load(<path of this file>)`.

The scoring of the Hub's `evaluate-metric/rouge` for its `rougeL` type (Google's `rouge_score` package: the
longest common subsequence of the two token sequences, its F-measure; predictions and references as strings,
`use_stemmer`), which `evaluate.load("rouge")` can only fetch from the Hub; shipped in the package so that a
causal LM's greedy responses to free-text tasks are scored through `evaluate` offline."""

import datasets
import evaluate
import numpy as np
from rouge_score import rouge_scorer

_DESCRIPTION = "ROUGE-L: the F-measure of the longest common subsequence of predicted and reference tokens."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): predicted texts.
    references (list of str): reference texts.
    use_stemmer (bool): Porter-stem the tokens before matching. Defaults to False.
Returns:
    rougeL (float): the mean F-measure over the examples, in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RougeL(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, ACL Workshop 2004.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/spaces/evaluate-metric/rouge",
                            "https://github.com/google-research/google-research/tree/master/rouge"],
        )

    def _compute(self, predictions, references, use_stemmer=False):
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
        scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references, strict=True)]
        return {"rougeL": float(np.mean(scores)) if scores else 0.0}
