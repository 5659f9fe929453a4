"""F1 as an `evaluate` module that loads offline: `evaluate.load(<path of this file>)`.

The same interface as the Hub's `evaluate-metric/f1` (predictions, references, labels, pos_label,
average, sample_weight), which `evaluate.load("f1")` can only fetch from the Hub; shipped in the
package so that runs without network compute macro-F1 through `evaluate` all the same."""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = "F1: the harmonic mean of precision and recall, per class and averaged as asked."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    labels (list of int): the labels to include (and their order, for average=None). Defaults to None.
    pos_label (int): the positive class for average="binary". Defaults to 1.
    average (str): "binary", "micro", "macro", "weighted", "samples" or None (per class). Defaults to "binary".
    sample_weight (list of float): per-sample weights. Defaults to None.
Returns:
    f1 (float, or a list of floats for average=None)
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        score = f1_score(references, predictions, labels=labels, pos_label=pos_label, average=average,
                         sample_weight=sample_weight)
        return {"f1": score.tolist() if getattr(score, "ndim", 0) else float(score)}
