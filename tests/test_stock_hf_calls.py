"""Stock Hugging Face calls on what a run exports: the embedded backbone placed in the Hub cache
under its id (stock `AutoModel` / `AutoPeftModel...` loads in a fresh offline process), label names
carried by every exported adapter (pipelines answer them, for text and images), and the run's metrics
computed by `evaluate` modules equal to the formulas."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_VIT_ID

from hf_fedtask.cli import main
from hf_fedtask.config import RunConfig
from hf_fedtask.engine import run as federation
from hf_fedtask.errors import ConfigError
from hf_fedtask.metrics import compute, load_metric
from hf_fedtask.model import hub_cache
from hf_fedtask.model.hub_cache import PINNED_FILES, UPSTREAM_REVISION, place_embedded_backbone, snapshot_dir

STOCK_SCRIPT = """
import json, sys
import numpy as np
from peft import AutoPeftModelForSequenceClassification
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, pipeline
from hf_fedtask.data import load_task

run = sys.argv[1]
results = json.load(open(f"{run}/results.json"))
out = {"base_params": sum(
    p.numel() for p in AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2").parameters())}
for name, r in results["tasks"].items():
    adapter = f"{run}/adapters/{name}"
    config = AutoConfig.from_pretrained(adapter, subfolder="classifier")
    peft_model = AutoPeftModelForSequenceClassification.from_pretrained(
        adapter, num_labels=config.num_labels, id2label=config.id2label, label2id=config.label2id)
    model = AutoModelForSequenceClassification.from_pretrained(adapter, config=config)
    classify = pipeline("text-classification", model=model, tokenizer=adapter, truncation=True, max_length=32)
    test = load_task(name).dataset["test"]
    predicted = [p["label"] for p in classify(list(test["text"]), batch_size=64)]
    names = [config.id2label[y] for y in test["label"]]
    out[name] = {"accuracy": float(np.mean([p == y for p, y in zip(predicted, names)])),
                 "labels": sorted(set(predicted)), "peft_labels": peft_model.config.id2label[0]}
print(json.dumps(out))
"""


def _offline_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HF_FEDTASK_NO_HUB_CACHE")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


def test_placement_lays_out_the_hub_cache_and_never_overwrites(tmp_path):
    cache = tmp_path / "hub"
    snap = snapshot_dir(cache)
    repo = snap.parents[1]
    (snap).mkdir(parents=True)
    (snap / "config.json").write_text('{"mine": true}')  # a user's own entry
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("f" * 40)
    placement = place_embedded_backbone(cache)
    assert (snap / "config.json").read_text() == '{"mine": true}' and (repo / "refs" / "main").read_text() == "f" * 40
    assert not placement.ref_written and "config.json" not in placement.added
    assert set(placement.added) == set(PINNED_FILES) - {"config.json"}
    weights = snap / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().name == PINNED_FILES["model.safetensors"]  # LFS blob = SHA-256
    assert (snap / "vocab.txt").resolve().parent == repo / "blobs"
    again = place_embedded_backbone(cache)
    assert again.added == () and not again.ref_written

    fresh = tmp_path / "fresh"
    assert place_embedded_backbone(fresh).ref_written
    assert (snapshot_dir(fresh).parents[1] / "refs" / "main").read_text() == UPSTREAM_REVISION


def test_placement_refuses_files_that_do_not_match_and_writes_nothing(tmp_path, monkeypatch):
    import shutil

    from hf_fedtask.model import hub_cache

    copy = tmp_path / "pkg"
    shutil.copytree(hub_cache.embedded_default_path(), copy, symlinks=False)
    (copy / "vocab.txt").write_text("tampered")
    monkeypatch.setattr(hub_cache, "embedded_default_path", lambda: copy)
    with pytest.raises(ConfigError, match=r"vocab.txt: SHA-256 .* is not the pinned"):
        place_embedded_backbone(tmp_path / "hub")
    assert not (tmp_path / "hub").exists()


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    """FedAvg on the real embedded MiniLM, two builtin tasks, two short rounds, exported."""
    out = tmp_path_factory.mktemp("native") / "run"
    assert main(["run", "--strategy", "fedavg", "--tasks", "vader_polarity", "kaomoji_emotion", "--num-clients", "2",
                 "--rounds", "2", "--max-train-samples", "128", "--output-dir", str(out)]) == 0
    return out


def test_stock_auto_classes_and_pipeline_in_a_fresh_offline_process(minilm_run, tmp_path):
    cache = tmp_path / "hub"
    env = _offline_env(cache)
    subprocess.run([sys.executable, "-m", "hf_fedtask.cli", "cache-backbone"], env=env, check=True, capture_output=True)
    done = subprocess.run([sys.executable, "-c", STOCK_SCRIPT, str(minilm_run)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["base_params"] == 22_713_216
    results = json.loads((minilm_run / "results.json").read_text())
    for name, r in results["tasks"].items():
        assert found[name]["accuracy"] == pytest.approx(r["accuracy"], abs=1e-9), name  # pipeline == results.json
        assert set(found[name]["labels"]) <= set(r["label_names"]), name  # names, never LABEL_k
        assert found[name]["peft_labels"] == r["label_names"][0]


def test_first_use_places_the_backbone_with_a_notice(tmp_path):
    code = ("from hf_fedtask.model.backbone import resolve_base_model, DEFAULT_BASE_MODEL;"
            "resolve_base_model(DEFAULT_BASE_MODEL); resolve_base_model(DEFAULT_BASE_MODEL)")
    done = subprocess.run([sys.executable, "-c", code], env=_offline_env(tmp_path / "hub"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("placed the embedded sentence-transformers/all-MiniLM-L6-v2") == 1
    assert hub_cache.is_placed(tmp_path / "hub")
    skipped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**_offline_env(tmp_path / "other"), "HF_FEDTASK_NO_HUB_CACHE": "1"})
    assert skipped.returncode == 0 and "placed" not in skipped.stderr and not (tmp_path / "other").exists()


def test_image_adapter_pipeline_answers_label_names(tiny_vit_dir, tiny_image_tasks_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForImageClassification, pipeline

    from hf_fedtask.data import load_task

    config = RunConfig(strategy="fedavg", suite=None, tasks=tiny_image_tasks_dir, base_model=tiny_vit_dir,
                       base_model_id=TINY_VIT_ID, target_modules=["q_proj", "v_proj"], num_clients=2, rounds=1,
                       batch_size=8, local_steps=2, min_samples=4, output_dir=str(tmp_path / "run"))
    results = federation.run(config)
    for name, r in results["tasks"].items():
        adapter = tmp_path / "run" / "adapters" / name
        assert (adapter / "preprocessor_config.json").is_file()
        labelled = AutoConfig.from_pretrained(adapter, subfolder="classifier")
        assert labelled.architectures == ["ViTForImageClassification"]
        assert str(tmp_path) not in (adapter / "classifier" / "config.json").read_text()  # portable: no local paths
        base = AutoModelForImageClassification.from_pretrained(tiny_vit_dir, config=labelled)  # the Hub id, offline
        model = PeftModel.from_pretrained(base, adapter)
        classify = pipeline("image-classification", model=model, image_processor=str(adapter), top_k=1)
        task = load_task(next(p for p in tiny_image_tasks_dir if Path(p).name == name))
        test = task.dataset["test"]
        predicted = [out[0]["label"] for out in classify(list(test[task.text_column]))]
        accuracy = float(np.mean([p == r["label_names"][y] for p, y in zip(predicted, test[task.label_column])]))
        assert accuracy == pytest.approx(r["accuracy"], abs=1e-9), name
        assert set(predicted) <= set(r["label_names"])


def test_evaluate_modules_equal_the_formulas():
    import evaluate
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    for n, k in [(1, 2), (17, 3), (500, 6)]:
        y, p = rng.integers(0, k, n), rng.integers(0, k, n)
        assert compute("accuracy", y, p) == float(np.mean(y == p))
        assert compute("f1_macro", y, p) == float(f1_score(y, p, average="macro"))
    assert isinstance(load_metric("accuracy"), evaluate.EvaluationModule)
    combined = evaluate.combine([load_metric("accuracy"), load_metric("f1_macro")])  # evaluate's own API over them
    assert (combined.compute(predictions=[0, 1, 1], references=[0, 1, 0])
            == pytest.approx({"accuracy": 2 / 3, "f1": 2 / 3}))
    with pytest.raises(ConfigError, match="unknown metric 'auc'"):
        compute("auc", [0], [0])
