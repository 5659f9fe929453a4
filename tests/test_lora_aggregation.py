"""Exact LoRA aggregation (`lora_aggregation: product`) and the factor-averaging error (`factors`): the
low-rank math against dense hand computation, FedAvg's step on LoRA states, refusals, and a tiny run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from conftest import Crash, assert_stock_reload_matches, crash_after, make_config, read_records
from safetensors.torch import load_file

from hf_fedtask.config import RunConfig
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import weighted_average
from hf_fedtask.merge.lora_product import factor_step_error, lora_pairs, product_step, step_terms
from hf_fedtask.strategies import FedAvg, FedProx, GlobalState, build_strategy, head_name
from hf_fedtask.strategies.base import AggregatedState, aggregation_diagnostics
from hf_fedtask.strategies.fedavg import FedAvgConfig

D_OUT, D_IN = 12, 10
PAIRS = ("base_model.model.l0.attention.query", "base_model.model.l1.attention.value")
A, B = ".lora_A.weight", ".lora_B.weight"


def _factors(rank: int, d_out: int = D_OUT, d_in: int = D_IN, scale: float = 1.0):
    return torch.randn(d_out, rank, dtype=torch.float64) * scale, torch.randn(rank, d_in, dtype=torch.float64)


def _dense_step(start, clients, weights, scalings, scaling=1.0, server_lr=1.0, signs=None):
    """The exact step as a dense d_out×d_in matrix (tests only)."""
    signs = signs or [1.0] * len(clients)
    total = sum(weights)
    base = scaling * start[0] @ start[1] if start is not None else torch.zeros(D_OUT, D_IN, dtype=torch.float64)
    return base + server_lr * sum(w * s * (si * Bi @ Ai - base) for w, s, si, (Bi, Ai)
                                  in zip(weights, signs, scalings, clients)) / total


def _best_rank(M: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """The best rank-`rank` approximation by a dense SVD, and its relative residual."""
    U, S, Vh = torch.linalg.svd(M)
    approx = (U[:, :rank] * S[:rank]) @ Vh[:rank]
    return approx, float(S[rank:].square().sum().sqrt() / S.square().sum().sqrt())


# -- the math --------------------------------------------------------------------------------------

@pytest.mark.parametrize("server_lr,signs", [(1.0, None), (0.5, None), (1.0, [1.0, -1.0, 1.0])])
def test_product_step_is_the_best_rank_r_approximation_of_the_dense_mean(server_lr, signs):
    torch.manual_seed(0)
    start, clients, weights = _factors(4), [_factors(4) for _ in range(3)], [10.0, 30.0, 20.0]
    step = product_step(start, clients, weights, [2.0] * 3, rank=4, scaling=2.0, server_lr=server_lr, signs=signs)
    M = _dense_step(start, clients, weights, [2.0] * 3, 2.0, server_lr, signs)
    expected, residual = _best_rank(M, 4)
    assert step.B.shape == (D_OUT, 4) and step.A.shape == (4, D_IN) and step.B.dtype == torch.float64
    torch.testing.assert_close(2.0 * step.B @ step.A, expected, rtol=1e-10, atol=1e-10)
    assert step.residual == pytest.approx(residual, rel=1e-9) and 0 < step.residual < 1
    # balanced factors (FlexLoRA's split): BᵀB = AAᵀ = diag(S_r)/scaling
    torch.testing.assert_close(step.B.T @ step.B, step.A @ step.A.T, rtol=1e-9, atol=1e-9)


def test_product_step_is_exact_when_the_total_rank_fits():
    torch.manual_seed(1)
    clients, weights = [_factors(2), _factors(3)], [3.0, 5.0]
    start = _factors(8)  # server_lr 1: the start's own term cancels exactly and adds no rank
    step = product_step(start, clients, weights, [1.0, 1.0], rank=8, scaling=1.0)
    M = _dense_step(start, clients, weights, [1.0, 1.0])
    assert step.residual == 0.0 and step.discarded == 0.0
    torch.testing.assert_close(step.B @ step.A, M, rtol=1e-10, atol=1e-10)
    assert torch.all(step.B[:, 5:] == 0) and torch.all(step.A[5:] == 0)  # rank 5 in rank 8: zero padding
    assert len(step_terms(start, clients, weights, [1.0, 1.0])) == 2


@pytest.mark.parametrize("rslora", [False, True])
def test_mixed_ranks_each_with_its_own_scaling(rslora):
    """HetLoRA/FlexLoRA's setting: clients of rank 4, 8 and 16 (each ΔW_i = α/r_i·B_i·A_i, or α/√r_i with
    rsLoRA) aggregated into the server's rank 8, whose factors carry the server's scaling."""
    torch.manual_seed(2)
    alpha, ranks, weights = 16.0, (4, 8, 16), [5.0, 2.0, 3.0]
    scale = (lambda r: alpha / math.sqrt(r)) if rslora else (lambda r: alpha / r)
    clients = [_factors(r) for r in ranks]
    step = product_step(None, clients, weights, [scale(r) for r in ranks], rank=8, scaling=scale(8))
    M = sum(w * scale(r) * Bi @ Ai for w, r, (Bi, Ai) in zip(weights, ranks, clients)) / sum(weights)
    expected, residual = _best_rank(M, 8)
    torch.testing.assert_close(scale(8) * step.B @ step.A, expected, rtol=1e-10, atol=1e-10)
    assert step.residual == pytest.approx(residual, rel=1e-9)
    # and with a rank-8 start moved by half the mean change
    start = _factors(8)
    step = product_step(start, clients, weights, [scale(r) for r in ranks], rank=8, scaling=scale(8), server_lr=0.5)
    expected, residual = _best_rank(_dense_step(start, clients, weights, [scale(r) for r in ranks], scale(8), 0.5), 8)
    torch.testing.assert_close(scale(8) * step.B @ step.A, expected, rtol=1e-10, atol=1e-10)
    assert step.residual == pytest.approx(residual, rel=1e-9)


def test_product_step_returns_the_inputs_dtype():
    torch.manual_seed(3)
    clients = [tuple(t.float() for t in _factors(4)) for _ in range(2)]
    step = product_step(None, clients, [1.0, 1.0], [1.0, 1.0], rank=4, scaling=1.0)
    assert step.B.dtype == step.A.dtype == torch.float32


@pytest.mark.parametrize("server_lr,signs", [(1.0, None), (0.7, [1.0, -1.0, 1.0])])
def test_factor_error_equals_the_dense_computation(server_lr, signs):
    torch.manual_seed(4)
    start, clients, weights = _factors(4), [_factors(4) for _ in range(3)], [1.0, 2.0, 3.0]
    signs_ = signs or [1.0] * 3
    total = sum(weights)
    B_bar, A_bar = (start[j] + server_lr * sum(w * s * (f[j] - start[j]) for w, s, f in zip(weights, signs_, clients))
                    / total for j in (0, 1))
    error, target = factor_step_error(start, clients, weights, (B_bar, A_bar), server_lr=server_lr, signs=signs)
    M = _dense_step(start, clients, weights, [1.0] * 3, 1.0, server_lr, signs)
    assert target == pytest.approx(float(M.square().sum()), rel=1e-10)
    assert error == pytest.approx(float((M - B_bar @ A_bar).square().sum()), rel=1e-8)
    assert math.sqrt(error / target) > 0.01  # factor averaging is not exact on random factors


def test_lora_pairs_match_a_with_b_and_refuse_what_does_not_pair():
    t = torch.zeros
    state = {"m.q.lora_A.weight": t(4, 6), "m.q.lora_B.weight": t(5, 4), "m.q.lora_B.bias": t(5),
             "m.emb.lora_embedding_A": t(4, 30), "m.emb.lora_embedding_B": t(8, 4),
             "m.conv.lora_A.weight": t(4, 3, 3, 3), "m.conv.lora_B.weight": t(7, 4, 1, 1), "m.ia3_l": t(5)}
    assert lora_pairs(state) == [("m.q.lora_A.weight", "m.q.lora_B.weight"),
                                 ("m.emb.lora_embedding_A", "m.emb.lora_embedding_B"),
                                 ("m.conv.lora_A.weight", "m.conv.lora_B.weight")]
    assert lora_pairs({"m.ia3_l": t(5)}) == []
    with pytest.raises(ValueError, match="'m.q.lora_A.weight' has no partner 'm.q.lora_B.weight'"):
        lora_pairs({"m.q.lora_A.weight": t(4, 6)})
    with pytest.raises(ValueError, match="'m.q.lora_B.weight' has no A partner"):
        lora_pairs({"m.q.lora_B.weight": t(5, 4)})
    with pytest.raises(ValueError, match="do not chain"):
        lora_pairs({"m.q.lora_A.weight": t(4, 6), "m.q.lora_B.weight": t(5, 3)})


# -- FedAvg's step on a LoRA state -----------------------------------------------------------------

def _lora_vector(gen: torch.Generator, rank: int = 4, b_scale: float = 1.0) -> TaskVector:
    out = {}
    for p in PAIRS:
        out[p + A] = torch.randn(rank, D_IN, generator=gen)
        out[p + B] = torch.randn(D_OUT, rank, generator=gen) * b_scale
    out["base_model.model.pooler.dense.bias"] = torch.randn(D_OUT, generator=gen)  # not a LoRA factor
    return TaskVector(out)


def _lora_round(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    state = GlobalState(round=2, vectors={"shared": _lora_vector(gen), head_name("x"): TaskVector({"w": torch.ones(3)}),
                                          head_name("y"): TaskVector({"w": torch.zeros(3)})},
                        scalars={"allocation": {"0": ["x"], "1": ["x", "y"], "2": ["y"]}})
    samples = [{"x": 10}, {"x": 30, "y": 20}, {"y": 40}]
    updates = [ClientUpdate(c, 3, {"shared": _lora_vector(gen, b_scale=0.3),
                                   **{head_name(t): TaskVector({"w": torch.randn(3, generator=gen)}) for t in n}}, n)
               for c, n in enumerate(samples)]
    return state, updates


def _dense_pairs(state, updates, server_lr=1.0, signs=None):
    """Per pair: the exact step M (dense, float64), and the factor means' product B̄·Ā."""
    signs = signs or [1.0] * len(updates)
    weights = [u.total_samples for u in updates]
    out = {}
    for p in PAIRS:
        g = state.vectors["shared"]
        start = (g[p + B].double(), g[p + A].double())
        clients = [((g[p + B] + u.vectors["shared"][p + B]).double(), (g[p + A] + u.vectors["shared"][p + A]).double())
                   for u in updates]
        out[p] = _dense_step(start, clients, weights, [1.0] * len(updates), 1.0, server_lr, signs)
    return out


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavg_default_is_unchanged_and_reports_the_factor_error(server_lr):
    """The default (`factors`) gives the plain sample-weighted mean bit for bit, and reports
    ‖M − B̄·Ā‖_F / ‖M‖_F over both pairs, as the dense computation gives it."""
    state, updates = _lora_round()
    new = FedAvg(server_lr=server_lr).server_aggregate(state, updates)
    weights = [u.total_samples for u in updates]
    plain = state.vectors["shared"] + server_lr * weighted_average([u.vectors["shared"] for u in updates], weights)
    assert list(new.vectors["shared"]) == list(plain)
    assert all(torch.equal(new.vectors["shared"][k], plain[k]) for k in plain)
    head_x = state.vectors[head_name("x")] + server_lr * weighted_average(
        [u.vectors[head_name("x")] for u in updates[:2]], [10, 30])
    assert torch.equal(new.vectors[head_name("x")]["w"], head_x["w"])
    dense = _dense_pairs(state, updates, server_lr)
    error = sum(float((M - new.vectors["shared"][p + B].double() @ new.vectors["shared"][p + A].double())
                      .square().sum()) for p, M in dense.items())
    total = sum(float(M.square().sum()) for M in dense.values())
    diagnostics = aggregation_diagnostics(new)
    assert set(diagnostics) == {"lora_factor_error"}
    assert diagnostics["lora_factor_error"] == pytest.approx(math.sqrt(error / total), rel=1e-6)


