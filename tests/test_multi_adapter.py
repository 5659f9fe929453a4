"""FedYolo's export: every task's module and head in one PEFT multi-adapter folder that stock PEFT
loads, each task's head of its own size, so a reloaded task gives exactly its own logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForSequenceClassification

from hf_fedtask.engine import run as federation
from hf_fedtask.export.multi_adapter import INDEX_FILE


def test_fedyolo_exports_per_task_heads_of_their_own_size(tiny_config, tiny_bert_dir):
    tiny_config.strategy = "fedyolo"
    tiny_config.strategy_options["share"] = "half"
    tiny_config.rounds = 1
    results = federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    folder = run_dir / "multi_adapter"
    index = json.loads((folder / INDEX_FILE).read_text())
    first = index["first"]
    assert set(index["tasks"]) == set(results["tasks"]) and "num_labels" not in index
    card = (folder / "README.md").read_text()
    assert "Sharing variant: `half`" in card and all(t in card for t in index["tasks"]) and "padded" not in card

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 3000, (6, 8), generator=gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for task, info in index["tasks"].items():
        n = info["num_labels"]
        assert (n, info["label_names"]) == (results["tasks"][task]["num_labels"], results["tasks"][task]["label_names"])
        path = folder / info["path"]
        assert (info["path"] == ".") == (task == first)
        # the folder carries what every exported adapter does: the task's labels and the tokenizer
        config = AutoConfig.from_pretrained(path, subfolder="classifier")
        assert config.num_labels == n and [config.id2label[i] for i in range(n)] == info["label_names"]
        assert (path / "tokenizer.json").exists() and json.loads((path / "hf_fedtask.json").read_text())["task"] == task
        with torch.no_grad():
            multi = PeftModel.from_pretrained(
                AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=n), str(path),
                adapter_name=task).eval()(**inputs).logits
            own = PeftModel.from_pretrained(  # the task's own stock adapter folder
                AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=n),
                str(run_dir / "adapters" / task)).eval()(**inputs).logits
        assert multi.shape == (6, n) and torch.equal(multi, own)
