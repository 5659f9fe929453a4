"""Exporting a finished run: `export_run` rewrites every adapter equal to the run's own without
tokenizing or partitioning any client data."""

from __future__ import annotations

import json
import shutil

from conftest import tensors_equal
from safetensors.torch import load_file


def test_export_rewrites_the_adapters_without_tokenizing_or_partitioning(finished_fedavg, tmp_path, monkeypatch):
    """`export_run` on a finished run rebuilds every adapter equal to the run's own, with tokenizing and
    partitioning made to fail."""
    from hf_fedtask.workflows.export_run import export_run

    run_dir = tmp_path / "copy"
    shutil.copytree(finished_fedavg, run_dir)
    adapters = sorted((run_dir / "adapters").glob("*/adapter_model.safetensors"))
    before = {p.parent.name: load_file(p) for p in adapters}
    assert sorted(before) == ["colors", "moods"]
    records = {task: (run_dir / "adapters" / task / "hf_fedtask.json").read_text() for task in before}
    configs = {task: _json_files(run_dir / "adapters" / task) for task in before}
    shutil.rmtree(run_dir / "adapters")

    def forbidden(*args, **kwargs):
        raise AssertionError("export must not touch client data")

    monkeypatch.setattr("hf_fedtask.model.host.PeftHost.tokenize", forbidden)
    for target in ("hf_fedtask.data.build_federation", "hf_fedtask.data.partition.build_federation",
                   "hf_fedtask.engine.environment.build_federation"):
        monkeypatch.setattr(target, forbidden)
    paths = export_run(run_dir)
    assert sorted(p.name for p in paths) == ["colors", "moods"]
    for task, tensors in before.items():
        assert tensors_equal(load_file(run_dir / "adapters" / task / "adapter_model.safetensors"), tensors), task
        # what `hf-fedtask evaluate` checks a task against and defaults from, rewritten as the run wrote it
        assert (run_dir / "adapters" / task / "hf_fedtask.json").read_text() == records[task]
        # every JSON file by value (classifier/config.json included): the exported config is the base's as loaded,
        # not as the run's training left it (the Trainer sets `use_cache`), so a process that never trained (this
        # export, a Flower ServerApp) writes what the run wrote
        assert _json_files(run_dir / "adapters" / task) == configs[task], task
        record = json.loads(records[task])
        assert record["task"] == task and record["max_length"] == 16 and record["modality"] == "text"
        assert record["label_names"] == {"colors": ["red", "blue", "green"], "moods": ["happy", "sad"]}[task]


def _json_files(folder) -> dict:
    """Every JSON file under `folder`, parsed, by relative path."""
    return {str(p.relative_to(folder)): json.loads(p.read_text()) for p in sorted(folder.rglob("*.json"))}
