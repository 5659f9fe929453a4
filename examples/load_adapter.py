"""Load an exported per-task adapter with stock PEFT and classify a few texts.

    python examples/load_adapter.py runs/fedavg8/adapters/<task> "some text" "another text"

With network access, the base can also be fetched by its Hub id:
    base = AutoModelForSequenceClassification.from_pretrained(
        "sentence-transformers/all-MiniLM-L6-v2", num_labels=N)
    model = PeftModel.from_pretrained(base, "runs/fedavg8/adapters/<task>")
Offline, `load_adapter_model` takes the embedded copy of the default backbone instead.
"""

import json
import sys
from pathlib import Path

import torch

from hf_fedtask.export.standalone import load_adapter_model


def main(adapter_dir: str, texts: list[str]) -> list[str]:
    model, tokenizer = load_adapter_model(adapter_dir)
    results = json.loads((Path(adapter_dir).parents[1] / "results.json").read_text())
    labels = results["tasks"][Path(adapter_dir).name]["label_names"]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")).logits
    return [labels[i] for i in logits.argmax(-1).tolist()]


if __name__ == "__main__":
    for text, label in zip(sys.argv[2:], main(sys.argv[1], sys.argv[2:])):
        print(f"{label:>16s}  {text}")