@pytest.mark.parametrize("server_lr,forget", [(1.0, None), (0.5, None), (1.0, [1])])
def test_fedavg_product_step_on_a_lora_state(server_lr, forget):
    """`product`: each pair is the best rank-r approximation of the exact step (a forgotten client's change
    of B·A negated); other keys and the heads are FedAvg's means; the residual is over both pairs."""
    state, updates = _lora_round(1)
    strategy = build_strategy("fedavg", {"lora_aggregation": "product", "server_lr": server_lr,
                                         "forget_clients": forget})
    new = strategy.server_aggregate(state, updates)
    signs = [-1.0 if u.client_id in (forget or []) else 1.0 for u in updates]
    factors = FedAvg(server_lr=server_lr, forget_clients=forget).server_aggregate(state, updates)
    shared = new.vectors["shared"]
    assert list(shared) == list(state.vectors["shared"])
    discarded = total = 0.0
    for p, M in _dense_pairs(state, updates, server_lr, signs).items():
        expected, _ = _best_rank(M, 4)
        assert shared[p + A].shape == (4, D_IN) and shared[p + B].dtype == torch.float32
        torch.testing.assert_close(shared[p + B].double() @ shared[p + A].double(), expected, rtol=1e-4, atol=1e-4)
        S = torch.linalg.svdvals(M)
        discarded, total = discarded + float(S[4:].square().sum()), total + float(S.square().sum())
    key = "base_model.model.pooler.dense.bias"
    assert torch.equal(shared[key], factors.vectors["shared"][key])
    for name in (head_name("x"), head_name("y")):
        assert torch.equal(new.vectors[name]["w"], factors.vectors[name]["w"])
    assert aggregation_diagnostics(new) == {"lora_truncation_residual": pytest.approx(math.sqrt(discarded / total),
                                                                                        rel=1e-6)}
    assert new.round == state.round + 1 and new.scalars == state.scalars


