"""The issue's acceptance path on the real embedded backbone: FedAvg on builtin-8 from the CLI,
every task above chance, every exported adapter re-evaluated with stock PEFT on the exported test
split reproducing results.json."""

import json
from pathlib import Path

import torch

from hf_fedtask.cli import main
from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL, DEFAULT_WEIGHTS_SHA256, embedded_default_path, file_sha256

MARGIN = 0.05  # accuracy must beat chance by at least 5 points on every task


def test_embedded_backbone_matches_upstream_sha256():
    assert file_sha256(embedded_default_path() / "model.safetensors") == DEFAULT_WEIGHTS_SHA256


def test_fedavg_builtin8_above_chance_and_reproducible_with_stock_peft(tmp_path, capsys):
    from datasets import load_from_disk
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run_dir, data_dir = tmp_path / "fedavg8", tmp_path / "builtin-8"
    assert main(["run", "--strategy", "fedavg", "--suite", "builtin-8", "--rounds", "3",
                 "--output-dir", str(run_dir)]) == 0
    assert main(["suite", "export", "builtin-8", str(data_dir)]) == 0
    capsys.readouterr()
    results = json.loads((run_dir / "results.json").read_text())
    assert len(results["tasks"]) == 8
    for name, r in results["tasks"].items():
        assert r["accuracy"] >= r["chance"] + MARGIN, f"{name}: {r['accuracy']:.3f} vs chance {r['chance']:.3f}"
        assert r["normalized"] == r["accuracy"] / r["individual_centralized"]  # the shipped reference
    assert results["mean_normalized"] > 0.5

    base_path = str(embedded_default_path())  # what the Hub id in adapter_config.json names, offline
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    for name, r in results["tasks"].items():
        adapter = run_dir / "adapters" / name
        assert (json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
                == DEFAULT_BASE_MODEL)
        base = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=r["num_labels"])
        model = PeftModel.from_pretrained(base, adapter).eval()
        test = load_from_disk(str(data_dir / name))["test"]
        with torch.no_grad():
            enc = tokenizer(list(test["text"]), padding=True, truncation=True, max_length=32, return_tensors="pt")
            pred = model(**enc).logits.argmax(-1)
        accuracy = float((pred == torch.tensor(list(test["label"]))).float().mean())
        assert abs(accuracy - r["accuracy"]) <= 0.01, name
        assert "library_name: peft" in (adapter / "README.md").read_text()
    assert Path(run_dir / "accuracy_vs_round.png").stat().st_size > 10_000
