"""Individual centralized fine-tuning: one PEFT adapter trained per task on the task's whole train
split. Its accuracy is the normalizer of "normalized accuracy" (MaTU) and the upper reference in
results tables. Values for the builtin suites are computed by `recipes/individual_centralized.py`
and shipped in `hf_fedtask/data/builtin_reference.json` (trained by `hf_fedtask.workflows.reference`)."""

from __future__ import annotations

import json
from importlib import resources

from hf_fedtask.data.builtin import SUITE_VERSION

REFERENCE_FILE = "builtin_reference.json"


def shipped_reference(base_model: str) -> dict[str, dict]:
    """Per-task reference metrics shipped for the current builtin suite version and `base_model`
    ({} if none: a reference for another backbone would normalize by the wrong number)."""
    path = resources.files("hf_fedtask.data").joinpath(REFERENCE_FILE)
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if record.get("suite_version") != SUITE_VERSION or record["recipe"]["base_model"] != base_model:
        return {}
    return record["tasks"]
