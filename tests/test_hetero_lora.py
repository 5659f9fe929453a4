"""Clients of different LoRA ranks in one run (`lora_ranks`, FlexLoRA; `hf_fedtask.strategies.hetero_rank`): the
downlink to each client against a hand computation (numpy's SVD of the global product, truncated to the client's
rank), the server step against the dense FlexLoRA step, the spectrum readings against numpy, runs on the
in-process engine and over Flower (equal checkpoints), exports that stock PEFT loads at the global rank, and
the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL_ID, assert_stock_reload_matches, make_config, read_records
from safetensors.torch import load_file

from hf_fedtask.cli import main
from hf_fedtask.config import RunConfig
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, unpack_vectors
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge.lora_product import effective_rank, energy_rank, lora_pairs, tail_energy
from hf_fedtask.strategies import GlobalState, build_strategy, head_name
from hf_fedtask.strategies.base import aggregation_diagnostics
from hf_fedtask.strategies.hetero_rank import client_rank, truncate_shared

D_OUT, D_IN, R_G = 12, 10, 8
PAIRS = ("base_model.model.l0.attention.query", "base_model.model.l1.attention.value")
A, B = ".lora_A.weight", ".lora_B.weight"
BIAS = "base_model.model.pooler.dense.bias"  # a shared key that is no LoRA factor
RANKS = [2, 4, 8]
HETERO = {"lora_aggregation": "product", "lora_ranks": RANKS}


def _best(M: np.ndarray, rank: int) -> np.ndarray:
    """The best rank-`rank` approximation of M by numpy's dense SVD (the hand computation)."""
    U, S, Vh = np.linalg.svd(M)
    return (U[:, :rank] * S[:rank]) @ Vh[:rank]


def _product(shared, prefix: str) -> np.ndarray:
    return shared[prefix + B].double().numpy() @ shared[prefix + A].double().numpy()


def _state(seed: int = 0, round_: int = 3, b_scale: float = 1.0) -> GlobalState:
    gen = torch.Generator().manual_seed(seed)
    shared = {}
    for p in PAIRS:
        shared[p + A] = torch.randn(R_G, D_IN, generator=gen)
        shared[p + B] = torch.randn(D_OUT, R_G, generator=gen) * b_scale
    shared[BIAS] = torch.randn(D_OUT, generator=gen)
    return GlobalState(round=round_, vectors={"shared": TaskVector(shared), head_name("x"): TaskVector(
        {"w": torch.ones(3)})}, scalars={"allocation": {str(c): ["x"] for c in range(4)}})


# -- the spectrum readings ------------------------------------------------------------------------------

def test_spectrum_readings_equal_numpy():
    rng = np.random.default_rng(0)
    M = rng.normal(size=(12, 5)) @ np.diag([5.0, 2.0, 1.0, 0.1, 0.01]) @ rng.normal(size=(5, 10))
    S = np.linalg.svd(M, compute_uv=False)
    p = S / S.sum()
    energy = np.cumsum(S**2) / (S**2).sum()
    S_t = torch.from_numpy(S)
    assert effective_rank(S_t) == pytest.approx(math.exp(-(p[p > 0] * np.log(p[p > 0])).sum()), rel=1e-12)
    assert energy_rank(S_t) == int(np.argmax(energy >= 0.99)) + 1 == 3
    assert energy_rank(S_t, 0.5) == 1 and energy_rank(S_t, 1.0) == 5
    assert tail_energy(S_t, 2) == pytest.approx(np.linalg.norm(M - _best(M, 2)) ** 2, rel=1e-9)
    assert effective_rank(torch.ones(4)) == pytest.approx(4.0) and effective_rank(torch.tensor([3.0])) == 1.0
    assert effective_rank(torch.zeros(0)) == 0.0 and energy_rank(torch.zeros(3)) == 0


# -- the downlink: the global product truncated to each client's rank ------------------------------------

def test_clients_are_given_ranks_one_each_or_cycled():
    assert [client_rank(RANKS, c) for c in range(7)] == [2, 4, 8, 2, 4, 8, 2]
    assert [client_rank([16, 4, 8, 4], c) for c in range(4)] == [16, 4, 8, 4]


