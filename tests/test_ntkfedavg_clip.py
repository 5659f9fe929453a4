"""The NTKFedAvg paper setting's code path: a CLIP image encoder (tiny, random) linearized in its
LoRA + head parameters, trained federated on image tasks, exported and reloaded linearized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_fedtask.config import RunConfig
from hf_fedtask.engine import run as federation
from hf_fedtask.export.linearized import load_linearized

PRESETS = Path(__file__).resolve().parents[1] / "recipes" / "presets"


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIP (vision: 2 layers, hidden 32, 32x32 images, 8x8 patches) with a PIL image processor."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    out = tmp_path_factory.mktemp("tiny-clip")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 37,
                     "vocab_size": 100, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
                       "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)
    return str(out)


def test_linearized_clip_image_encoder_trains_and_reloads(tiny_clip_dir, tiny_image_tasks_dir, tmp_path):
    config = RunConfig(strategy="ntkfedavg", suite=None, tasks=tiny_image_tasks_dir, base_model=tiny_clip_dir,
                       base_model_id="hf-fedtask-tests/tiny-clip", target_modules=["q_proj", "v_proj"],
                       num_clients=2, rounds=2, batch_size=8, local_steps=3, learning_rate=1e-2, min_samples=4,
                       output_dir=str(tmp_path / "run"))
    results = federation.run(config)
    sim = federation.Federation(config)
    assert type(sim.host.model.get_base_model()).__name__ == "CLIPForImageClassification"
    assert any("vision_model" in k and "lora_A" in k for k in sim.host.shared_keys)
    for name, r in results["tasks"].items():
        assert {"accuracy", "accuracy_nonlinear"} <= set(r)
        model = load_linearized(Path(config.output_dir) / "linearized" / name, base_model=tiny_clip_dir)
        assert type(model.model.get_base_model()).__name__ == "CLIPForImageClassification"
        test = sim.test_data(name)
        batch = sim.host.inputs.collator([test[i] for i in range(len(test))])
        with torch.no_grad():
            preds = model(pixel_values=batch["pixel_values"]).logits.argmax(-1)
        assert (preds == batch["labels"]).float().mean().item() == pytest.approx(r["accuracy"])


def test_paper_preset_parses():
    config = RunConfig.from_yaml(PRESETS / "ntkfedavg_clip_vit_b32_8task.yaml")
    assert config.base_model == "openai/clip-vit-base-patch32"
    assert (config.num_clients, config.zeta, config.participation, config.rounds) == (8, 0.0, 1.0, 10)
    assert (len(config.tasks) == 8 and config.strategy_config.linearize_at == "server"
            and config.strategy_config.track_task_vectors)