def test_fedprox_offers_product_and_diagnostics_stay_off_the_next_state():
    state, updates = _lora_round(2)
    new = FedProx(lora_aggregation="product", proximal_mu=0.1).server_aggregate(state, updates)
    assert isinstance(new, AggregatedState) and "lora_truncation_residual" in new.diagnostics
    assert aggregation_diagnostics(new.next({})) == {} and aggregation_diagnostics(state) == {}


def test_a_state_without_lora_factors_has_no_metric_and_product_refuses_it():
    head = {head_name("x"): TaskVector({"w": torch.zeros(2)})}
    state = GlobalState(round=0, vectors={"shared": TaskVector({"m.ia3_l": torch.ones(4)}), **head},
                        scalars={"allocation": {"0": ["x"]}})
    updates = [ClientUpdate(0, 1, {"shared": TaskVector({"m.ia3_l": torch.full((4,), 0.5)}), **head}, {"x": 4})]
    new = FedAvg().server_aggregate(state, updates)
    assert aggregation_diagnostics(new) == {} and torch.equal(new.vectors["shared"]["m.ia3_l"], torch.full((4,), 1.5))
    with pytest.raises(ConfigError, match=r"^lora_aggregation product: the shared modules hold no LoRA factors"):
        FedAvg(lora_aggregation="product").server_aggregate(state, updates)


