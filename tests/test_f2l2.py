"""F²L²: the Gauss-Newton product and the CG solve against a direct solve, the backdoor protocol's
data, and the whole path on real images (scikit-learn's digits, the paper's MLP): the backdoor is
learned, removed on the server with no client message (BSR at the retraining level, clean
accuracy within a few points of it), and the removed model exported and reloaded; plus the
settings F²L² refuses."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import Crash, crash_after
from datasets import concatenate_datasets
from safetensors import safe_open

from hf_fedtask.cli import main
from hf_fedtask.client.objectives import AnchoredRidge
from hf_fedtask.config import RunConfig
from hf_fedtask.core.state import (
    CURVATURE_GRAM,
    SERVER_CURVATURE,
    SHARED,
    GlobalState,
    curvature_name,
    gradient_name,
    head_name,
)
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.data import load_task
from hf_fedtask.data.backdoor import backdoor_test_set, inside_spread, poisoned, within_goal
from hf_fedtask.engine import run as engine_run
from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import open_finished_run
from hf_fedtask.engine.transport import InProcessTransport
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.export.linearized import load_linearized
from hf_fedtask.model.newton import (
    GaussNewton,
    JacobianGaussNewton,
    LowRankGaussNewton,
    SpectralPreconditioner,
    conjugate_gradient,
    curvature_factor,
    data_gradient,
    hessian,
    largest_eigenvalue,
    objective_minimizer,
    solve_within_radius,
)
from hf_fedtask.strategies.base import task_model, task_point
from hf_fedtask.strategies.f2l2 import COMPLETE_TAIL, F2L2, RemovalOptions
from hf_fedtask.workflows.unlearn import REMOVED_MODEL, remove_client

DIGITS = dict(tasks=["digits"], suite=None, base_model="hf-fedtask/small-mlp", peft_method="full", batch_size=32,
              learning_rate=3e-4, lr_scheduler="constant", eval_batch_size=512, seed=0)
# measured: 3 clients, 11 rounds (10 training + the gradient round), 3 local epochs: BSR 0.99 after training
BACKDOOR = dict(DIGITS, num_clients=3, rounds=11, local_epochs=3.0, backdoor_client=0, backdoor_trigger=3,
                export=True, strategy="f2l2", strategy_options={"pretrain_epochs": 20})


def _jacobian(model, inputs) -> torch.Tensor:
    """(n·C, P) Jacobian of the logits in the trainable parameters, one backward pass per row."""
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(**inputs).logits
    rows = []
    for i in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            grads = torch.autograd.grad(logits[i, c], params, retain_graph=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def test_gauss_newton_products_and_cg_equal_a_direct_solve():
    """H·v from jvp + vjp equals (2/n)·JᵀJ·v with J built row by row, and CG's solution of
    (H + λI)·x = g equals the direct one (Woodbury: P is large, n·C small)."""
    env = Environment(RunConfig(**DIGITS, num_clients=2, strategy="f2l2"))
    task = env.tasks[0].name
    point = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task).select(range(6))
    with env.host.loaded(point) as model:
        model.eval()
        inputs = {k: v for k, v in env.host.inputs.collator([data[i] for i in range(len(data))]).items()
                  if k != "labels"}
        jac = _jacobian(model, inputs).double()
        params = env.host.trainable_by_name()
        order = [k for k, p in params.items()]  # the live order of model.parameters() by saved name
    assert sorted(order) == sorted(point)
    gen = torch.Generator().manual_seed(0)
    v = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in point.items()})
    flat = lambda tv: torch.cat([tv[k].reshape(-1).double() for k in order])  # noqa: E731
    n, lam = len(data), 0.5
    with GaussNewton(env.host, point, data, batch_size=4) as hessian:
        hv = hessian(v)
        torch.testing.assert_close(flat(hv), 2 / n * jac.T @ (jac @ flat(v)), rtol=1e-4, atol=1e-6)
        g = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in point.items()})
        x, info = conjugate_gradient(hessian, g, damping=lam, iterations=300, tolerance=1e-7)
    b = flat(g)  # (2/n·JᵀJ + λI)⁻¹·b = (b − Jᵀ(λn/2·I + JJᵀ)⁻¹J·b)/λ
    direct = (b - jac.T @ torch.linalg.solve(lam * n / 2 * torch.eye(len(jac), dtype=torch.float64) + jac @ jac.T,
                                             jac @ b)) / lam
    assert info.relative_residual < 1e-5
    torch.testing.assert_close(flat(x), direct, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("model", ["mlp", "lora"])
def test_the_jacobian_hessian_is_the_matrix_free_one(model, tiny_bert_dir, tiny_tasks_dir):
    """`hessian` forms J (n·C × P) for LoRA on a frozen encoder when it fits its byte budget and stays
    matrix-free otherwise and for a model trained in full; both operators give the same H·v, on the MLP and
    on LoRA + head of a BERT (padded texts of different lengths), and the formed J equals the one built row
    by row."""
    if model == "mlp":
        env = Environment(RunConfig(**DIGITS, num_clients=2, strategy="f2l2"))
    else:
        env = Environment(RunConfig(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                                    peft_method="lora", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=2,
                                    max_length=16, min_samples=4))
    task = env.tasks[0].name
    gen = torch.Generator().manual_seed(0)
    start = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    point = start + TaskVector({k: 0.05 * torch.randn(t.shape, generator=gen) for k, t in start.items()})  # B ≠ 0
    data = env.test_data(task).select(range(6))
    v = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in point.items()})
    picked = hessian(env.host, point, data, batch_size=4)
    if model == "mlp":  # trained in full, C·P = 10·N: the matrix-free product is the cheaper one
        assert isinstance(picked, GaussNewton)
        formed, free = JacobianGaussNewton(env.host, point, data, outputs=10), picked
    else:  # LoRA on a frozen encoder: J is formed, unless it would exceed the byte budget
        formed, free = picked, hessian(env.host, point, data, 4, max_bytes=1000)
        assert isinstance(formed, JacobianGaussNewton) and isinstance(free, GaussNewton)
    with free as products:
        want = products(v)
    with formed as products:
        got = products(v)
        with env.host.loaded(point) as live:
            live.eval()
            inputs = {k: t for k, t in env.host.inputs.collator([data[i] for i in range(len(data))]).items()
                      if k != "labels"}
            rows = _jacobian(live, inputs)  # rows (sample, class), columns in the live parameters' order
            order = list(env.host.trainable_by_name())
        sizes = [point[k].numel() for k in order]
        by_name = dict(zip(order, rows.split(sizes, dim=1)))
        reference = torch.cat([by_name[k] for k in products.keys], dim=1)  # columns in saved-name order
        n, classes = len(data), rows.shape[0] // len(data)
        reordered = reference.reshape(n, classes, -1).transpose(0, 1).reshape(n * classes, -1)  # rows (class, sample)
        torch.testing.assert_close(products.jacobian, reordered, rtol=1e-4, atol=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5 * float(want[k].abs().max()), msg=k)


def test_lanczos_finds_the_largest_eigenvalue_of_the_gauss_newton_hessian():
    """λ_max of H = (2/n)·JᵀJ by Lanczos over the jvp/vjp products equals torch.linalg.eigvalsh of the matrix
    formed explicitly (through its Gram form (2/n)·JJᵀ, which has the same non-zero eigenvalues: P ≈ 84,000
    is too large for a P × P matrix); and on an explicit matrix with 200 evenly spaced eigenvalues, where the
    Rayleigh quotient of plain power iteration is still 0.5% below λ_max after 60 products."""
    env = Environment(RunConfig(**DIGITS, num_clients=2, strategy="f2l2"))
    task = env.tasks[0].name
    point = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task).select(range(8))
    with env.host.loaded(point) as model:
        model.eval()
        inputs = {k: v for k, v in env.host.inputs.collator([data[i] for i in range(len(data))]).items()
                  if k != "labels"}
        jac = _jacobian(model, inputs).double()
    exact = float(torch.linalg.eigvalsh(2 / len(data) * jac @ jac.T)[-1])
    with GaussNewton(env.host, point, data, batch_size=4) as hessian:
        estimate, info = largest_eigenvalue(hessian, point, iterations=30)
    assert estimate == pytest.approx(exact, rel=1e-3) and info.iterations < 30

    gen = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(200, 200, generator=gen, dtype=torch.float64))
    spectrum = torch.linspace(0.05, 10.0, 200, dtype=torch.float64)
    matrix = (basis * spectrum) @ basis.T
    template = TaskVector({"a": torch.zeros(120), "b": torch.zeros(8, 10)})

    def apply(v: TaskVector) -> TaskVector:
        return TaskVector.unflatten((matrix @ v.flatten().double()).float(), template)

    estimate, info = largest_eigenvalue(apply, template, iterations=60)
    assert estimate == pytest.approx(10.0, rel=1e-3) and estimate <= 10.0 * (1 + 1e-5)


def test_a_curvature_factor_is_the_best_low_rank_approximation_and_sums_into_one_operator():
    """`curvature_factor`'s FᵀF equals A's top-k eigenpart (eigh of the explicit matrix; a spectrum decaying
    like a Hessian's), is A itself where A's rank is at most k (zero rows pad it), and `LowRankGaussNewton`
    applies Σ_j c_j·F_jᵀF_j and inverts it plus λI exactly (CG preconditioned by that inverse: two iterations)."""
    gen = torch.Generator().manual_seed(2)
    basis, _ = torch.linalg.qr(torch.randn(200, 200, generator=gen, dtype=torch.float64))
    template = TaskVector({"a": torch.zeros(120), "b": torch.zeros(8, 10)})

    def operator(matrix):
        return lambda v: TaskVector.unflatten((matrix @ v.flatten().double()).float(), template)

    def dense(factor: TaskVector) -> torch.Tensor:  # F as rank × P, the template's flat order
        return torch.cat([factor[k].reshape(factor[k].shape[0], -1) for k in template], 1).double()

    spectrum = 50.0 * 0.8 ** torch.arange(200, dtype=torch.float64)
    full = (basis * spectrum) @ basis.T
    factor = curvature_factor(operator(full), template, 12)
    assert factor["a"].shape == (12, 120) and factor["b"].shape == (12, 8, 10)
    top = (basis[:, :12] * spectrum[:12]) @ basis[:, :12].T
    f = dense(factor)
    assert (f.T @ f - top).norm() <= 1e-4 * top.norm()
    assert (f.T @ f - full).norm() > 0.01 * full.norm()  # the rest of the spectrum is left out
    low = (basis[:, :9] * spectrum[:9]) @ basis[:, :9].T  # rank 9 < 12: the factor is the matrix
    small = curvature_factor(operator(low), template, 12, seed=3)
    g = dense(small)
    assert (g.T @ g - low).norm() <= 1e-4 * low.norm() and g[9:].abs().max() == 0
    v = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in template.items()})
    with LowRankGaussNewton([(factor, 0.25), (small, 0.75)]) as products:
        got = products(v).flatten().double()
    want = (0.25 * f.T @ f + 0.75 * g.T @ g) @ v.flatten().double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    # its inverse at any λ (Woodbury over the factors' Gram): a direct solve, and λ_max of the sum
    combined = 0.25 * f.T @ f + 0.75 * g.T @ g
    with LowRankGaussNewton([(factor, 0.25), (small, 0.75)]) as products:
        inverse = products.inverse()
        assert inverse.largest == pytest.approx(float(torch.linalg.eigvalsh(combined)[-1]), rel=1e-5)
        for lam in (0.01, 1.0):
            direct = torch.linalg.solve(combined + lam * torch.eye(200, dtype=torch.float64), v.flatten().double())
            torch.testing.assert_close(inverse(v, lam).flatten().double(), direct, rtol=1e-3,
                                       atol=1e-4 * float(direct.abs().max()))
        x, info = conjugate_gradient(products, v, damping=1.0, iterations=50, tolerance=1e-6, preconditioner=inverse)
        assert info.iterations <= 3 and info.relative_residual < 1e-5
        # where round-off leaves MMᵀ + λI indefinite (a Gram eigenvalue below −λ), Cholesky fails and the
        # eigendecomposition with the negative eigenvalues at 0 stands in
        values, vectors = torch.linalg.eigh(inverse.gram)
        inverse.gram = (vectors * (values - 1e-3)) @ vectors.T
        flat, stack = v.flatten().double(), products.matrix.double()
        inner = vectors @ ((vectors.T @ (stack @ flat)) / ((values - 1e-3).clamp(min=0.0) + 1e-5))
        torch.testing.assert_close(inverse(v, 1e-5).flatten().double(), (flat - stack.T @ inner) / 1e-5,
                                   rtol=1e-3, atol=1e-3 * float(flat.abs().max()) / 1e-5)


def test_a_spectral_preconditioner_keeps_cg_exact_and_cuts_its_iterations():
    """Preconditioned CG with `SpectralPreconditioner` from a rank-k factor solves (A + λI)·x = b to the
    direct solution, in a few iterations where plain CG takes dozens (a Hessian-like spectrum, λ at 0.002 of
    λ_max); with a lower-rank factor of a perturbed matrix it is slower but still exact (M⁻¹ stays positive
    definite)."""
    gen = torch.Generator().manual_seed(4)
    basis, _ = torch.linalg.qr(torch.randn(200, 200, generator=gen, dtype=torch.float64))
    template = TaskVector({"a": torch.zeros(120), "b": torch.zeros(8, 10)})
    spectrum = 5000.0 * 0.93 ** torch.arange(200, dtype=torch.float64)
    matrix = (basis * spectrum) @ basis.T

    def operator(m):
        return lambda v: TaskVector.unflatten((m @ v.flatten().double()).float(), template)

    lam = 0.002 * float(spectrum[0])
    b = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in template.items()})
    direct = torch.linalg.solve(matrix + lam * torch.eye(200, dtype=torch.float64), b.flatten().double())
    plain, plain_info = conjugate_gradient(operator(matrix), b, damping=lam, iterations=300, tolerance=1e-6)
    factor = curvature_factor(operator(matrix), template, 80)
    preconditioner = SpectralPreconditioner(factor)
    assert preconditioner.largest == pytest.approx(float(spectrum[0]), rel=1e-5)
    fast, fast_info = conjugate_gradient(operator(matrix), b, damping=lam, iterations=300, tolerance=1e-6,
                                         preconditioner=preconditioner)
    for x in (plain, fast):
        torch.testing.assert_close(x.flatten().double(), direct, rtol=1e-4, atol=1e-4 * float(direct.abs().max()))
    assert fast_info.iterations <= 10 and plain_info.iterations >= 4 * fast_info.iterations
    noise = torch.randn(200, 200, generator=gen, dtype=torch.float64)
    other = matrix + 0.5 * (noise + noise.T)  # the factor of a perturbed matrix, at a lower rank
    wrong = SpectralPreconditioner(curvature_factor(operator(other), template, 40))
    x, info = conjugate_gradient(operator(matrix), b, damping=lam, iterations=300, tolerance=1e-6,
                                 preconditioner=wrong)
    assert info.relative_residual < 1e-5 and fast_info.iterations < info.iterations < plain_info.iterations
    torch.testing.assert_close(x.flatten().double(), direct, rtol=1e-4, atol=1e-4 * float(direct.abs().max()))
    with pytest.raises(ValueError, match="damping > 0"):
        preconditioner(b, 0.0)


def test_the_clients_curvature_factors_give_the_removal_the_retained_clients_own_hessian(tiny_bert_dir,
                                                                                        tiny_tasks_dir, tmp_path,
                                                                                        monkeypatch):
    """`curvature_rank` ≥ P (a linear probe: P = hidden·C + C): each client's factor is its whole data
    Hessian, uploaded with its last-round gradient and kept in the run, so the default removal, with no
    client contacted, takes the step with the retained clients' own Hessian: equal to that step computed
    from their data (what the recipe's simulation-only row does) and not the server slice's step."""
    base = dict(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                peft_method="probe", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=3,
                batch_size=8, max_length=16, min_samples=4, backdoor_client=0, backdoor_trigger=1, export=False)
    options = {"pretrain_epochs": 1.0, "server_fraction": 0.2}
    env = Environment(RunConfig(**base, strategy_options=options))
    task = env.tasks[0].name
    rank = env.initial.vectors[head_name(task)].numel()
    run(RunConfig(**base, strategy_options={**options, "curvature_rank": rank}, output_dir=str(tmp_path / "run")))
    finished = open_finished_run(tmp_path / "run")
    state, env, strategy = finished.state, finished.env, finished.env.strategy
    model = task_model(state.vectors, task)
    for client in range(3):
        factor = state.vectors[curvature_name(client)]
        assert {k: tuple(t.shape) for k, t in factor.items()} == {k: (rank, *t.shape) for k, t in model.items()}

    def refuse(*args, **kwargs):
        raise AssertionError("a client was contacted during the removal")

    monkeypatch.setattr(ClientRuntime, "handle", refuse)
    removal = strategy.remove_client(state, env, 0)  # complete factors: auto takes the anchored form
    assert removal.hessian == "clients" and removal.form == "anchored"
    assert removal.curvature_tail <= COMPLETE_TAIL * removal.l2
    retained = env.host.tokenize(concatenate_datasets([env.partition[k][task] for k in (1, 2)]),
                                 env.task_by_name[task])
    own = strategy.remove_client(state, env, 0, RemovalOptions(gradient="anchored"), hessian_data=retained)
    assert own.hessian == "server" and removal.l2 == pytest.approx(own.l2, rel=1e-3) and own.form == "anchored"
    got, want = task_model(removal.state.vectors, task), task_model(own.state.vectors, task)
    assert (got - want).norm() <= 1e-3 * own.step_norm
    # the anchored step as a dense float64 solve: w₀ − (H₋ + λI)⁻¹·(ĝ₋ − H₋·(w* − w₀)), H₋ from the factors
    samples = {int(c): int(n) for c, n in state.scalars["gradient_samples"].items()}
    rest = samples[1] + samples[2]
    with LowRankGaussNewton([(state.vectors[curvature_name(k)], samples[k] / rest) for k in (1, 2)]) as products:
        factors, keys = products.matrix.double(), list(products.shapes)
    flat = lambda tv: TaskVector({k: tv[k] for k in keys}).flatten().double()  # noqa: E731
    h = factors.T @ factors
    g = sum(flat(state.vectors[gradient_name(k)]) * (samples[k] / rest) for k in (1, 2))
    w, w0 = flat(model), flat(task_point(state.vectors, task))
    anchored = w0 - torch.linalg.solve(h + removal.l2 * torch.eye(len(h), dtype=torch.float64), g - h @ (w - w0))
    torch.testing.assert_close(flat(got), anchored, rtol=0, atol=1e-4 * float((w - anchored).norm()))
    kept = {k: v for k, v in state.vectors.items() if k != CURVATURE_GRAM}  # a rank-1 run keeps a rank-1 Gram
    one_row = GlobalState(state.round, {**kept, **{curvature_name(k): TaskVector(
        {n: t[:1] for n, t in state.vectors[curvature_name(k)].items()}) for k in range(3)}},
        {**state.scalars, "curvature_rank": 1, "factor_gram": False})
    truncated = strategy.remove_client(one_row, env, 0)  # a factor that leaves curvature out: split or retained
    assert truncated.form in ("split", "retained") and truncated.curvature_tail > COMPLETE_TAIL * truncated.l2
    raw = dict(gradient="retained", trust_radius=0.0)  # the Newton step as it is, where the Hessians show
    clients, own = (strategy.remove_client(state, env, 0, RemovalOptions(**raw), hessian_data=data)
                    for data in (None, retained))
    server = strategy.remove_client(state, env, 0, RemovalOptions(**raw, hessian="server"))
    want = task_model(own.state.vectors, task)
    assert (task_model(clients.state.vectors, task) - want).norm() <= 1e-3 * own.step_norm
    assert (task_model(server.state.vectors, task) - want).norm() > 0.05 * own.step_norm
    out = remove_client(tmp_path / "run", 0, output_dir=tmp_path / "removed")["unlearning"]
    assert out["hessian"] == "clients" and out["client_messages"] == 0 and "uploaded" in out["how"]
    assert out["form"] == "anchored" and "w₀ − (H₋ + λI)⁻¹" in out["how"] and "leave out" in out["how"]


def test_complete_factors_of_a_regularized_objective_remove_to_the_retrained_minimizer(tiny_bert_dir,
                                                                                      tiny_tasks_dir, tmp_path):
    """With l2 > 0 the retained objective has one minimizer (`objective_minimizer`, its gradient vanishes
    there), and with the clients' complete factors the default removal takes its exact Newton step: the
    retained form at λ = l2 (not the anchored form, which returns to w₀ what l2 pulls toward 0), landing on
    that minimizer from a run that stopped short of its own."""
    l2 = 0.05
    base = dict(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                peft_method="probe", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=3,
                batch_size=8, max_length=16, min_samples=4, backdoor_client=0, backdoor_trigger=1, export=False)
    options = {"pretrain_epochs": 1.0, "server_fraction": 0.2, "l2": l2}
    task = Environment(RunConfig(**base, strategy_options=options)).tasks[0].name
    rank = Environment(RunConfig(**base, strategy_options=options)).initial.vectors[head_name(task)].numel()
    run(RunConfig(**base, strategy_options={**options, "curvature_rank": rank}, output_dir=str(tmp_path / "run")))
    finished = open_finished_run(tmp_path / "run")
    state, env, strategy = finished.state, finished.env, finished.env.strategy
    w0 = task_point(state.vectors, task)
    retained = env.host.tokenize(concatenate_datasets([env.partition[k][task] for k in (1, 2)]),
                                 env.task_by_name[task])
    minimizer, info = objective_minimizer(env.host, w0, retained, l2=l2)
    start = data_gradient(env.host, w0, w0, retained)[0] + w0 * l2
    assert (data_gradient(env.host, minimizer, w0, retained)[0] + minimizer * l2).norm() < 1e-4 * start.norm()
    w = task_model(state.vectors, task)
    assert (w - minimizer).norm() > 0.05 * (w - w0).norm()  # the run did not stop at the retrained minimizer
    removal = strategy.remove_client(state, env, 0)
    assert (removal.hessian, removal.form, removal.damping, removal.l2) == ("clients", "retained", "objective", l2)
    assert (task_model(removal.state.vectors, task) - minimizer).norm() <= 1e-3 * (w - minimizer).norm()
    anchored = strategy.remove_client(state, env, 0, RemovalOptions(gradient="anchored"))
    assert (task_model(anchored.state.vectors, task) - minimizer).norm() > 0.05 * (w - minimizer).norm()
    out = remove_client(tmp_path / "run", 0, output_dir=tmp_path / "removed")["unlearning"]
    assert out["form"] == "retained" and "the retrained objective's minimizer" in out["how"]
    with pytest.raises(ValueError, match="l2 \\+ ridge > 0"):
        objective_minimizer(env.host, w0, retained)
    # with H_s: the run stopped short of its optimum, so the auto damping is the relative one; from the full
    # objective's minimizer, with the gradients the clients would upload there, it is the objective's λ
    server = RemovalOptions(hessian="server")
    short = strategy.remove_client(state, env, 0, server)
    assert short.damping == "relative" and short.stationarity > 0.1
    data = [env.client_data(k)[task] for k in range(3)]
    optimum, _ = objective_minimizer(env.host, w0, concatenate_datasets(data), l2=l2)
    shared = state.vectors[SHARED]
    at_optimum = GlobalState(state.round, {
        **state.vectors, SHARED: optimum.filter(lambda k: k in shared),
        head_name(task): optimum.filter(lambda k: k not in shared),
        **{gradient_name(k): data_gradient(env.host, optimum, w0, d)[0] for k, d in enumerate(data)}}, state.scalars)
    there = strategy.remove_client(at_optimum, env, 0, server)
    assert (there.damping, there.form, there.l2) == ("objective", "retained", l2) and there.stationarity < 1e-3
    assert strategy.remove_client(at_optimum, env, 0, RemovalOptions(hessian="server", rho=0.002)).damping == "relative"


def test_the_clients_hessian_needs_their_factors(backdoored, tmp_path):
    with pytest.raises(ConfigError, match="uploaded none"):
        remove_client(backdoored[0] / "trained", 0, hessian="clients", output_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="unknown removal Hessian"):
        RemovalOptions(hessian="oracle")
    finished = open_finished_run(backdoored[0] / "trained")
    with pytest.raises(ConfigError, match="does not combine"):  # with factors or without, never ignored
        finished.env.strategy.remove_client(dataclasses.replace(finished.state, scalars={
            **finished.state.scalars, "curvature_rank": 1}), finished.env, 0, RemovalOptions(hessian="clients"),
            hessian_data=finished.env.test_data("digits"))
    assert not (tmp_path / "a").exists()


def test_the_goals_window_holds_its_edge():
    """Rates are counts over n: a gap of exactly the window (0.84 against 0.85, which float arithmetic makes
    1.0000000000000009 points) is within the goal, one test example more is not."""
    assert within_goal({"ta": 0.84, "bsr": 0.09}, {"ta": 0.85, "bsr": 0.07})
    assert not within_goal({"ta": 0.835, "bsr": 0.09}, {"ta": 0.85, "bsr": 0.09})
    assert not within_goal({"ta": 0.85, "bsr": 0.095}, {"ta": 0.85, "bsr": 0.07})
    assert inside_spread({"ta": 0.84, "bsr": 0.05}, [{"ta": 0.85, "bsr": 0.07}, {"ta": 0.86, "bsr": 0.09}])


def test_backdoor_data_carry_the_trigger_and_the_target():
    task = load_task("digits")
    train = task.dataset["train"].select(range(20))
    bad = poisoned(train, task, size=2, target=0)
    assert set(bad["label"]) == {0}
    for row in bad:
        assert (np.array(row["image"])[-2:, -2:] == 255).all()
    test = backdoor_test_set(task.dataset["test"], task, size=2, target=3)
    assert 3 not in set(test["label"]) and len(test) == sum(y != 3 for y in task.dataset["test"]["label"])


@pytest.fixture(scope="module")
def backdoored(tmp_path_factory):
    root = tmp_path_factory.mktemp("f2l2")
    trained = run(RunConfig(**BACKDOOR, output_dir=str(root / "trained")))
    retrained = run(RunConfig(**{**BACKDOOR, "export": False}, exclude_clients=[0], output_dir=str(root / "retrain")))
    return root, trained, retrained


def test_f2l2_removes_the_backdoor_on_the_server_alone(backdoored, monkeypatch):
    root, trained, retrained = backdoored
    before, reference = trained["tasks"]["digits"], retrained["tasks"]["digits"]
    assert before["backdoor_success_rate"] > 0.8 and reference["backdoor_success_rate"] < 0.1

    def refuse(*args, **kwargs):
        raise AssertionError("a client was contacted during the removal")

    monkeypatch.setattr(ClientRuntime, "handle", refuse)
    checkpoint = (root / "trained" / "checkpoint.safetensors").read_bytes()
    results = remove_client(root / "trained", 0, output_dir=root / "removed")
    after, u = results["tasks"]["digits"], results["unlearning"]
    assert u["client_messages"] == 0 and u["relative_residual"] < 1e-5
    # the default damping is relative to the server Hessian's scale, and the removal records it
    assert u["damping"] == "relative" and u["rho"] == 0.002 and u["gradient"] == "auto"
    assert u["form"] == "split" and u["difference_step"] <= u["trust_radius"]  # the step fits on digits
    # λ_max comes from the server's own factor of H_s, formed in the gradient round; no Lanczos at removal time
    assert u["lambda_max"] > 0 and u["eigen_iterations"] == 0 and u["preconditioner_rank"] > 0
    assert "preconditioned by the rank-" in u["how"]
    assert u["l2"] == pytest.approx(u["rho"] * u["lambda_max"]) and f"{u['rho']:g} × " in u["how"]
    assert after["backdoor_success_rate"] <= reference["backdoor_success_rate"] + 0.1
    # measured (λ = 10): clean accuracy 0.88 after the removal, 0.90 before, 0.97 retrained (the digits recipe,
    # whose max_train_samples reorders the data: 0.84, 0.89, 0.95)
    assert after["accuracy"] > before["accuracy"] - 0.05 and abs(after["accuracy"] - reference["accuracy"]) < 0.12
    assert (root / "trained" / "checkpoint.safetensors").read_bytes() == checkpoint  # the run is left as it is
    # the stored factor only speeds the solves up: without it (Lanczos, plain CG) the same step, in more products
    finished = open_finished_run(root / "trained")
    state, env = finished.state, finished.env
    bare = dataclasses.replace(state, vectors={k: v for k, v in state.vectors.items() if k != SERVER_CURVATURE})
    fast = env.strategy.remove_client(state, env, 0)
    slow = env.strategy.remove_client(bare, env, 0)
    assert fast.preconditioner_rank == state.scalars["server_curvature_rank"] and slow.preconditioner_rank == 0
    assert slow.eigen_iterations >= 2 and fast.l2 == pytest.approx(slow.l2, rel=1e-3) and fast.form == slow.form
    w_fast, w_slow, w = (task_model(x.vectors, "digits") for x in (fast.state, slow.state, state))
    assert (w_fast - w_slow).norm() <= 1e-3 * (w - w_slow).norm()
    assert slow.cg_iterations >= 3 * fast.cg_iterations

    # the removed model is exported and reloads: the linearized package predicts what was evaluated
    env = Environment(RunConfig(**BACKDOOR, output_dir=str(root / "x")))
    model = load_linearized(root / "removed" / "linearized" / "digits")
    loader = torch.utils.data.DataLoader(env.test_data("digits"), batch_size=128, collate_fn=env.host.inputs.collator)
    with torch.no_grad():
        preds = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits.argmax(-1) for b in loader])
    assert (float(np.mean(preds.numpy() == np.asarray(env.test_data("digits")["labels"])))
            == pytest.approx(after["accuracy"]))
    card = (root / "removed" / "adapters" / "digits" / "README.md").read_text()
    assert "Unlearned client(s) 0" in card and "no client was contacted" in card
    saved = TaskVector.load(root / "removed" / REMOVED_MODEL)
    assert set(saved) == set(env.initial.vectors[SHARED]) | set(env.initial.vectors[head_name("digits")])
    assert json.loads((root / "removed" / "results.json").read_text())["unlearning"]["forgotten_clients"] == [0]


def test_the_retained_gradient_form_and_sga_are_there_to_compare(backdoored):
    root, _, retrained = backdoored
    sga = remove_client(root / "trained", 0, method="sga", sga_lr=1e-2, output_dir=root / "sga")
    assert sga["unlearning"]["client_messages"] == 1
    retained = remove_client(root / "trained", 0, gradient="retained", output_dir=root / "retained")
    assert retained["unlearning"]["gradient"] == "retained" and retained["unlearning"]["client_messages"] == 0
    absolute = remove_client(root / "trained", 0, l2=10.0, output_dir=root / "absolute")["unlearning"]
    assert absolute["damping"] == "absolute" and absolute["l2"] == 10.0 and absolute["lambda_max"] is None


def test_the_difference_form_lies_between_the_target_and_the_retained_forms(backdoored):
    """g_difference = ∇F₋(w*) − ∇F(w*) = (n_m/n)·g_retained + (n₋/n)·g_target, so under one damping its step
    is the same mix of theirs (the solve is linear in g)."""
    root = backdoored[0]
    finished = open_finished_run(root / "trained")
    state, env, strategy = finished.state, finished.env, finished.env.strategy
    samples = {int(c): n for c, n in state.scalars["gradient_samples"].items()}
    share = samples[0] / sum(samples.values())
    options = dict(rho=0.01, tolerance=1e-6, iterations=500)  # the gap is float32's (3.7e-6), not the solve's
    w = {form: task_model(strategy.remove_client(state, env, 0, RemovalOptions(gradient=form, **options)).state.vectors,
                          "digits") for form in ("target", "retained", "difference")}
    mix = w["retained"] * share + w["target"] * (1 - share)
    assert (w["difference"] - mix).norm() < 1e-3 * (w["retained"] - w["target"]).norm()


def test_the_trust_region_raises_the_damping_until_the_step_fits():
    """`solve_within_radius` against direct solves on an explicit ill-conditioned matrix: a radius the first
    step fits changes nothing (one solve); a smaller one gives the exact damped step of a larger λ, within
    [0.8, 1] of the radius, in a few solves."""
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(-6, 2, 40, dtype=torch.float64)) @ q.T
    b = TaskVector({"w": torch.randn(40, dtype=torch.float64)})

    def apply(v):
        return TaskVector({"w": a @ v["w"]})

    def direct(lam):
        return torch.linalg.solve(a + lam * torch.eye(40, dtype=torch.float64), b["w"])

    free_norm = float(direct(1e-4).norm())
    x, info = solve_within_radius(apply, b, damping=1e-4, radius=2 * free_norm, iterations=400, tolerance=1e-12)
    assert info.damping == 1e-4 and info.solves == 1 and torch.allclose(x["w"], direct(1e-4), rtol=1e-6)
    for radius in (free_norm / 10, free_norm / 1e3, free_norm / 1e5):
        x, info = solve_within_radius(apply, b, damping=1e-4, radius=radius, iterations=400, tolerance=1e-12)
        assert info.damping > 1e-4 and 0.8 * radius <= x.norm() <= radius and info.solves <= 6
        assert torch.allclose(x["w"], direct(info.damping), rtol=1e-6, atol=1e-12)
    x, info = solve_within_radius(apply, b, damping=1e-4, radius=0.0, iterations=400, tolerance=1e-12)
    assert info.solves == 1 and torch.allclose(x["w"], direct(1e-4), rtol=1e-6)
    first = direct(1e-4)  # a step measured from elsewhere: the region bounds ‖offset + x‖, not ‖x‖
    offset, radius = TaskVector({"w": -0.9 * first}), 0.5 * float(first.norm())
    x, info = solve_within_radius(apply, b, damping=1e-4, radius=radius, iterations=400, tolerance=1e-12,
                                  offset=offset)
    assert info.damping == 1e-4 and info.solves == 1 and (offset + x).norm() <= radius < x.norm()
    x, info = solve_within_radius(apply, b, damping=1e-4, radius=radius, iterations=400, tolerance=1e-12)
    assert info.damping > 1e-4 and x.norm() <= radius


def test_the_removal_step_stays_inside_its_trust_region(backdoored):
    """The step is capped at removal_trust_radius·‖w* − w₀‖: on digits the default radius (1) leaves the
    default step as it is; a radius of 0.005 raises λ until the step fits and records both λ."""
    root = backdoored[0]
    finished = open_finished_run(root / "trained")
    state, env, strategy = finished.state, finished.env, finished.env.strategy
    moved = (task_model(state.vectors, "digits") - task_point(state.vectors, "digits")).norm()
    default = strategy.remove_client(state, env, 0, RemovalOptions(gradient="difference"))
    free = strategy.remove_client(state, env, 0, RemovalOptions(gradient="difference", trust_radius=0.0))
    assert default.trust_radius == pytest.approx(moved) and default.step_norm < moved and default.untrusted_l2 is None
    assert default.l2 == free.l2 and free.trust_radius == 0
    capped = strategy.remove_client(state, env, 0, RemovalOptions(gradient="difference", trust_radius=0.005))
    assert capped.untrusted_l2 == pytest.approx(default.l2) and capped.l2 > default.l2
    assert 0.8 * 0.005 * moved <= capped.step_norm <= 0.005 * moved + 1e-9 and capped.step_norm < default.step_norm
    out = remove_client(root / "trained", 0, gradient="difference", trust_radius=0.005,
                        output_dir=root / "capped")["unlearning"]
    assert out["untrusted_l2"] == pytest.approx(default.l2) and "trust region" in out["how"]


def test_the_auto_form_takes_the_split_step_where_the_difference_step_fits_and_the_retained_form_where_not(
        backdoored):
    """The default `auto` form. The split step equals a direct solve: the retained form's step plus λ·(H_s +
    λI)⁻² times the client's share of the gradient (Woodbury over the server slice's Jacobian, formed). On
    digits the difference step fits the default trust region, so auto takes the split step, the same model
    as asking for it; split asked for under a radius the difference step overflows raises λ until that
    step fits; auto under it solves the retained form inside the region instead, the same model as asking
    for that; the result records which form was taken and the difference step that decided."""
    root = backdoored[0]
    finished = open_finished_run(root / "trained")
    state, env, strategy = finished.state, finished.env, finished.env.strategy

    def model(removal):
        return task_model(removal.state.vectors, "digits")

    auto = strategy.remove_client(state, env, 0)
    split = strategy.remove_client(state, env, 0, RemovalOptions(gradient="split"))
    difference = strategy.remove_client(state, env, 0, RemovalOptions(gradient="difference"))
    assert auto.gradient == "auto" and auto.form == split.form == "split" and auto.solves == 2
    assert auto.difference_step == pytest.approx(difference.step_norm) and auto.difference_step <= auto.trust_radius
    assert (model(auto) - model(split)).norm() <= 1e-6 * split.step_norm
    # the direct solve, in float64 over the explicit Jacobian of the server's slice
    w, w0 = task_model(state.vectors, "digits"), task_point(state.vectors, "digits")
    samples = {int(c): int(n) for c, n in state.scalars["gradient_samples"].items()}
    grads = {c: state.vectors[gradient_name(c)] for c in samples}
    rest = sum(n for c, n in samples.items() if c != 0)
    retained = sum((grads[c] * (n / rest) for c, n in samples.items() if c != 0), w.zeros_like())
    share = (retained - grads[0]) * (samples[0] / (rest + samples[0]))
    data = strategy.server_split(env, "digits")[1]
    with JacobianGaussNewton(env.host, w0, data, outputs=10) as products:
        jac, keys = products.jacobian.double(), products.keys
    flat = lambda tv: TaskVector({k: tv[k] for k in keys}).flatten().double()  # noqa: E731
    lam, n = auto.l2, len(data)
    inner = torch.linalg.cholesky(lam * n / 2 * torch.eye(len(jac), dtype=torch.float64) + jac @ jac.T)

    def solve(b):  # (2/n·JᵀJ + λI)⁻¹·b
        return (b - jac.T @ torch.cholesky_solve((jac @ b)[:, None], inner)[:, 0]) / lam

    step = solve(flat(retained) + lam * solve(flat(share)))
    torch.testing.assert_close(flat(w - model(auto)), step, rtol=0, atol=1e-4 * step.norm().item())
    assert (flat(w - model(difference)) - step).norm() > 0.05 * step.norm()  # not the difference step
    radius = 0.5 * difference.step_norm / auto.trust_radius  # a region the difference step overflows
    squeezed = strategy.remove_client(state, env, 0, RemovalOptions(gradient="split", trust_radius=radius))
    assert squeezed.form == "split" and squeezed.untrusted_l2 == pytest.approx(auto.l2) and squeezed.l2 > auto.l2
    assert squeezed.difference_step <= squeezed.trust_radius
    tight = strategy.remove_client(state, env, 0, RemovalOptions(trust_radius=0.005))
    retained_form = strategy.remove_client(state, env, 0, RemovalOptions(gradient="retained", trust_radius=0.005))
    assert tight.form == "retained" and tight.difference_step > tight.trust_radius >= tight.step_norm
    assert tight.difference_step == pytest.approx(difference.step_norm) and tight.solves == retained_form.solves + 1
    assert (model(tight) - model(retained_form)).norm() <= 1e-6 * retained_form.step_norm
    assert (model(tight) - model(difference)).norm() > 0.1 * difference.step_norm
    out = remove_client(root / "trained", 0, trust_radius=0.005, output_dir=root / "auto-tight")["unlearning"]
    assert out["form"] == "retained" and "did not fit the trust region" in out["how"]
    no_region = type(strategy)(dataclasses.replace(strategy.config, removal_trust_radius=0.0))
    with pytest.raises(ConfigError, match="removal_trust_radius is 0"):
        no_region.remove_client(state, env, 0)


def test_f2l2_refusals(tmp_path, backdoored):
    with pytest.raises(ConfigError, match="one task per run"):
        run(RunConfig(**{**BACKDOOR, "tasks": ["digits", "digits"]}, output_dir=str(tmp_path / "a")))
    with pytest.raises(ConfigError, match="participation 1"):
        run(RunConfig(**BACKDOOR, participation=0.5, output_dir=str(tmp_path / "b")))
    with pytest.raises(ConfigError, match="server_fraction must be > 0"):
        RunConfig(**{**BACKDOOR, "strategy_options": {"server_fraction": 0.0}})
    root = backdoored[0]
    with pytest.raises(ConfigError, match="unknown client 7"):
        remove_client(root / "trained", 7, output_dir=tmp_path / "c")
    with pytest.raises(ConfigError, match="unknown removal method"):
        remove_client(root / "trained", 0, method="magic", output_dir=tmp_path / "d")
    with pytest.raises(ConfigError, match=r"cg_iterations must be >= 1 .*got 0"):
        remove_client(root / "trained", 0, iterations=0, output_dir=tmp_path / "e")
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_a_removal_without_cg_iterations_is_refused_before_anything_is_written(backdoored, capsys):
    """`--cg-iterations 0` would take no Newton step and write the trained model as the "removed" one:
    a one-line error and exit 2, nothing written; the removal options refuse it wherever they come from."""
    trained = backdoored[0] / "trained"
    default_out = trained.with_name("trained-remove-client0-f2l2")
    for iterations in ("0", "-3"):
        assert main(["unlearn", str(trained), "--client", "0", "--method", "f2l2", "--cg-iterations", iterations]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cg_iterations must be >= 1" in err and f"got {iterations}" in err, err
        assert not default_out.exists()
    for iterations in (0, -1):
        with pytest.raises(ConfigError, match="cg_iterations must be >= 1"):
            RemovalOptions(iterations=iterations)
    assert RemovalOptions(iterations=1).iterations == 1


def test_bad_damping_options_are_one_line_errors(backdoored, capsys):
    """ρ must be positive, ρ and an absolute λ exclude each other, the damping mode is one of two: refused
    by the removal options, the run's strategy options and the CLI (exit 2, one line, nothing written)."""
    for kwargs, message in (({"rho": 0.0}, "rho must be > 0"), ({"rho": -1.0}, "rho must be > 0"),
                            ({"l2": -1.0}, "l2 must be >= 0"), ({"rho": 0.1, "l2": 1.0}, "not both"),
                            ({"trust_radius": -0.5}, "trust_radius must be >= 0"),
                            ({"trust_radius": 0.0}, "auto gradient form picks its form by the trust region"),
                            ({"gradient": "newton"}, "unknown gradient form 'newton'")):
        with pytest.raises(ConfigError, match=message):
            RemovalOptions(**kwargs)
    assert RemovalOptions(gradient="difference", trust_radius=0.0).trust_radius == 0
    for options, message in (({"removal_rho": 0.0}, "removal_rho"), ({"removal_damping": "hessian"}, "hessian"),
                             ({"curvature_rank": -1}, "curvature_rank"), ({"curvature_rank": 1.5}, "curvature_rank"),
                             ({"removal_l2": -1.0}, "removal_l2"), ({"removal_trust_radius": -1.0},
                                                                    "removal_trust_radius")):
        with pytest.raises(ConfigError, match=message):
            RunConfig(**{**BACKDOOR, "strategy_options": options})
    trained = backdoored[0] / "trained"
    for flags, message in ((["--rho", "0"], "rho must be > 0"), (["--rho", "0.1", "--l2", "3"], "not both"),
                           (["--trust-radius", "-1"], "trust_radius must be >= 0"),
                           (["--trust-radius", "0"], "auto gradient form picks its form by the trust region"),
                           (["--hessian", "clients"], "uploaded none")):
        assert main(["unlearn", str(trained), "--client", "0", "--method", "f2l2", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not trained.with_name("trained-remove-client0-f2l2").exists()
    assert main(["unlearn", str(trained), "--client", "0", "--method", "sga", "--rho", "0.1"]) == 2
    assert "--rho does not apply to --method sga" in capsys.readouterr().err


def test_linear_probe_runs_f2l2_and_its_removal(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """FM-LP: `peft_method: probe` trains the head alone (nothing shared) through F²L² and the removal."""
    config = RunConfig(strategy="f2l2", strategy_options={"pretrain_epochs": 1.0, "server_fraction": 0.2},
                       tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir, peft_method="probe",
                       base_model_id="hf-fedtask-tests/tiny-bert",
                       num_clients=2, rounds=2, batch_size=8, max_length=16, min_samples=4, backdoor_client=0,
                       backdoor_trigger=1, output_dir=str(tmp_path / "probe"))
    env = Environment(config)
    assert len(env.initial.vectors[SHARED]) == 0 and env.initial.vectors[head_name(env.tasks[0].name)].numel() > 0
    run(config)
    results = remove_client(tmp_path / "probe", 0, output_dir=tmp_path / "removed")
    assert results["unlearning"]["client_messages"] == 0 and results["unlearning"]["relative_residual"] < 1e-5
    assert (tmp_path / "removed" / "adapters" / env.tasks[0].name / "adapter_model.safetensors").exists()


def test_a_backdoor_is_refused_where_its_success_rate_would_not_be_measured(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """FedPer evaluates on its clients, which do not report the BSR: the option would be ignored."""
    config = RunConfig(strategy="fedper", tasks=list(tiny_tasks_dir), suite=None, base_model=tiny_bert_dir,
                       base_model_id="hf-fedtask-tests/tiny-bert", num_clients=4, rounds=1, max_length=16,
                       min_samples=4, backdoor_client=0, output_dir=str(tmp_path / "fp"))
    with pytest.raises(ConfigError, match="backdoor success rate is not measured"):
        run(config)
    assert not (tmp_path / "fp").exists()


def test_matu_refuses_a_linear_probe(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = RunConfig(strategy="matu", tasks=list(tiny_tasks_dir), suite=None, base_model=tiny_bert_dir,
                       num_clients=4, rounds=1, max_length=16, min_samples=4, peft_method="probe",
                       output_dir=str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="shares none"):
        run(config)
    assert not (tmp_path / "m").exists()


def test_anchored_ridge_adds_its_gradient_around_a_fixed_anchor():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    anchor = torch.tensor([1.0, 0.0, -1.0])
    for expected in ([0.0, -1.0, 2.0], [0.5, -0.5, 2.5]):  # the anchor stays put (FedProx's follows each start)
        ridge = AnchoredRidge(0.5, {"w": anchor})
        ridge.start({"w": p})
        p.grad = None
        ridge.loss(torch.tensor(0.0), None, {}).backward()
        assert torch.allclose(p.grad, torch.tensor(expected))
        with torch.no_grad():
            p.add_(1.0)
    unanchored = AnchoredRidge(1.0, {})
    unanchored.start({"v": p})
    with pytest.raises(KeyError, match="lacks parameter 'v'"):
        unanchored.loss(torch.tensor(0.0), None, {})


def _probe(tiny_bert_dir, tiny_tasks_dir, out, **options) -> RunConfig:
    return RunConfig(strategy="f2l2", strategy_options={"pretrain_epochs": 1.0, "server_fraction": 0.2, **options},
                     tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir, peft_method="probe",
                     base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=4, batch_size=8,
                     learning_rate=1e-2, max_length=16, min_samples=4, backdoor_client=0, backdoor_trigger=1,
                     output_dir=str(out))


def test_a_ridge_holds_training_near_w0_and_makes_the_removal_the_exact_newton_step(tiny_bert_dir, tiny_tasks_dir,
                                                                                   tmp_path):
    """`ridge` ρ: the server sets λ_r = ρ·λ_max(H_s) after pretraining, clients train with (λ_r/2)·‖w − w₀‖²,
    and `removal_damping: objective` takes the Newton step of that objective: with the retained clients'
    data as the Hessian (what only a simulation has) and the retained form of the gradient, it lands on
    the optimum of the objective without the client (its gradient there vanishes), the certified-removal
    premise, which the ridge makes well posed."""
    moved = {}
    for rho in (0.0, 3.0):
        config = _probe(tiny_bert_dir, tiny_tasks_dir, tmp_path / f"ridge{rho:g}", ridge=rho,
                        **({"removal_damping": "objective"} if rho else {}))
        run(config)
        finished = open_finished_run(config.output_dir)
        task = finished.env.tasks[0].name
        w, w0 = task_model(finished.state.vectors, task), task_point(finished.state.vectors, task)
        moved[rho] = (w - w0).norm()
    state, env, strategy = finished.state, finished.env, finished.env.strategy
    lam_r = strategy.ridge_lambda(state)
    with GaussNewton(env.host, w0, env.server_data(task), env.config.eval_batch_size) as hessian:
        lambda_max, _ = largest_eigenvalue(hessian, w0, iterations=30, seed=env.config.seed)
    assert lam_r == pytest.approx(3.0 * lambda_max, rel=1e-4) and lam_r > 0
    assert moved[3.0] < 0.5 * moved[0.0]  # the clients trained with the ridge around w₀

    retained = [1, 2]
    data = env.host.tokenize(concatenate_datasets([env.partition[k][task] for k in retained]), env.task_by_name[task])
    removal = strategy.remove_client(state, env, 0, RemovalOptions(gradient="retained"), hessian_data=data)
    assert removal.damping == "objective" and removal.l2 == pytest.approx(lam_r)
    w_removed = task_model(removal.state.vectors, task)

    def objective_gradient(v):  # ∇F₋(v): the retained data term (n-weighted) plus the ridge's gradient
        return data_gradient(env.host, v, w0, data)[0] + (v - w0) * lam_r

    before, after = objective_gradient(w), objective_gradient(w_removed)
    assert after.norm() < 1e-3 * before.norm()
    # the clients' last-round gradients are the data gradients the server would compute on their data
    samples = {int(c): n for c, n in state.scalars["gradient_samples"].items()}
    ours = sum((state.vectors[gradient_name(k)] * (samples[k] / sum(samples[r] for r in retained)) for k in retained),
               w.zeros_like())
    assert (ours - data_gradient(env.host, w, w0, data)[0]).norm() < 1e-4 * ours.norm()
    results = remove_client(tmp_path / "ridge3", 0, output_dir=tmp_path / "removed")["unlearning"]
    assert results["damping"] == "objective" and results["ridge_lambda"] == pytest.approx(lam_r)
    assert "exact Newton step" in results["how"]


def test_objective_damping_needs_a_regularized_objective():
    with pytest.raises(ConfigError, match="'objective' needs l2 > 0 or ridge > 0"):
        RunConfig(**{**BACKDOOR, "strategy_options": {"removal_damping": "objective"}})
    for options in ({"removal_damping": "objective", "l2": 0.1}, {"removal_damping": "objective", "ridge": 0.01}):
        assert RunConfig(**{**BACKDOOR, "strategy_options": options}).strategy_options == options
    with pytest.raises(ConfigError, match="ridge"):
        RunConfig(**{**BACKDOOR, "strategy_options": {"ridge": -1.0}})


def test_a_hessian_holdout_keeps_part_of_the_server_slice_out_of_pretraining(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """`hessian_holdout` h: a seeded share h of D_s is kept out of w₀'s pretraining, and the removal's
    Hessian is taken on it (a Hessian on the inputs w₀ was fit to missed 95% of MiniLM + LoRA's λ_max)."""
    config = _probe(tiny_bert_dir, tiny_tasks_dir, tmp_path / "holdout", hessian_holdout=0.5)
    run(config)
    finished = open_finished_run(config.output_dir)
    env, strategy, state = finished.env, finished.env.strategy, finished.state
    task = env.tasks[0].name
    server = env.server_data(task)
    pretrain, held = strategy.server_split(env, task)
    assert len(held) == round(0.5 * len(server)) and len(pretrain) + len(held) == len(server)

    def rows(data):
        return [str(r) for r in zip(list(data["input_ids"]), list(data["labels"]))]

    assert sorted(rows(pretrain) + rows(held)) == sorted(rows(server))
    assert rows(strategy.server_split(env, task)[1]) == rows(held)  # seeded: the same split each time
    default = strategy.remove_client(state, env, 0)
    on_held = strategy.remove_client(state, env, 0, hessian_data=held)
    on_all = strategy.remove_client(state, env, 0, hessian_data=server)
    # the default reads λ_max from the server's stored factor (formed on the held-out share), the others by Lanczos
    assert default.lambda_max == pytest.approx(on_held.lambda_max, rel=1e-6) and default.preconditioner_rank
    assert on_held.lambda_max != pytest.approx(on_all.lambda_max, rel=1e-6)
    whole = _probe(tiny_bert_dir, tiny_tasks_dir, tmp_path / "x").strategy_options
    assert "hessian_holdout" not in whole  # 0 by default: D_s for both


def test_the_cg_solver_trains_to_the_objectives_minimizer_and_retrains_to_the_retained_one(tiny_bert_dir,
                                                                                          tiny_tasks_dir, tmp_path):
    """`linear_solver: cg`: the linear rounds are federated conjugate gradient (the first asks each client for its
    data gradient, each later one for H_k·p), so the run ends at `objective_minimizer`'s point over all
    clients' data, its metrics log ‖r‖/‖r₀‖ falling, the gradient round reads stationarity near 0 and the
    default removal takes the objective's damping; a retraining without the client ends at the retained
    clients' minimizer. Local optimizer options would not apply and are refused."""
    l2, rounds = 0.05, 14
    base = dict(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                peft_method="probe", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=rounds,
                batch_size=8, max_length=16, min_samples=4, backdoor_client=0, backdoor_trigger=1, export=False)
    options = {"pretrain_epochs": 1.0, "server_fraction": 0.2, "l2": l2, "linear_solver": "cg"}
    ends = {}
    for name, excluded in (("trained", []), ("retrained", [0])):
        run(RunConfig(**base, strategy_options=options, exclude_clients=excluded, output_dir=str(tmp_path / name)))
        finished = open_finished_run(tmp_path / name)
        env, state = finished.env, finished.state
        task = env.tasks[0].name
        w0 = task_point(state.vectors, task)
        kept = [k for k in range(3) if k not in excluded]
        data = concatenate_datasets([env.client_data(k)[task] for k in kept])
        minimizer, _ = objective_minimizer(env.host, w0, data, l2=l2, tolerance=1e-8)
        w = task_model(state.vectors, task)
        assert (w - w0).norm() > 0.1 * (minimizer - w0).norm() > 0  # training moved
        assert (w - minimizer).norm() <= 1e-3 * (minimizer - w0).norm()
        ends[name] = (env, state, task)
    history = [json.loads(line) for line in (tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()]
    residuals = [r["aggregation"]["cg_relative_residual"] for r in history if "aggregation" in r]
    assert residuals[0] == 1.0 and residuals[-1] < 1e-4
    assert all(r["kind"] == "query" for r in history)
    # killed after round 3 (the direction and residual in its checkpoint), resumed: the same model
    config = RunConfig(**base, strategy_options=options, output_dir=str(tmp_path / "resumed"))
    with pytest.raises(Crash):
        run(config, callbacks=[crash_after(3)])
    run(config, resume=True)
    env, state, task = ends["trained"]
    resumed = open_finished_run(tmp_path / "resumed").state
    assert (task_model(resumed.vectors, task) - task_model(state.vectors, task)).norm() == 0
    removal = env.strategy.remove_client(state, env, 0)
    assert removal.stationarity < 1e-2 and removal.damping == "objective"
    with pytest.raises(ConfigError, match="linear_solver 'cg' trains by conjugate-gradient rounds.*learning_rate"):
        run(RunConfig(**base, strategy_options=options, learning_rate=0.1, output_dir=str(tmp_path / "refused")))
    assert not (tmp_path / "refused").exists()


class _SilentInRound3(InProcessTransport):
    """Client 1 does not answer round 3 (a CG product round): absent from the replies, its reason in
    `failures`, as an engine reports a client that did not reply."""

    def exchange(self, instructions):
        kept = [ins for ins in instructions if (ins.round, ins.client_id) != (3, 1)]
        self.failures = {1: "unreachable"} if len(kept) < len(instructions) else {}
        return super().exchange(kept)


@pytest.mark.parametrize("factors", [False, True], ids=["without_factors", "with_factors"])
def test_a_cg_round_without_every_client_of_the_first_round_is_refused_and_not_checkpointed(
        factors, tiny_bert_dir, tiny_tasks_dir, tmp_path, monkeypatch, capsys):
    """A CG product over other clients than r₀'s would solve another system (with the clients' factors, the
    preconditioner would miss the client's sample count): the round is refused with one line naming the
    client, exit 2, rounds 1-2 stay the checkpoint; the first round's clients are in the checkpoint, so a resume
    refuses the same, and once the client is back the resumed run finishes."""
    base = dict(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                peft_method="probe", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=4,
                batch_size=8, max_length=16, min_samples=4, export=False, output_dir=str(tmp_path / "run"))
    options = {"pretrain_epochs": 1.0, "server_fraction": 0.2, "l2": 0.05, "linear_solver": "cg",
               "curvature_rank": 2 if factors else 0}
    config = RunConfig(**base, strategy_options=options)
    config.save_yaml(tmp_path / "run.yaml")
    monkeypatch.setattr(engine_run, "InProcessTransport", _SilentInRound3)  # the default engine's transport
    refusal = ("hf-fedtask: error: f2l2 linear_solver cg, round 3: client 1 did not reply (clients of the first "
               "round: 0, 1, 2); conjugate gradient needs every product over the same clients; round 3 is not "
               "checkpointed: rerun with --resume once every client of the first round replies")
    for resume in ([], ["--resume"]):
        capsys.readouterr()
        assert main(["run", "--config", str(tmp_path / "run.yaml"), *resume]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
        assert errors == [refusal]
        history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in history] == [1, 2]
        with safe_open(str(tmp_path / "run" / "checkpoint.safetensors"), "pt") as f:
            meta = f.metadata()
        assert meta["round"] == "2" and json.loads(meta["scalars"])["cg_clients"] == [0, 1, 2]
    monkeypatch.undo()
    run(config, resume=True)
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in history] == [1, 2, 3, 4] and history[2]["clients"] == [0, 1, 2]


def test_a_cg_round_refuses_a_client_that_took_no_part_in_the_first_round():
    """The first round's clients come from `cg_clients` (or, in a checkpoint from before it was kept, the
    factors' clients); a reply from a client outside them is refused too, and so are both faults at once."""
    strategy = F2L2()

    def replies(*ids):
        return [ClientUpdate(c, 5, {}, {"t": 4}, {}) for c in ids]

    kept = GlobalState(4, {}, {"cg_clients": [0, 1, 2]})
    assert strategy.check_cg_clients(kept, replies(2, 0, 1)) == [0, 1, 2]
    with pytest.raises(ProtocolError, match=r"^f2l2 linear_solver cg, round 5: client 3 replied but took no part "
                                            r"in the first round \(clients of the first round: 0, 1, 2\);"):
        strategy.check_cg_clients(kept, replies(0, 1, 2, 3))
    with pytest.raises(ProtocolError, match=r"round 5: clients 0, 2 did not reply and client 4 replied but took "
                                            r"no part in the first round \(clients of the first round: 0, 1, 2\)"):
        strategy.check_cg_clients(kept, replies(1, 4))
    older = GlobalState(4, {}, {"factor_clients": ["0", "1", "2"]})
    with pytest.raises(ProtocolError, match=r"round 5: client 1 did not reply"):
        strategy.check_cg_clients(older, replies(0, 2))
    assert strategy.check_cg_clients(GlobalState(4, {}, {}), replies(2, 0)) == [0, 2]


def test_the_clients_complete_factors_precondition_cg_training_to_the_minimizer_in_a_few_rounds(
        tiny_bert_dir, tiny_tasks_dir, tmp_path, monkeypatch):
    """`linear_solver: cg` with `curvature_rank` ≥ P: each client uploads its whole data Hessian's factor with the
    first round's gradient (not again in the gradient round), and CG preconditioned by their n-weighted sum + λI
    (the system's own matrix) reaches the objective's minimizer within two product rounds, where H_s's
    preconditioner has not; retrained without client 0 it ends at the retained minimizer, and the default
    removal, with no client contacted, takes the exact Newton step there."""
    l2, rounds = 0.05, 6
    base = dict(strategy="f2l2", tasks=[tiny_tasks_dir[0]], suite=None, base_model=tiny_bert_dir,
                peft_method="probe", base_model_id="hf-fedtask-tests/tiny-bert", num_clients=3, rounds=rounds,
                batch_size=8, max_length=16, min_samples=4, backdoor_client=0, backdoor_trigger=1, export=False)
    options = {"pretrain_epochs": 1.0, "server_fraction": 0.2, "l2": l2, "linear_solver": "cg"}
    task_name = Environment(RunConfig(**base, strategy_options=options)).tasks[0].name
    rank = Environment(RunConfig(**base, strategy_options=options)).initial.vectors[head_name(task_name)].numel()
    ends, residuals, uplinks = {}, {}, {}
    for name, excluded, rank_ in (("trained", [], rank), ("retrained", [0], rank), ("server", [], 0)):
        run(RunConfig(**base, strategy_options={**options, "curvature_rank": rank_}, exclude_clients=excluded,
                      output_dir=str(tmp_path / name)))
        finished = open_finished_run(tmp_path / name)
        env, state = finished.env, finished.state
        task = env.tasks[0].name
        w0 = task_point(state.vectors, task)
        kept = [k for k in range(3) if k not in excluded]
        minimizer, _ = objective_minimizer(env.host, w0, concatenate_datasets([env.client_data(k)[task] for k in kept]),
                                           l2=l2, tolerance=1e-8)
        history = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        residuals[name] = [r["aggregation"]["cg_relative_residual"] for r in history if "aggregation" in r]
        uplinks[name] = [r["bytes_uplink"] for r in history]
        ends[name] = (env, state, task, minimizer, task_model(state.vectors, task))
    for name in ("trained", "retrained"):
        env, state, task, minimizer, w = ends[name]
        assert residuals[name][2] < 1e-4  # r₀, then two product rounds
        w0 = task_point(state.vectors, task)
        assert (w - minimizer).norm() <= 1e-3 * (minimizer - w0).norm()
        clients = state.scalars["factor_clients"]
        assert sorted(clients) == sorted(str(k) for k in state.scalars["gradient_samples"])
        with LowRankGaussNewton([(state.vectors[curvature_name(int(c))], 1.0) for c in clients]) as stack:
            unit = stack.gram()  # the Gram the server kept when the factors came, rows in factor_clients order
        torch.testing.assert_close(state.vectors[CURVATURE_GRAM]["gram"].double(), unit, rtol=1e-5,
                                   atol=1e-6 * float(unit.abs().max()))
    assert residuals["server"][2] > 1e2 * residuals["trained"][2]
    # the factors ride the first round's upload; the gradient round carries gradients alone
    assert uplinks["trained"][0] > uplinks["server"][0] + 3 * 4 * rank * rank
    assert uplinks["trained"][-1] == uplinks["server"][-1]

    def refuse(*args, **kwargs):
        raise AssertionError("a client was contacted during the removal")

    monkeypatch.setattr(ClientRuntime, "handle", refuse)
    env, state, task, _, _ = ends["trained"]
    removal = env.strategy.remove_client(state, env, 0)
    assert removal.hessian == "clients" and removal.form == "retained" and removal.damping == "objective"
    retrained = ends["retrained"][3]
    assert (task_model(removal.state.vectors, task) - retrained).norm() <= 1e-2 * removal.step_norm
