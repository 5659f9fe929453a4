"""Accuracy as an `evaluate` module that loads offline: `evaluate.load(<path of this file>)`.

The same interface as the Hub's `evaluate-metric/accuracy` (predictions, references, normalize,
sample_weight), which `evaluate.load("accuracy")` can only fetch from the Hub; shipped in the package
so that runs without network compute their metrics through `evaluate` all the same."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Accuracy: the share of predictions equal to their references."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if False, the number of correct predictions instead of their share. Defaults to True.
    sample_weight (list of float): per-sample weights. Defaults to None.
Returns:
    accuracy (float)
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize,
                                                 sample_weight=sample_weight))}
