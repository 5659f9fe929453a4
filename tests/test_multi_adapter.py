"""FedYolo's export: every task's module and head in one PEFT multi-adapter folder that stock PEFT
loads, switches between, and that gives each task's own model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

from hf_fedtask.engine import run as federation
from hf_fedtask.export.multi_adapter import INDEX_FILE, PAD_BIAS


def test_fedyolo_run_exports_one_multi_adapter_folder_stock_peft_loads(tiny_config, tiny_bert_dir):
    tiny_config.strategy = "fedyolo"
    tiny_config.strategy_options["share"] = "half"
    results = federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    folder = run_dir / "multi_adapter"
    index = json.loads((folder / INDEX_FILE).read_text())
    first, width = index["first"], index["num_labels"]
    assert set(index["tasks"]) == set(results["tasks"]) and width == 3
    card = (folder / "README.md").read_text()
    assert "Sharing variant: `half`" in card and all(t in card for t in index["tasks"])

    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=width)
    model = PeftModel.from_pretrained(base, str(folder), adapter_name=first)
    for task in index["tasks"]:
        if task != first:
            model.load_adapter(str(folder / task), adapter_name=task)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 3000, (6, 8), generator=gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model.eval()
    for task, info in index["tasks"].items():
        model.set_adapter(task)
        with torch.no_grad():
            multi = model(**inputs).logits
        # the task's own stock adapter folder (its true head shape) gives the same first logits
        single_base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=info["num_labels"])
        single = PeftModel.from_pretrained(single_base, str(run_dir / "adapters" / task)).eval()
        with torch.no_grad():
            own = single(**inputs).logits
        n = info["num_labels"]
        assert torch.allclose(multi[:, :n], own, atol=1e-6)
        assert torch.equal(multi.argmax(-1), own.argmax(-1))
        if n < width:
            assert torch.all(multi[:, n:] < PAD_BIAS / 2)