def test_unpaired_lora_factors_are_one_line_errors():
    shared = TaskVector({"m.q.lora_A.weight": torch.ones(2, 3)})
    head = {head_name("x"): TaskVector({"w": torch.zeros(2)})}
    state = GlobalState(round=0, vectors={"shared": shared, **head}, scalars={"allocation": {"0": ["x"]}})
    updates = [ClientUpdate(0, 1, {"shared": shared, **head}, {"x": 4})]
    for mode in ("factors", "product"):
        with pytest.raises(ConfigError, match="has no partner") as err:
            FedAvg(lora_aggregation=mode).server_aggregate(state, updates)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["scaffold", "ntkfedavg", "ntkfedprox"])
def test_strategies_without_the_product_do_not_offer_it(name, tiny_tasks_dir):
    with pytest.raises(ConfigError, match=f"strategy '{name}' does not support option 'lora_aggregation' "
                                          r"\(an option of fedavg, fedprox\)"):
        build_strategy(name, {"lora_aggregation": "product"})
    with pytest.raises(ConfigError, match="'lora_aggregation'"):
        RunConfig(strategy=name, strategy_options={"lora_aggregation": "product"}, suite=None,
                  tasks=list(tiny_tasks_dir))
    if name != "scaffold":  # NTKFedAvg's clients train a model affine in A and B: it averages factors
        assert build_strategy(name).lora_aggregation == "factors"


