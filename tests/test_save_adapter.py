"""save_adapter writes a folder that stock PEFT loads back to the very same logits."""

import json

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, PromptTuningConfig, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

from hf_fedtask.export import adapter as export
from hf_fedtask.export.adapter import save_adapter

NUM_LABELS = 3


def tiny_peft_model(base_dir, peft_config):
    """A random tiny BERT classifier saved to `base_dir` (the "base"), wrapped with `peft_config`,
    its adapter and trainable classifier copy perturbed so a bad reload would show."""
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=100, num_labels=NUM_LABELS)
    BertForSequenceClassification(config).save_pretrained(base_dir)
    model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(base_dir), peft_config)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


CONFIGS = {
    "lora": lambda: LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False),
    "ia3": lambda: IA3Config(task_type="SEQ_CLS"),
    "prompt_tuning": lambda: PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4),
}
BATCH = {"input_ids": torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(1)),
         "attention_mask": torch.ones(4, 8, dtype=torch.long)}


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_stock_peft_reloads_identical_logits(tmp_path, method):
    model = tiny_peft_model(tmp_path / "base", CONFIGS[method]())
    state = get_peft_model_state_dict(model)
    # Tuners nest the model one level deeper than prompt learning: base_model.model.classifier.* vs
    # base_model.classifier.*
    head = "base_model.classifier" if method == "prompt_tuning" else "base_model.model.classifier"
    assert {f"{head}.weight", f"{head}.bias"} <= set(state)

    folder = save_adapter(tmp_path / "adapter", peft_config=model.peft_config["default"], state_dict=state,
                          base_model_id="me/tiny-bert", card="# tiny card\n")

    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json",
                                                        "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "me/tiny-bert"
    assert "classifier" in config["modules_to_save"]
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(state)

    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=NUM_LABELS)
    reloaded = PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**BATCH).logits, model(**BATCH).logits)


@pytest.mark.parametrize("bad_id", ["/abs/path/model", "~/model", "."])
def test_local_base_model_path_is_rejected(tmp_path, bad_id):
    with pytest.raises(ValueError, match="local path"):
        save_adapter(tmp_path / "a", peft_config=CONFIGS["lora"](), state_dict={"w": torch.ones(1)},
                     base_model_id=bad_id)
    assert not (tmp_path / "a").exists()


def test_failed_write_leaves_existing_folder_untouched(tmp_path, monkeypatch):
    model = tiny_peft_model(tmp_path / "base", CONFIGS["lora"]())
    kwargs = dict(peft_config=model.peft_config["default"], state_dict=get_peft_model_state_dict(model),
                  base_model_id="me/tiny-bert")
    folder = save_adapter(tmp_path / "adapter", card="old card", **kwargs)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def broken_writer(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "save_file", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(folder, card="new card", **kwargs)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # no temp folders left

    monkeypatch.undo()
    save_adapter(folder, card="new card", **kwargs)
    assert (folder / "README.md").read_text() == "new card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]
