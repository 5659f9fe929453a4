"""Load an exported per-task adapter with stock transformers + PEFT and classify a few texts.

    python examples/load_adapter.py runs/fedavg8/adapters/<task> "some text" "another text"

The adapter folder carries its tokenizer and, in `classifier/config.json`, the label names; the base
(`sentence-transformers/all-MiniLM-L6-v2`) resolves offline because hf_fedtask placed its embedded copy
in the Hugging Face cache (`hf-fedtask cache-backbone`).
"""

import sys

from transformers import AutoConfig, AutoModelForSequenceClassification, pipeline
from transformers.utils import logging as hf_logging


def main(adapter_dir: str, texts: list[str]) -> list[str]:
    config = AutoConfig.from_pretrained(adapter_dir, subfolder="classifier")
    # transformers loads the base model first and reports its classification head as MISSING (newly
    # initialized) in a LOAD REPORT; the adapter's own head (PEFT's modules_to_save) replaces it right after,
    # so that report, which reads like an error, is not the user's concern here
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(adapter_dir, config=config)
    finally:
        hf_logging.set_verbosity(verbosity)
    classify = pipeline("text-classification", model=model, tokenizer=adapter_dir, truncation=True, max_length=32)
    return [out["label"] for out in classify(texts)]


if __name__ == "__main__":
    for text, label in zip(sys.argv[2:], main(sys.argv[1], sys.argv[2:])):
        print(f"{label:>16s}  {text}")