def test_product_refuses_task_vector_tracking_and_non_lora_methods(tiny_tasks_dir):
    with pytest.raises(ConfigError, match="track_task_vectors needs lora_aggregation factors"):
        build_strategy("fedavg", {"lora_aggregation": "product", "track_task_vectors": True})
    with pytest.raises(ConfigError, match="lora_aggregation: must be one of factors, product"):
        build_strategy("fedprox", {"lora_aggregation": "dense"})
    for method in ("ia3", "full", "bottleneck"):
        config = RunConfig(strategy="fedavg", strategy_options={"lora_aggregation": "product"}, suite=None,
                           tasks=list(tiny_tasks_dir), peft_method=method)
        with pytest.raises(ConfigError, match=f"peft_method '{method}' has no LoRA factors") as err:
            build_strategy("fedavg", config.strategy_options).check_run(config)
        assert "\n" not in str(err.value)
    build_strategy("fedavg", {}).check_run(RunConfig(suite=None, tasks=list(tiny_tasks_dir), peft_method="ia3"))


def test_family_members_without_the_option_aggregate_factors():
    """A FedAvg-family config without the option (as NTKFedAvg's) aggregates factors, as before."""
    state, updates = _lora_round(3)

    class Plain(FedAvg):
        config_class = FedAvgConfig

    new = Plain(FedAvgConfig()).server_aggregate(state, updates)
    assert "lora_factor_error" in aggregation_diagnostics(new)


# -- a run -------------------------------------------------------------------------------------------

def test_a_product_run_finishes_resumes_exactly_and_exports_stock_peft_adapters(tiny_bert_dir, tiny_tasks_dir,
                                                                                  tmp_path):

    from hf_fedtask.engine.inprocess import Federation
    from hf_fedtask.engine.run import run
    from hf_fedtask.engine.run_folder import restore

    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "straight", rounds=2, local_steps=2,
                         strategy_options={"lora_aggregation": "product"})
    run(config)
    straight = Path(config.output_dir)
    records = read_records(straight)
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert set(r["aggregation"]) == {"lora_truncation_residual"} and 0 <= r["aggregation"][
            "lora_truncation_residual"] < 1
    assert records[1]["aggregation"]["lora_truncation_residual"] > 0  # 4 clients of rank 8 + the start in rank 8

    killed = dataclasses.replace(config, output_dir=str(tmp_path / "resumed"))
    with pytest.raises(Crash):
        run(killed, callbacks=[crash_after(1)])
    run(killed, resume=True)
    without_time = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in read_records(Path(killed.output_dir))] \
        == without_time
    a, b = (load_file(Path(d) / "checkpoint.safetensors") for d in (straight, killed.output_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    fed = Federation(config)
    state, _, _ = restore(fed.env, straight, config.fingerprint())
    shared = state.vectors["shared"]
    pairs = lora_pairs(shared)
    assert pairs and all(shared[a_key].shape[0] == config.lora_r for a_key, _ in pairs)
    assert_stock_reload_matches(fed, state, tiny_bert_dir, straight / "adapters" / "colors")


def test_a_default_fedavg_run_records_the_factor_error(finished_fedavg, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """One local step from LoRA's init (B = 0) moves B alone, so every client keeps A and averaging the
    factors is exact (up to float32 rounding); with more steps A moves too and the error shows."""
    from hf_fedtask.engine.run import run

    (record,) = read_records(finished_fedavg)  # 1 round, 1 local step
    assert set(record["aggregation"]) == {"lora_factor_error"}
    assert 0 <= record["aggregation"]["lora_factor_error"] < 1e-6
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", local_steps=3, export=False)
    run(config)
    (record,) = read_records(Path(config.output_dir))
    assert 1e-4 < record["aggregation"]["lora_factor_error"] < 1


def test_a_product_run_over_flower_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """The Flower engine runs the same server step: same tensors, same records (the residual included)."""
    pytest.importorskip("flwr")
    from test_flower import assert_same_run, drive, tiny

    from hf_fedtask.engine.run import run

    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", options={"lora_aggregation": "product"})
    grid = drive(config)
    reference = RunConfig.from_dict({**config.to_dict(), "output_dir": str(tmp_path / "reference")})
    run(reference)
    assert_same_run(tmp_path / "reference", tmp_path / "flower", grid.stores())
    assert all("lora_truncation_residual" in r["aggregation"] for r in read_records(tmp_path / "flower"))
