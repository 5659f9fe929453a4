"""The lean client loop (`hf_fedtask.client.lean`) takes the Trainer's optimizer steps bit for bit: whole runs
with `client_loop: lean` and `client_loop: trainer` end in equal checkpoints and equal train losses, over the
settings that change the arithmetic (dropout, gradient accumulation with a short last step, fractional epochs,
warmup + cosine, weight decay, SGD without clipping, FedProx's objective, bf16 autocast, a causal LM's
length-grouped batches, a linearized model, images, full fine-tuning); prepared batches equal the collator's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_config
from safetensors.torch import load_file

from hf_fedtask.client.lean import PreparedData
from hf_fedtask.config import RunConfig
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError

CASES = {
    "lora-dropout": {},
    "accumulation-epochs-cosine": dict(local_steps=-1, local_epochs=1.5, gradient_accumulation_steps=3, batch_size=4,
                                       lr_scheduler="cosine", warmup_steps=1, weight_decay=0.1),
    "fedprox-sgd-unclipped": dict(strategy="fedprox", optimizer="sgd", local_steps=4, max_grad_norm=0.0),
    "bf16": dict(mixed_precision="bf16", local_steps=3),
    "causal-lm-grouped": dict(base_model="hf-fedtask/tiny-llama", base_model_id=None, max_length=128, local_steps=3,
                              gradient_accumulation_steps=2),
    "linearized": dict(strategy="ntkfedavg", local_steps=3),
    "full-mlp": dict(tasks=["digits"], base_model="hf-fedtask/small-mlp", base_model_id=None, peft_method="full",
                     batch_size=32, local_steps=4),
}


def _run(tiny_bert_dir, tiny_tasks_dir, out: Path, loop: str, overrides: dict):
    run(make_config(tiny_bert_dir, tiny_tasks_dir, out, client_loop=loop, batch_clients="off", rounds=2, **overrides))
    losses = [r["train_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    return load_file(out / "checkpoint.safetensors"), losses


@pytest.mark.parametrize("case", list(CASES))
def test_lean_loop_runs_equal_trainer_runs_bit_for_bit(case, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    trainer_state, trainer_losses = _run(tiny_bert_dir, tiny_tasks_dir, tmp_path / "trainer", "trainer", CASES[case])
    lean_state, lean_losses = _run(tiny_bert_dir, tiny_tasks_dir, tmp_path / "lean", "lean", CASES[case])
    assert trainer_state.keys() == lean_state.keys()
    for k in trainer_state:
        assert torch.equal(trainer_state[k], lean_state[k]), k
    assert lean_losses == trainer_losses
    assert len(set(lean_losses)) == 2  # round 2 starts where round 1's training moved the model


def _environment(tiny_bert_dir, tiny_tasks_dir, tmp_path, **overrides) -> Environment:
    return Environment(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", **overrides))


@pytest.mark.parametrize("inputs", ["text", "causal-lm", "images"])
def test_prepared_batches_equal_the_collators_and_use_indexed_tensors(inputs, tiny_bert_dir, tiny_tasks_dir,
                                                                      tiny_vit_dir, tiny_image_tasks_dir, tmp_path):
    overrides = {"text": {}, "causal-lm": dict(base_model="hf-fedtask/tiny-llama", base_model_id=None,
                                               max_length=128),
                 "images": dict(base_model=tiny_vit_dir, base_model_id="hf-internal-testing/tiny-vit",
                                tasks=tiny_image_tasks_dir, target_modules=["q_proj", "v_proj"])}[inputs]
    env = _environment(tiny_bert_dir, tiny_tasks_dir, tmp_path, **overrides)
    data = next(iter(env.client_data(0).values()))
    collator = env.host.inputs.collator
    prepared = PreparedData(data, collator, torch.device("cpu"), budget_bytes=1 << 30)
    assert prepared.tensors is not None  # the indexed path, not the per-step collator
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        indices = torch.randperm(len(data), generator=generator)[:5].tolist()
        expected = collator([data[i] for i in indices])
        got = prepared.batch(indices)
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k


def test_a_collator_that_does_more_than_pad_falls_back_to_collating_cached_rows(tiny_bert_dir, tiny_tasks_dir,
                                                                                tmp_path):
    env = _environment(tiny_bert_dir, tiny_tasks_dir, tmp_path)
    data = next(iter(env.client_data(0).values()))
    inner = env.host.inputs.collator

    def reversing(features):  # a batch whose rows depend on the batch: not an indexed slice of all rows
        batch = inner(features)
        return {k: v.flip(0) for k, v in batch.items()}

    prepared = PreparedData(data, reversing, torch.device("cpu"), budget_bytes=1 << 30)
    assert prepared.tensors is None
    indices = [3, 0, 2]
    expected = reversing([data[i] for i in indices])
    got = prepared.batch(indices)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_auto_trains_lean_the_trainer_stays_selectable_and_lean_refuses_fp16(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    assert _environment(tiny_bert_dir, tiny_tasks_dir, tmp_path).trainer.loop == "lean"
    assert _environment(tiny_bert_dir, tiny_tasks_dir, tmp_path, client_loop="trainer").trainer.loop == "trainer"
    with pytest.raises(ConfigError, match="client_loop: lean .*fp16"):
        RunConfig(tasks=list(tiny_tasks_dir), suite=None, client_loop="lean", mixed_precision="fp16")
