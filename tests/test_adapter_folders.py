"""Every command that reads an adapter folder (evaluate, push, merge, load_task_adapter) shares one
validator: a bad folder is one line naming the file and what is wrong, exit 2, nothing written."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_fedtask.cli import main
from hf_fedtask.engine import run as federation


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_bert_dir, tiny_tasks_dir):
    from conftest import TINY_MODEL_ID

    from hf_fedtask.config import RunConfig

    out = tmp_path_factory.mktemp("adapters") / "run"
    federation.run(RunConfig(suite=None, tasks=tiny_tasks_dir, base_model=tiny_bert_dir, base_model_id=TINY_MODEL_ID,
                             num_clients=2, rounds=1, batch_size=8, local_steps=2, max_length=16, min_samples=4,
                             output_dir=str(out)))
    return out / "adapters" / "moods"


def _config(folder: Path) -> dict:
    return json.loads((folder / "adapter_config.json").read_text())


def _break(folder: Path, how: str, tiny_bert_dir: str) -> str:
    """Spoil a copy of an adapter folder; returns what the error must name."""
    config, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if how == "invalid json":
        config.write_text("{not json")
        return "adapter_config.json"
    if how == "no base":
        c = _config(folder)
        del c["base_model_name_or_path"]
        config.write_text(json.dumps(c))
        return "base_model_name_or_path"
    if how == "missing local base":
        c = _config(folder)
        c["base_model_name_or_path"] = "/nonexistent/base-model"
        config.write_text(json.dumps(c))
        return "/nonexistent/base-model"
    if how == "other base offline":
        c = _config(folder)
        c["base_model_name_or_path"] = "someone/not-cached-anywhere"
        config.write_text(json.dumps(c))
        return "someone/not-cached-anywhere"
    if how == "empty weights":
        weights.write_bytes(b"")
        return "adapter_model.safetensors"
    if how == "corrupt weights":
        weights.write_bytes(weights.read_bytes()[:100])
        return "adapter_model.safetensors"
    if how == "weights a directory":
        weights.unlink()
        weights.mkdir()
        return "adapter_model.safetensors"
    if how == "nan":
        tensors = load_file(weights)
        key = sorted(tensors)[0]
        tensors[key][0] = float("nan")
        save_file(tensors, weights)
        return key
    raise ValueError(how)


CASES = ["invalid json", "no base", "missing local base", "other base offline", "empty weights", "corrupt weights",
         "weights a directory", "nan"]


@pytest.mark.parametrize("how", CASES)
def test_evaluate_refuses_a_bad_adapter_folder_in_one_line(adapter, tiny_bert_dir, tiny_tasks_dir, tmp_path, how,
                                                          capsys):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    if how != "other base offline":  # evaluate reads the recorded base; point it at the local tiny model
        c = _config(folder)
        c["base_model_name_or_path"] = tiny_bert_dir
        (folder / "adapter_config.json").write_text(json.dumps(c))
    named = _break(folder, how, tiny_bert_dir)
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in folder.iterdir()}
    capsys.readouterr()
    assert main(["evaluate", str(folder), "--task", tiny_tasks_dir[1], "--max-length", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("hf-fedtask: error") and named in err[-1], err
    assert "Traceback" not in "".join(err)
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in folder.iterdir()} == before


@pytest.mark.parametrize("how", ["invalid json", "no base", "empty weights", "nan"])
def test_push_and_merge_refuse_the_same_folders(adapter, tiny_bert_dir, tmp_path, how, capsys):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    named = _break(folder, how, tiny_bert_dir)
    capsys.readouterr()
    assert main(["push", str(folder), "--repo-id", "me/x", "--endpoint", "http://127.0.0.1:9", "--token", "x"]) == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["merge", "--method", "task_arithmetic", str(folder), str(adapter), "-o", str(tmp_path / "m")]) == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "m").exists()


def test_a_good_folder_still_evaluates(adapter, tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    c = _config(folder)
    c["base_model_name_or_path"] = tiny_bert_dir
    (folder / "adapter_config.json").write_text(json.dumps(c))
    capsys.readouterr()
    assert main(["evaluate", str(folder), "--task", tiny_tasks_dir[1], "--max-length", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_examples"] == 18 and 0 <= out["accuracy"] <= 1
    assert torch.isfinite(torch.tensor(out["accuracy"]))
