"""SCAFFOLD and TCT: SCAFFOLD's client and server steps against a hand computation, eNTK features
against the per-sample backward loop and identical for a sample whatever batch it is in, TCT far
above FedAvg under #C=1 label skew on real images (scikit-learn's digits, a small CNN trained in
full), the exported stage-2 package reloaded, and the settings TCT and SCAFFOLD refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hf_fedtask.config import RunConfig
from hf_fedtask.core.state import SHARED, control_name, head_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.data.images import fashion_mnist_available, read_idx
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError, DataError
from hf_fedtask.model.entk import coordinate_subset, entk_features, per_sample_loop
from hf_fedtask.strategies import ClientJob
from hf_fedtask.strategies.tct import regression_steps, targets

IMAGES = dict(tasks=["digits"], suite=None, base_model="hf-fedtask/small-cnn", peft_method="full",
              partition="classes", classes_per_client=1, batch_size=32, learning_rate=0.05, optimizer="sgd",
              lr_scheduler="constant", local_epochs=1.0, seed=0)


def _scaffold_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, **overrides) -> RunConfig:
    settings = dict(strategy="scaffold", suite=None, tasks=[tiny_tasks_dir[0]], base_model=tiny_bert_dir,
                    num_clients=2, rounds=2, batch_size=64, local_steps=1, learning_rate=0.1, optimizer="sgd",
                    lr_scheduler="constant", max_grad_norm=0.0, max_length=16, min_samples=4,
                    output_dir=str(tmp_path / "run"))
    return RunConfig(**{**settings, **overrides})


def test_scaffold_client_step_and_server_step_equal_a_hand_computation(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """One full-batch SGD step: y = x − η(∇f(x) + c − c_i) with ∇f by autograd on the same batch; the
    control update c_i⁺ = c_i − c + (x − y)/η and the server's x and c by hand (|S|/N = 1/2)."""
    fed = Federation(_scaffold_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, participation=0.5))
    env, strategy = fed.env, fed.strategy
    for module in env.host.model.modules():  # no dropout: the hand step sees the trainer's exact loss
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    state = fed.initial_state()
    task = env.tasks[0].name
    gen = torch.Generator().manual_seed(1)
    noise = lambda tv: TaskVector({k: 0.01 * torch.randn(v.shape, generator=gen) for k, v in tv.items()})  # noqa: E731
    names = [SHARED, head_name(task)]
    state.vectors.update({control_name(n): noise(state.vectors[n]) for n in names})  # c ≠ 0
    client = 0
    store = {control_name(n): noise(state.vectors[n]) for n in names}  # c_i ≠ 0
    own = {k: v.clone() for k, v in store.items()}
    downlink = strategy.downlink(state, client, [task])
    data = env.client_data(client)
    job = ClientJob(client_id=client, round=1, data=data, seed=0, origin=env.origin, initial_heads=env.initial_heads,
                    store=store)
    update = strategy.client_update(downlink, job, env.trainer)

    # the hand step: the model's mean loss over the whole (single) batch, its gradient by autograd
    x = TaskVector({**state.vectors[SHARED], **state.vectors[head_name(task)]})
    with env.host.loaded(x) as model:
        model.train()
        params = env.host.trainable_by_name()
        batch = env.host.inputs.collator([data[task][i] for i in range(len(data[task]))])
        loss = model(**batch).loss
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    eta = 0.1
    for n in names:
        correction = state.vectors[control_name(n)] - own[control_name(n)]
        y = TaskVector({k: v - eta * (grads[k] + correction[k]) for k, v in state.vectors[n].items()})
        delta = y - state.vectors[n]
        for k in delta:
            torch.testing.assert_close(update.vectors[n][k], delta[k], atol=2e-6, rtol=1e-4)
        c_new = own[control_name(n)] - state.vectors[control_name(n)] - delta * (1 / eta)
        for k in c_new:
            torch.testing.assert_close(store[control_name(n)][k], c_new[k], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(update.vectors[control_name(n)][k], c_new[k] - own[control_name(n)][k],
                                       atol=1e-4, rtol=1e-4)
    new = strategy.server_aggregate(state, [update])
    for n in names:
        for k in state.vectors[n]:
            torch.testing.assert_close(new.vectors[n][k], state.vectors[n][k] + update.vectors[n][k])
            torch.testing.assert_close(new.vectors[control_name(n)][k],
                                       state.vectors[control_name(n)][k] + 0.5 * update.vectors[control_name(n)][k])


def test_scaffold_refuses_adamw(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = _scaffold_config(tiny_bert_dir, tiny_tasks_dir, tmp_path, optimizer="adamw_torch")
    with pytest.raises(ConfigError, match="optimizer: sgd"):
        run(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method", ["lora", "full"])
def test_entk_features_equal_the_per_sample_backward_loop(tiny_bert_dir, tiny_tasks_dir, method):
    """Layer path (LoRA + head: Linear layers only) and torch.func path (full: embeddings, LayerNorm),
    on padded text batches, against one backward pass per sample."""
    config = RunConfig(suite=None, tasks=[tiny_tasks_dir[0]], base_model=tiny_bert_dir, peft_method=method,
                       num_clients=2, max_length=16, min_samples=4)
    env = Environment(config)
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task).select(range(12))
    index = coordinate_subset(state.numel(), 500, seed=3)
    fast = entk_features(env.host, state, data, index, batch_size=5)
    slow = per_sample_loop(env.host, state, data, index)
    assert fast.shape == (12, 500) and slow.abs().max() > 0
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("p", [2000, 20000])
def test_cnn_entk_features_equal_the_per_sample_backward_loop(p):
    """Convolutions and linear layers, with few selected coordinates per layer (gathered pairs) and
    many (the per-sample gradient by batched matmul): both against one backward pass per sample."""
    from hf_fedtask.model.entk import _dense_is_cheaper

    env = Environment(RunConfig(**{**IMAGES, "num_clients": 2}))
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    index = coordinate_subset(state.numel(), p, seed=5)
    (conv2,) = [k for k in state if k.endswith("cnn.conv2.weight")]
    lo = sum(state[k].numel() for k in list(state)[:list(state).index(conv2)])
    selected = int(((index >= lo) & (index < lo + state[conv2].numel())).sum())
    # the two sizes take the two routes on the second convolution (64 × 800 weights, L = 14 × 14)
    assert _dense_is_cheaper(selected, 64, 800, 196) == (p == 20000)
    data = env.test_data(task).select(range(10))
    fast = entk_features(env.host, state, data, index, batch_size=4)
    slow = per_sample_loop(env.host, state, data, index)
    assert fast.shape == (10, p) and slow.abs().max() > 0
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


def test_features_of_a_sample_do_not_depend_on_its_batch():
    """What makes the features identical on every client: a sample's row is the same in any batch."""
    env = Environment(RunConfig(**{**IMAGES, "num_clients": 2}))
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task).select(range(20))
    index = coordinate_subset(state.numel(), 2000, seed=123)
    together = entk_features(env.host, state, data, index, batch_size=20)
    reordered = entk_features(env.host, state, data.select(list(range(19, -1, -1))), index, batch_size=7)
    torch.testing.assert_close(together, reordered.flip(0), atol=1e-6, rtol=1e-5)


def test_stage2_regression_converges_to_least_squares():
    """The client solver: many full-batch steps at η = 1/λ_max reach the ridge-free least-squares fit."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(200, 20, generator=gen)
    labels = torch.randint(0, 3, (200,), generator=gen)
    y = targets(labels, 3)
    lam = float(torch.linalg.eigvalsh(torch.cat([z, torch.ones(200, 1)], 1).T @ torch.cat([z, torch.ones(200, 1)], 1)
                                      / 200).max())
    w, b, _ = regression_steps(z, y, torch.zeros(20, 3), torch.zeros(3), torch.zeros(20, 3), torch.zeros(3), 3000,
                               1 / lam)
    design = torch.cat([z, torch.ones(200, 1)], 1)
    exact = torch.linalg.lstsq(design, y).solution
    torch.testing.assert_close(torch.cat([w, b[None]], 0), exact, atol=1e-3, rtol=1e-3)


def test_tct_far_above_fedavg_under_one_class_per_client(tmp_path):
    """10 clients holding one digit class each (#C=1). FedAvg for 8 rounds against TCT: the same 6
    FedAvg rounds, the normalization query, then 1 stage-2 round. TCT's stage-2 package reloads and
    reproduces the run's accuracy."""
    accuracies = {}
    for name, options in [("fedavg", {}), ("tct", {"stage1_rounds": 6, "num_features": 4000, "stage2_steps": 50})]:
        config = RunConfig(**IMAGES, strategy=name, strategy_options=options, num_clients=10, rounds=8,
                           output_dir=str(tmp_path / name), export=name == "tct")
        results = run(config)
        accuracies[name] = results["tasks"]["digits"]["accuracy"]
    records = [json.loads(line) for line in (tmp_path / "tct" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("kind", "train") for r in records] == ["train"] * 6 + ["query", "train"]
    fedavg6 = json.loads((tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()[5])["mean_metric"]
    assert records[5]["mean_metric"] == pytest.approx(fedavg6)  # stage 1 is FedAvg
    assert accuracies["fedavg"] < 0.7 and accuracies["tct"] > accuracies["fedavg"] + 0.25, accuracies

    from datasets import load_from_disk  # noqa: F401  (the package reloads without the run)

    from hf_fedtask import load_tct
    from hf_fedtask.data import load_task

    model = load_tct(tmp_path / "tct" / "tct" / "digits")
    test = load_task("digits").dataset["test"]
    preds = []
    for i in range(0, len(test), 90):
        batch = test[i:i + 90]
        with torch.no_grad():
            preds += model(**model.prepare(batch["image"])).argmax(-1).tolist()
    assert np.mean(np.asarray(preds) == np.asarray(test["label"])) == pytest.approx(accuracies["tct"], abs=1e-9)
    assert "not a plain adapter" in (tmp_path / "tct" / "tct" / "digits" / "README.md").read_text()


def test_tct_refuses_partial_participation_and_too_few_rounds(tmp_path):
    base = dict(IMAGES, strategy="tct", num_clients=4, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="participation 1"):
        run(RunConfig(**base, participation=0.5, rounds=30))
    with pytest.raises(ConfigError, match="need rounds >= 22"):
        run(RunConfig(**base, rounds=10))
    assert not (tmp_path / "run").exists()


def test_idx_reader_and_its_errors(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "x-idx3-ubyte"
    path.write_bytes(b"\x00\x00\x08\x03" + np.array([2, 3, 4], dtype=">i4").tobytes() + images.tobytes())
    assert (read_idx(path) == images).all()
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x03" + np.array([2, 3, 4], dtype=">i4").tobytes() + b"\x00")
    with pytest.raises(DataError, match="bad"):
        read_idx(tmp_path / "bad")


@pytest.mark.skipif(not fashion_mnist_available(), reason="apt-get install dataset-fashion-mnist")
def test_fashion_mnist_loads_offline_by_name():
    from hf_fedtask.data import load_task

    task = load_task("fashion_mnist")
    assert (len(task.dataset["train"]), len(task.dataset["test"])) == (60000, 10000)
    assert task.label_names[0] == "T-shirt/top" and task.modality == "image"
    counts = np.bincount(task.dataset["train"]["label"])
    assert (counts == 6000).all()