@pytest.mark.parametrize("client", [0, 1, 2, 3])
def test_each_client_receives_the_best_approximation_of_the_global_product_at_its_rank(client):
    """The hand computation: the received factors' product is numpy's best rank-r_c approximation of the
    global B·A (Eckart-Young), in balanced factors; a rank-r_g client gets the global factors themselves."""
    state = _state()
    strategy = build_strategy("fedavg", HETERO)
    down = strategy.downlink(state, client, ["x"])
    rank = RANKS[client % 3]
    shared, own = state.vectors["shared"], down["shared"]
    assert list(own) == list(shared) and torch.equal(own[BIAS], shared[BIAS])
    assert torch.equal(down[head_name("x")]["w"], state.vectors[head_name("x")]["w"])
    for p in PAIRS:
        assert own[p + A].shape == (rank, D_IN) and own[p + B].shape == (D_OUT, rank)
        assert own[p + A].dtype == torch.float32
        expected = _best(_product(shared, p), rank)
        np.testing.assert_allclose(_product(own, p), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
        if rank == R_G:
            assert torch.equal(own[p + A], shared[p + A]) and torch.equal(own[p + B], shared[p + B])
        else:  # balanced, as FlexLoRA splits them: BᵀB = AAᵀ = diag(S_r)
            Bc, Ac = own[p + B].double(), own[p + A].double()
            torch.testing.assert_close(Bc.T @ Bc, Ac @ Ac.T, rtol=1e-4, atol=1e-4)
    assert strategy.update_templates(state, client, ["x"])["shared"][PAIRS[0] + A].shape == (rank, D_IN)


def test_components_the_product_lacks_are_sent_as_lora_init():
    """At the start B = 0, so every truncation is 0: the client's A rows are LoRA's init (kaiming-uniform,
    seeded), B's columns zero. After a round of rank 3 in rank 8, a rank-4 client gets the 3 components and
    one fresh init component: the product is the global one exactly either way."""
    start = _state(round_=0, b_scale=0.0)
    own = truncate_shared(start.vectors["shared"], 2, 0)
    again = truncate_shared(start.vectors["shared"], 2, 0)
    for p in PAIRS:
        assert not own[p + B].any() and own[p + A].shape == (2, D_IN)
        assert all(own[p + A][k].any() for k in range(2)) and own[p + A].abs().max() <= 1 / math.sqrt(D_IN)
        assert torch.equal(own[p + A], again[p + A])
    assert not torch.equal(own[PAIRS[0] + A], own[PAIRS[1] + A])
    state = _state(round_=5)
    shared = dict(state.vectors["shared"])
    for p in PAIRS:  # rank 3: components 3.. zero in both factors (what a rank-deficient round leaves)
        shared[p + A][3:] = 0
        shared[p + B][:, 3:] = 0
    own = truncate_shared(TaskVector(shared), 4, 5)
    for p in PAIRS:
        np.testing.assert_allclose(_product(own, p), _product(shared, p), atol=1e-5)
        assert own[p + A][3].any() and not own[p + B][:, 3].any()
        assert all(own[p + A][k].any() and own[p + B][:, k].any() for k in range(3))


# -- the server step -----------------------------------------------------------------------------------

def _mixed_updates(state, strategy, seed: int = 1) -> list[ClientUpdate]:
    """Clients 0..3 (ranks 2, 4, 8, 2): a change of their own downlink's rank-r_c factors and of the bias."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c, n in enumerate([10, 30, 20, 40]):
        down = strategy.downlink(state, c, ["x"])["shared"]
        change = TaskVector({k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in down.items()})
        out.append(ClientUpdate(c, state.round + 1, {"shared": change, head_name("x"): TaskVector(
            {"w": torch.randn(3, generator=gen)})}, {"x": n}))
    return out


@pytest.mark.parametrize("server_lr,forget", [(1.0, None), (0.5, None), (1.0, [1])])
def test_the_server_step_is_the_dense_flexlora_step_with_its_spectrum(server_lr, forget):
    """Each pair: numpy's best rank-r_g approximation of M = G + η·Σ w_c σ_c (P_c − G)/Σ w_c, P_c the product of
    client c's downlink plus its change (σ_c = −1 for a forgotten client); the bias and the head FedAvg's
    means; the record's residuals at r_g and each client rank, and M's effective ranks, as numpy gives them."""
    state = _state(2)
    strategy = build_strategy("fedavg", {**HETERO, "server_lr": server_lr, "forget_clients": forget})
    updates = _mixed_updates(state, strategy)
    new = strategy.server_aggregate(state, updates)
    weights = np.array([u.total_samples for u in updates], dtype=float)
    signs = np.array([-1.0 if u.client_id in (forget or []) else 1.0 for u in updates])
    shared = new.vectors["shared"]
    assert list(shared) == list(state.vectors["shared"]) and new.round == state.round + 1
    spectra = []
    for p in PAIRS:
        G = _product(state.vectors["shared"], p)
        products = []
        for u in updates:
            down = strategy.downlink(state, u.client_id, ["x"])["shared"]
            products.append(_product(down + u.vectors["shared"], p))
        M = G + server_lr * sum(w * s * (P - G) for w, s, P in zip(weights, signs, products)) / weights.sum()
        assert shared[p + A].shape == (R_G, D_IN)
        np.testing.assert_allclose(_product(shared, p), _best(M, R_G), rtol=0, atol=1e-4 * np.abs(M).max())
        spectra.append(np.linalg.svd(M, compute_uv=False))
    bias = state.vectors["shared"][BIAS] + server_lr * sum(
        w * s * u.vectors["shared"][BIAS].double() for w, s, u in zip(weights, signs, updates)).float() / weights.sum()
    torch.testing.assert_close(shared[BIAS], bias, rtol=1e-6, atol=1e-6)
    head = state.vectors[head_name("x")]["w"] + server_lr * sum(
        w * s * u.vectors[head_name("x")]["w"] for w, s, u in zip(weights, signs, updates)) / weights.sum()
    torch.testing.assert_close(new.vectors[head_name("x")]["w"], head.float(), rtol=1e-6, atol=1e-6)

    total = sum((S**2).sum() for S in spectra)
    d = aggregation_diagnostics(new)
    assert set(d) == {"lora_truncation_residual", "lora_rank_residuals", "lora_effective_rank", "lora_rank_99",
                      "lora_client_ranks"}
    for r in (2, 4, 8):
        assert d["lora_rank_residuals"][str(r)] == pytest.approx(
            math.sqrt(sum((S[r:] ** 2).sum() for S in spectra) / total), rel=1e-6)
    assert d["lora_truncation_residual"] == d["lora_rank_residuals"]["8"] > 0
    assert d["lora_rank_residuals"]["2"] > d["lora_rank_residuals"]["4"] > d["lora_rank_residuals"]["8"]
    entropy = [math.exp(-(q * np.log(q)).sum()) for q in (S / S.sum() for S in spectra)]
    assert d["lora_effective_rank"] == pytest.approx(np.mean(entropy), rel=1e-6)
    assert d["lora_rank_99"] == np.mean([np.argmax(np.cumsum(S**2) / (S**2).sum() >= 0.99) + 1 for S in spectra])
    assert d["lora_client_ranks"] == {"0": 2, "1": 4, "2": 8, "3": 2}
    json.dumps(d)  # a metrics record


def test_a_single_rank_list_is_the_uniform_product_step():
    state = _state(4)
    uniform = build_strategy("fedavg", {"lora_aggregation": "product"})
    listed = build_strategy("fedavg", {"lora_aggregation": "product", "lora_ranks": [R_G]})
    updates = _mixed_updates(state, uniform)
    a, b = uniform.server_aggregate(state, updates), listed.server_aggregate(state, updates)
    assert all(torch.equal(a.vectors[n][k], b.vectors[n][k]) for n in a.vectors for k in a.vectors[n])
    assert aggregation_diagnostics(a)["lora_truncation_residual"] == aggregation_diagnostics(b)[
        "lora_truncation_residual"]


# -- runs ----------------------------------------------------------------------------------------------

def _downlinks(run_dir: Path, round_: int) -> dict[int, TaskVector]:
    folder = run_dir / "payloads" / f"round_{round_}"
    return {int(p.name.split(".")[0].split("_")[1]): unpack_vectors(TaskVector.from_bytes(p.read_bytes(), source=""))[
        "shared"] for p in folder.glob("client_*.downlink.safetensors")}


def test_a_mixed_rank_run_sends_each_rank_its_truncation_records_the_spectrum_and_exports_at_the_global_rank(
        tiny_bert_dir, tiny_tasks_dir, tmp_path):
    from hf_fedtask.engine.inprocess import Federation
    from hf_fedtask.engine.run import run
    from hf_fedtask.engine.run_folder import restore

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", rounds=2, local_steps=2, lora_r=R_G,
                         save_payloads=True, strategy_options=HETERO)
    states = []
    run(config, callbacks=[lambda ctx: states.append(ctx.state)])
    out = Path(config.output_dir)
    records = read_records(out)
    for r in records:
        d = r["aggregation"]
        assert set(d["lora_rank_residuals"]) == {"2", "4", "8"} and d["lora_client_ranks"] == {
            "0": 2, "1": 4, "2": 8, "3": 2}
        assert 0 < d["lora_truncation_residual"] < d["lora_rank_residuals"]["4"] < d["lora_rank_residuals"]["2"] < 1
        assert 1 <= d["lora_effective_rank"] and 1 <= d["lora_rank_99"] <= 2 + 4 + 8 + 2
    # round 2's downlinks are the state after round 1 truncated to each client's rank (numpy's SVD)
    global_ = states[0].vectors["shared"]
    for client, own in _downlinks(out, 2).items():
        rank = RANKS[client % 3]
        for a_key, b_key in lora_pairs(global_):
            M = global_[b_key].double().numpy() @ global_[a_key].double().numpy()
            got = own[b_key].double().numpy() @ own[a_key].double().numpy()
            assert own[a_key].shape[0] == rank
            np.testing.assert_allclose(got, _best(M, rank), rtol=0, atol=1e-5 * np.abs(M).max())
    # a client uploads the change of its own rank's factors
    uplink = (out / "payloads" / "round_1" / "client_1.uplink.safetensors").read_bytes()
    sent = unpack_vectors(TaskVector.from_bytes(uplink, source=""))["shared"]
    assert {sent[a_key].shape[0] for a_key, _ in lora_pairs(sent)} == {4}
    assert records[0]["bytes_per_client"]["0"]["params_downlink"] < records[0]["bytes_per_client"]["2"][
        "params_downlink"]

    adapter = out / "adapters" / "colors"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == R_G
    fed = Federation(config)
    state, _, _ = restore(fed.env, out, config.fingerprint())
    assert_stock_reload_matches(fed, state, tiny_bert_dir, adapter)


def test_a_client_trains_in_its_own_adapter_at_the_servers_scaling(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    from hf_fedtask.engine.inprocess import Federation

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", lora_r=R_G, lora_alpha=16,
                         strategy_options=HETERO)
    fed = Federation(config)
    state, record = fed.run_round(fed.initial_state(), 1)
    peft = fed.host.model.peft_config
    assert sorted(peft) == ["default", "lora_rank_2", "lora_rank_4"]
    for name, r in (("lora_rank_2", 2), ("lora_rank_4", 4), ("default", 8)):
        assert peft[name].r == r and peft[name].lora_alpha / peft[name].r == 2.0  # the server's scaling α/r
    assert fed.host.model.active_adapter == "default"
    trainable = [n for n, p in fed.host.model.named_parameters() if p.requires_grad]
    assert trainable and not [n for n in trainable if "lora_rank_" in n]  # the clients' adapters rest
    assert [k for k in fed.host.trainable_by_name() if "lora_A" in k] and all(
        p.shape[0] == R_G for k, p in fed.host.trainable_by_name().items() if "lora_A" in k)
    assert state.vectors["shared"][lora_pairs(state.vectors["shared"])[0][0]].shape[0] == R_G


def test_a_single_rank_list_runs_as_the_uniform_product_run(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    from hf_fedtask.engine.run import run

    runs = {}
    for name, options in (("uniform", {"lora_aggregation": "product"}),
                          ("listed", {"lora_aggregation": "product", "lora_ranks": [R_G]})):
        config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / name, local_steps=2, lora_r=R_G,
                             export=False, strategy_options=options)
        run(config)
        runs[name] = load_file(Path(config.output_dir) / "checkpoint.safetensors")
    a, b = runs["uniform"], runs["listed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_mixed_rank_run_over_flower_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    pytest.importorskip("flwr")
    from test_flower import assert_same_run, drive, tiny

    from hf_fedtask.engine.run import run

    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", options=HETERO, lora_r=R_G)
    grid = drive(config)
    reference = RunConfig.from_dict({**config.to_dict(), "output_dir": str(tmp_path / "reference")})
    run(reference)
    assert_same_run(tmp_path / "reference", tmp_path / "flower", grid.stores())
    assert all(r["aggregation"]["lora_client_ranks"] for r in read_records(tmp_path / "flower"))


def test_a_mixed_rank_run_on_a_causal_lm_exports_at_the_global_rank(tiny_tasks_dir, tmp_path):
    from hf_fedtask.engine.run import run

    config = make_config(None, tiny_tasks_dir, tmp_path / "run", base_model="hf-fedtask/tiny-llama",
                         base_model_id=None, max_length=128, lora_r=R_G, strategy_options={
                             "lora_aggregation": "product", "lora_ranks": [4, 8]})
    results = run(config)
    assert all(0 <= r["accuracy"] <= 1 for r in results["tasks"].values())
    (record,) = read_records(Path(config.output_dir))
    assert record["aggregation"]["lora_client_ranks"] == {"0": 4, "1": 8, "2": 4, "3": 8}
    adapter = Path(config.output_dir) / "adapters" / "moods"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == R_G
    weights = load_file(adapter / "adapter_model.safetensors")
    assert {w.shape[0] for k, w in weights.items() if "lora_A" in k} == {R_G}


# -- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["matu", "ntkfedavg", "ntkfedprox", "scaffold", "fedyolo", "fedper", "tct"])
def test_strategies_that_cannot_take_mixed_ranks_refuse_the_option(name, tiny_tasks_dir):
    with pytest.raises(ConfigError, match=f"^strategy '{name}' does not support option 'lora_ranks' "
                                          r"\(an option of fedavg, fedprox\)") as err:
        RunConfig(strategy=name, strategy_options={"lora_ranks": [4, 8]}, suite=None, tasks=list(tiny_tasks_dir))
    assert "\n" not in str(err.value)


def test_bad_rank_settings_are_one_line_errors(tiny_tasks_dir):
    with pytest.raises(ConfigError, match="lora_ranks needs lora_aggregation product"):
        build_strategy("fedavg", {"lora_ranks": [4, 8]})
    with pytest.raises(ConfigError, match="lora_ranks: give at least one rank"):
        build_strategy("fedprox", {"lora_aggregation": "product", "lora_ranks": []})
    with pytest.raises(ConfigError, match=r"lora_ranks: must be >= 1, got \[4, 0\]"):
        build_strategy("fedavg", {"lora_aggregation": "product", "lora_ranks": [4, 0]})
    cases = [({"lora_r": 8}, [4, 16], "the largest client rank 16 is above lora_r 8, the server's global rank: "
                                     "set lora_r >= 16"),
             ({"lora_r": 16, "num_clients": 2}, [4, 8, 16], "3 ranks for this run's 2 clients")]
    for overrides, ranks, says in cases:
        config = RunConfig(strategy="fedavg", strategy_options={"lora_aggregation": "product", "lora_ranks": ranks},
                           suite=None, tasks=list(tiny_tasks_dir), **overrides)
        with pytest.raises(ConfigError, match=says) as err:
            build_strategy("fedavg", config.strategy_options).check_run(config)
        assert "\n" not in str(err.value)


def test_the_cli_refuses_a_client_rank_above_the_global_one_before_anything_is_written(tiny_bert_dir,
                                                                                         tiny_tasks_dir, tmp_path,
                                                                                         capsys):
    out = tmp_path / "refused"
    argv = ["run", "--tasks", *tiny_tasks_dir, "--base-model", tiny_bert_dir, "--base-model-id", TINY_MODEL_ID,
            "--num-clients", "4", "--rounds", "1", "--lora-aggregation", "product", "--lora-ranks", "4", "16",
            "--output-dir", str(out)]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "lora_ranks: the largest client rank 16 is above lora_r 8" in errors[0]
    assert not out.exists()
