"""F²L², Forgettable Federated Linear Learning (Jin, Chen, Yang, Li and Li, 2023): federated linear
training, then certified removal of a client by one Newton step computed on the server alone.

    round 1 starts   the server pretrains w₀ on its own slice D_s of the training data (never sent;
                     `server_fraction`, cross-entropy, Adam; less a `hessian_holdout` share kept for H_s)
                     and keeps w₀ as the linearization point
    rounds 1..R−1    FedAvg (n_k-weighted) of the model linearized at w₀ (whole network:
                     f_lin(x; w) = f(x; w₀) + J(x)·(w − w₀)), trained on the squared error against
                     one-hot targets plus (λ/2)·‖w‖² (`l2`) and, with `ridge` ρ > 0, (λ_r/2)·‖w − w₀‖², λ_r =
                     ρ·λ_max(H_s) set by the server after pretraining (the objective's strong convexity, which
                     the paper's guarantee assumes), from w⁰ = w₀ (`start`)
    round R          a query: each client sends g_k = ∇D_k(w*), the gradient of its data term at the
                     final model, and n_k (the paper's last-round upload); with `curvature_rank` k > 0
                     also F_k, the top k eigenpairs of its data term's Hessian H_k at w₀ as rows √h·v
                     (Lanczos over Gauss-Newton products; k × P floats), so that F_kᵀF_k ≈ H_k;
                     meanwhile the server factors its own H_s at w₀ the same way
                     (`server_curvature_rank`, 128 by default), which depends on w₀ and D_s alone
    removal          `remove_client`: w₋ = w* − (H_s + λI)⁻¹·g₋, H_s the Gauss-Newton Hessian of
                     the linearized model on D_s (or its `hessian_holdout` share; exact: the loss is
                     quadratic), solved by conjugate gradient over Hessian-vector products
                     (`hf_fedtask.model.newton`: through the Jacobian, formed once, where it fits in
                     memory, else matrix-free), with λ = ρ·λ_max(H_s) (`removal_damping` relative, and
                     auto's choice without l2 or a ridge): a damping relative to the Hessian's own scale,
                     so one ρ serves a full MLP, LoRA and a linear probe, whose curvatures differ by orders
                     of magnitude; or λ = l2 + λ_r (`objective`, and auto's choice at the optimum of a
                     regularized objective), the exact Newton step of the trained objective;
                     a step longer than `removal_trust_radius`·‖w* − w₀‖ (how far training moved) is
                     refused by raising λ until it fits (a Levenberg-Marquardt trust region: where the
                     server's slice misses directions the clients' data use, H_s + λI is near λI there
                     and the step would blow up). With the clients' factors the removal's Hessian is the
                     retained clients' own instead, H₋ ≈ Σ_{k≠m} (n_k/n₋)·F_kᵀF_k (`hessian`): the
                     curvature H_s stands in for, in the directions the clients' data use. No message to
                     any client at removal time either way. With the server's factor of H_s kept from
                     the gradient round, λ_max is its top eigenvalue and every CG solve is preconditioned
                     by it (`SpectralPreconditioner`: exact on its span, λI beyond): the same step in a
                     few Hessian-vector products instead of the hundreds a long-tailed H_s takes at
                     λ = 0.002·λ_max, so removal time is a small share of retraining's even at 10 rounds.

g₋ stands for ∇F₋(w*), the gradient of the objective without client m at w*, in four forms (r(w) =
λ·w + λ_r·(w − w₀) the regularizer's gradient, ḡ₋ the retained clients' n-weighted mean gradient):
`retained` ḡ₋ + r(w*), exact; `target` −(n_m/n₋)·(g_m + r(w*)), the paper's, equal to it when w* is a
stationary point of the full objective (Σ_k n_k·g_k / n + r(w*) = 0); `difference` ∇F₋(w*) − ∇F(w*) =
(n_m/n)·(ḡ₋ − g_m), the client's share of the gradient alone, for a run that stops as far from its optimum
as retraining for the same rounds would (the gradient both leave behind cancels); and `split`, ḡ₋ + r(w*) +
λ·(H_s + λI)⁻¹·g_diff (g_diff the difference form), whose step is the retained form's plus the difference
form's filtered by λ/(h + λ) along each eigendirection of H_s (h its curvature there): where the server's
slice has curvature, the retained clients' gradient, which H_s (an IID sample of their data) models, sets
the step; where it has none, only the client's own share says what to undo (on the paper's MLP the trigger
sits in pixels clean images leave dark), and the split step keeps that share there. `auto` (the default)
takes the split form when the difference step at the damping's λ fits the trust region, and the retained
form, solved within the region, when it does not: the difference step divides the client's own gradient by
H_s + λI, and where the server's slice does not cover what the client's data move, it grows like 1/λ, a
share H_s cannot vouch for. `split` asked for by name takes the client's share within the region (λ raised
until the difference step fits) and the whole step at that λ.
A fifth form, `anchored`, damps toward w₀ instead of w*: w₋ = w₀ − (H + λI)⁻¹·(ĝ₋ − H·(w* − w₀)), ĝ₋ the
retained form, the minimizer of the retained objective's quadratic model plus (λ/2)·‖w − w₀‖², a ridge fit
of the retained clients' objective from where training started (a trust region on ‖w* − w₋‖ as for the
other forms). Gradient steps on the linearized model from w₀ move only within H₋'s range, so retraining
leaves w₀ alone where no retained datum has curvature, and where it moves there at all it is the
optimizer's path, not the data, that decides (on single-word text tasks retrainings in other orders end
farther apart than training moved); the anchored step returns those directions to w₀ and removes what the
client taught there with them. It needs the retained clients' whole curvature: with H_s or a truncated
factor, "no curvature in H" does not mean no retained datum uses the direction, and on the paper's MLP
(whose spectrum keeps a long tail at any rank a client can upload) it costs 3-4 points of accuracy. So
`auto` takes it when H is the clients' factors and they leave out at most `COMPLETE_TAIL` of λ
(Σ_k (n_k/n₋)·h_k over their k-th eigenvalues: the truncation is below the damping's resolution), and
decides between split and retained as above otherwise. The anchored form is the minimizer nearest w₀ of an
objective without regularization, whose minimizers are many where the data span fewer directions than the
model has. With l2 or a ridge (l2 + λ_r > 0) the retained objective has one minimizer, the point the
certificate compares with, and two cases reach it. Complete factors give its exact Newton step from any w*
(the objective is quadratic): `auto` takes the retained form with no trust region, and the auto damping
(`removal_damping` auto, the default) λ = l2 + λ_r, the objective's own (the relative damping stands in for
curvature H_s misses; complete factors miss none). And with H_s, at the optimum of the full objective, which the server
reads from the uploads (‖∇F(w*)‖ = ‖Σ_k (n_k/n)·g_k + r(w*)‖ at most `STATIONARY` of ‖∇F₋(w*)‖), the auto
damping takes λ = l2 + λ_r and `auto` the retained form (there the target, difference and retained forms
coincide) inside the trust region: a relative λ far above l2 blocks the step where the model moved against
l2 alone (`benchmarks/f2l2_at_optimum.py`: on the paper's MLP at the optimum of l2 = 0.01, λ = 0.002·λ_max
leaves the backdoor whole). Without l2 or a ridge the auto damping is the relative one. On the paper's MLP
(six seeds, l2 = 0) the split
step lands within a point of clean accuracy and two of BSR of retraining, where the difference form loses
1-2 points of accuracy and the retained form keeps a fifth of the backdoor; on a text probe with a 320-text
slice the difference step is 3.3-4.4 times the radius (three seeds), and the split step would cost 6 points
of accuracy that the retained form does not.
The official code (Nanboy-Ronan/2F2L-Federated-Unlearning) trains from a fresh init with λ = 0 and damps
the removal with λ it leaves out of g₋; `start: random`, `--gradient target` and a removal λ other than
the training one reproduce it.
`linear_solver: cg` trains the same objective by federated conjugate gradient instead of FedAvg: the objective is
quadratic (squared error on a model linear in w), so its minimizer solves one linear system,
(Σ_k (n_k/n)·H_k + (l2 + λ_r)·I)·w = b, which CG reaches in as many products as the system's effective
condition number asks. The first training round asks each client for its data gradient at w⁰ (the residual
r₀ = −∇F(w⁰)); each later one sends the direction p and asks for H_k·p (one Gauss-Newton product over the
client's data, an upload the size of the model, as FedAvg's), and the server takes the CG step. The server's
factor of H_s, formed after pretraining, preconditions it (`SpectralPreconditioner` at λ = l2 + λ_r); with
`curvature_rank` k > 0 the clients upload their factors with the first round's gradients instead of the gradient
round's (H_k at w₀ is the same in every round: the model is linear in w), and the preconditioner is the Woodbury
inverse of their n-weighted sum plus λI, the system's own matrix, exact where the factors are complete (CG
then stops after a few iterations instead of the hundreds a long-tailed spectrum at λ = l2 asks; the factors'
Gram is formed once, when they arrive, and kept for the removal too); with
l2 = λ_r = 0 plain CG, whose iterates stay in w⁰ + H's range: the minimizer nearest w⁰, where gradient descent
from w⁰ ends). Training so ends at the objective's optimum, the point the certificate assumes and
`objective_minimizer` computes centrally, and retraining without a client ends at its own in any order: the
gradient round then reads stationarity near 0 and the auto damping takes the objective's λ. Every CG round
must hear from exactly the first round's clients (`cg_clients`, kept in the state): a product over other clients
would belong to another system, so such a round is refused, before it is checkpointed.
One task per run (the removal acts on the shared model and that task's head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from hf_fedtask.client.objectives import AnchoredRidge, OneHotMSE
from hf_fedtask.core.state import (
    CURVATURE,
    CURVATURE_GRAM,
    GRADIENT,
    POINT,
    SERVER_CURVATURE,
    curvature_name,
    gradient_name,
    point_name,
)
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.strategies.base import (
    QUERY,
    SHARED,
    TRAIN,
    AggregatedState,
    Capabilities,
    ClientJob,
    ClientRemoval,
    GlobalState,
    Linearized,
    Strategy,
    as_point,
    average_heads,
    fedavg_shared,
    register_strategy,
    task_model,
    task_point,
    task_vectors,
)
from hf_fedtask.strategies.configs import AUTO, GRADIENT_FORMS, HESSIANS, F2L2Config
from hf_fedtask.strategies.fedavg import delta_update

PRETRAIN, LINEAR, GRADIENTS, DONE = "pretrain", "linear", "gradients", "done"
SPLIT, ANCHORED = "split", "anchored"
COMPLETE_TAIL = 0.01  # auto takes the anchored form where the factors' tail is at most this share of λ
STATIONARY = 0.1  # auto damping: w* is at the regularized objective's optimum where ‖∇F(w*)‖ ≤ this × ‖∇F₋(w*)‖
GRADIENT_QUERY = "data_gradient"
# linear_solver cg: its value, its first round's query, then each later training round's
CG, CG_START, CG_PRODUCT = "cg", "cg_gradient", "hessian_product"
CG_TOLERANCE = 1e-6  # stop (a zero direction, no pass over the data) at ‖r‖ ≤ this × ‖r₀‖, float32's floor
CG_DIRECTION, CG_RESIDUAL = "f2l2_cg/direction", "f2l2_cg/residual"  # its p and r, kept in the state
PRODUCT = "hessian_product"  # a client's answer to CG_PRODUCT: H_k·p
LOCAL_TRAINING = ("local_epochs", "local_steps", "learning_rate", "optimizer", "lr_scheduler", "warmup_steps",
                  "weight_decay")  # what linear_solver cg does not use (pretraining sets its own; it keeps batch_size)
RELATIVE, ABSOLUTE, OBJECTIVE = "relative", "absolute", "objective"
SERVER, CLIENTS = HESSIANS[1:]  # the removal's Hessian: the server's slice H_s, the clients' factors
NO_FACTORS = ("f2l2 removal: hessian 'clients' needs the clients' curvature factors, and this run's clients uploaded "
              "none (train with curvature_rank > 0, or take hessian 'server')")
RIDGE = "f2l2_ridge"  # the downlink's λ_r (one number; clients cannot compute it: D_s is the server's)
FACTOR_JACOBIAN_BYTES = 2 << 30  # a client forms its Jacobian for its factor up to this (once, at the end of
# training; then each of the factor's Lanczos products is two matrix products instead of a pass over its data)
EIGEN_ITERATIONS = 30  # Lanczos products for λ_max(H_s): measured, 8-20 reach a relative change of 1e-4
SERVER_FACTOR_BYTES = 256 << 20  # the server's factor of H_s kept with the run: `server_curvature_rank` is
# lowered to fit (rank × P float32; 128 rows of the paper's MLP are 43 MB)


def client_curvature(host, model: TaskVector, point: TaskVector, data, rank: int, seed: int) -> TaskVector:
    """A client's curvature factor F (FᵀF ≈ its data term's Hessian at `point`, the top `rank` eigenpairs)
    over its prepared `data`, as its gradient round uploads it: through its Jacobian where that fits
    `FACTOR_JACOBIAN_BYTES`, else matrix-free."""
    from hf_fedtask.model.newton import curvature_factor, hessian

    with hessian(host, point, data, max_bytes=FACTOR_JACOBIAN_BYTES) as products:
        return curvature_factor(products, model, rank, seed=seed)


def factor_tail(factor: TaskVector) -> float:
    """The smallest eigenvalue a curvature factor keeps (its last row's squared norm; 0 where the client's
    Hessian has fewer eigenvalues than the rank, `curvature_factor` pads with zero rows): a bound on the
    curvature it leaves out in any direction."""
    return float(sum(t[-1].double().pow(2).sum() for t in factor.values()))


@dataclass(frozen=True)
class RemovalOptions:
    """How `F2L2.remove_client` takes its Newton step, checked on construction (wherever the values come
    from: the API, the CLI, a recipe): the damping, `rho` for λ = ρ·λ_max(H_s) or `l2` for an absolute λ
    (at most one; neither: the run's `removal_damping` with its `removal_rho` / `removal_l2`), `gradient`
    the form of g₋ (`GRADIENT_FORMS`; `auto` picks anchored where the clients' factors are complete, else
    split or retained by the trust region, see the module docstring), at most `iterations`
    conjugate-gradient iterations (at least one) and the relative residual `tolerance` at which they stop,
    and `trust_radius` the cap on the step's norm as a multiple of ‖w* − w₀‖ (None: the run's
    `removal_trust_radius`; 0: none), and `hessian` where H comes from: `clients`, the
    retained clients' curvature factors (a run with `curvature_rank` > 0), `server`, the server's slice H_s,
    or `auto`, the clients' factors where the run has them."""

    l2: float | None = None
    rho: float | None = None
    gradient: str = AUTO
    iterations: int = 200
    tolerance: float = 1e-6
    trust_radius: float | None = None
    hessian: str = AUTO

    def __post_init__(self):
        if self.hessian not in HESSIANS:
            raise ConfigError(f"unknown removal Hessian {self.hessian!r}; choose one of {', '.join(HESSIANS)}")
        if self.gradient not in GRADIENT_FORMS:
            raise ConfigError(f"unknown gradient form {self.gradient!r}; choose one of {', '.join(GRADIENT_FORMS)}")
        if self.l2 is not None and self.rho is not None:
            raise ConfigError(f"f2l2 removal: give rho (λ = ρ·λ_max of the server's Hessian) or l2 (an absolute "
                              f"λ), not both; got rho {self.rho} and l2 {self.l2}")
        if self.l2 is not None and not self.l2 >= 0:
            raise ConfigError(f"f2l2 removal: l2 must be >= 0, got {self.l2}")
        if self.rho is not None and not self.rho > 0:
            raise ConfigError(f"f2l2 removal: rho must be > 0 (λ = ρ·λ_max of the server's Hessian), got {self.rho}")
        if self.gradient == AUTO and self.trust_radius == 0:
            raise ConfigError("f2l2 removal: the auto gradient form picks its form by the trust region; give "
                              "trust_radius > 0, or a form (difference, target, retained) to solve without one")
        if self.trust_radius is not None and not self.trust_radius >= 0:
            raise ConfigError(f"f2l2 removal: trust_radius must be >= 0 (a multiple of ‖w* − w₀‖; 0: no cap), "
                              f"got {self.trust_radius}")
        if self.iterations < 1:
            raise ConfigError(f"f2l2 removal: cg_iterations must be >= 1 (the conjugate-gradient iterations of the "
                              f"Newton step; 0 would leave the model as it is), got {self.iterations}")


@dataclass
class RemovalResult:
    """What `F2L2.remove_client` did: the new state, the damping λ it used (`damping` relative: ρ·λ_max,
    with λ_max(H_s) and the Lanczos products it took, 0 where it read λ_max from the server's stored factor;
    absolute: λ as given; objective: l2 + λ_r; raised from
    `untrusted_l2` where the step would have left the trust region), the form of g₋ asked for (`gradient`) and
    the one taken (`form`: `auto` takes anchored, split or retained; `difference_step`, the difference
    form's step that decided or that split took, else None; `curvature_tail`, with the clients' factors, what
    they leave out, which decided anchored) and how the solves went."""

    state: GlobalState
    client: int
    l2: float
    gradient: str
    cg_iterations: int
    relative_residual: float
    step_norm: float
    gradient_norm: float
    damping: str = ABSOLUTE
    rho: float | None = None
    lambda_max: float | None = None
    eigen_iterations: int = 0
    trust_radius: float = 0.0  # the cap on ‖step‖ (absolute; 0: none)
    untrusted_l2: float | None = None  # the damping's own λ when the cap raised it, else None
    solves: int = 1
    form: str = ""  # the form of g₋ the step took (`gradient`, or what `auto` chose)
    difference_step: float | None = None  # auto and split: ‖step‖ of the difference form (auto: at the damping's λ)
    hessian: str = SERVER  # the Hessian the step took: the server's slice or the retained clients' factors
    curvature_tail: float | None = None  # clients' factors: Σ (n_k/n₋)·(k-th eigenvalue), what they leave out
    stationarity: float | None = None  # ‖∇F(w*)‖ / ‖∇F₋(w*)‖ from the uploads (None: l2 + λ_r = 0)
    preconditioner_rank: int = 0  # the rows of the server's stored factor of H_s the solves were preconditioned
    # with (λ_max read from it, no Lanczos); 0: plain CG


@register_strategy
class F2L2(Strategy, Linearized, ClientRemoval):
    name = "f2l2"
    paper = ("Jin, Chen, Zhang and Li, Forgettable Federated Linear Learning with Certified Data Removal, 2023 "
             "(arXiv:2306.02216)")
    config_class = F2L2Config
    capabilities = Capabilities(linearized=True, client_removal=True, exports=("adapters", "linearized"),
                                personalization=False, classifier_only=(
                                    "its certified removal takes Newton steps on the Hessian of a linearized "
                                    "classifier's cross-entropy over its class outputs, the convex loss its "
                                    "guarantee is stated for; a causal LM's next-token loss is not that loss"))

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.total_rounds: int | None = None
        self._training_inverse = None  # linear_solver cg: (the clients' factors, their LowRankInverse), kept

    @property
    def server_fraction(self) -> float:
        return self.config.server_fraction

    def check_run(self, config) -> None:
        """Refuses what F²L² cannot do, and takes the run's length: its last round is the gradient query."""
        if config.participation < 1:
            raise ConfigError(f"strategy 'f2l2' needs every client in every round (participation 1, got "
                              f"{config.participation}): the removal needs each client's last-round gradient")
        if config.rounds < 2:
            raise ConfigError(f"strategy 'f2l2' needs rounds >= 2 (training rounds, then the gradient round), "
                              f"got {config.rounds}")
        tasks = config.tasks or []
        if config.suite or len(tasks) != 1:
            raise ConfigError("strategy 'f2l2' trains one task per run: give `tasks` with one task and no suite")
        if self.config.linear_solver == CG:
            defaults = {f.name: f.default for f in dataclasses.fields(config)}  # the run config's own defaults
            given = [name for name in LOCAL_TRAINING if getattr(config, name) != defaults[name]]
            if given:
                raise ConfigError(f"f2l2: linear_solver 'cg' trains by conjugate-gradient rounds, not local optimizer "
                                  f"steps, so {given[0]} ({getattr(config, given[0])!r}) would not apply; leave "
                                  f"{', '.join(given)} at their defaults or use linear_solver 'fedavg'")
        self.total_rounds = config.rounds

    # -- state -------------------------------------------------------------------------------------
    def phase(self, state: GlobalState) -> str:
        return state.scalars.get("phase", PRETRAIN)

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.scalars["phase"] = PRETRAIN
        return state

    def state_template(self, initial: GlobalState, scalars: dict) -> GlobalState:
        phase = scalars.get("phase", PRETRAIN)
        if phase == PRETRAIN:
            return initial
        vectors = {**initial.vectors, **as_point(initial.vectors)}
        if scalars.get("server_curvature_rank"):  # formed as the gradient round begins
            vectors[SERVER_CURVATURE] = self._factor_template(self._model(initial), scalars["server_curvature_rank"])
        model = self._model(initial)
        factors, gradients = {}, {}
        if scalars.get("curvature_rank"):  # the clients' factors: from the gradient round, or cg's first round
            factor = self._factor_template(model, scalars["curvature_rank"])
            clients = self.factor_clients(scalars)
            factors = {curvature_name(int(c)): factor for c in clients}
            if scalars.get("factor_gram"):  # their Gram, kept since (runs before it have none)
                size = scalars["curvature_rank"] * len(clients)
                factors[CURVATURE_GRAM] = TaskVector({"gram": torch.zeros((size, size), dtype=torch.float32)})
        if phase == DONE:
            gradients = {gradient_name(int(c)): model for c in scalars.get("gradient_samples", {})}
        # in the order the rounds add them (the order flattening follows): cg's factors come first, then its
        # direction and residual (gone after the last training round), the gradient round's last
        later = {**gradients, **factors}
        if self.config.linear_solver == CG:
            vectors.update(factors)
            later = gradients
        if phase == LINEAR and "cg_iterations" in scalars:  # linear_solver cg's direction and residual
            vectors.update({CG_DIRECTION: model, CG_RESIDUAL: model})
        return GlobalState(initial.round, {**vectors, **later}, dict(scalars))

    @staticmethod
    def _factor_template(model: TaskVector, rank: int) -> TaskVector:
        """The layout of a curvature factor of `rank` rows over `model`'s parameters."""
        return TaskVector({k: torch.zeros((rank, *v.shape), dtype=torch.float32) for k, v in model.items()})

    @staticmethod
    def _task(state: GlobalState) -> str:
        """The run's one task."""
        return state.tasks[0]

    def _model(self, state: GlobalState) -> TaskVector:
        """w: the shared modules and the task's head as one vector (saved names)."""
        return task_model(state.vectors, self._task(state))

    def linearization_point(self, state: GlobalState, task: str) -> TaskVector | None:
        """w₀, once the server has pretrained it (round 1); None before."""
        if self.phase(state) == PRETRAIN:
            return None
        return super().linearization_point(state, task)

    def server_split(self, env, task: str):
        """(the part of D_s the server pretrains w₀ on, the part its Hessian H_s is taken on): with
        `hessian_holdout` h > 0, a seeded share h of D_s is kept out of pretraining for H_s; with 0, D_s
        for both."""
        data = env.server_data(task)
        held = round(self.config.hessian_holdout * len(data))
        if held == 0 or held == len(data):
            return data, data
        order = np.random.default_rng(env.config.seed).permutation(len(data))
        return data.select(sorted(order[held:])), data.select(sorted(order[:held]))

    @staticmethod
    def ridge_lambda(state: GlobalState) -> float:
        """λ_r of the run's training objective (0 without a ridge)."""
        return float(state.scalars.get("ridge_lambda", 0.0))

    def regularizer_gradient(self, state: GlobalState, w: TaskVector, w0: TaskVector) -> TaskVector:
        """r(w) = l2·w + λ_r·(w − w₀), the gradient of the training objective's regularizer at w."""
        ridge = self.ridge_lambda(state)
        return w * self.config.l2 + (w - w0) * ridge if ridge else w * self.config.l2

    # -- the server's own work -----------------------------------------------------------------------
    def server_step(self, state: GlobalState, env) -> GlobalState:
        """Round 1: pretrain w₀ on D_s and keep it as the linearization point; with a ridge, set
        λ_r = ρ·λ_max(H_s) at w₀ (Lanczos on the server's slice). The gradient round: factor H_s
        (`server_curvature_rank`) while the clients compute their gradients (with linear_solver cg, right after
        pretraining: it preconditions the training rounds' CG)."""
        if self.phase(state) == GRADIENTS:
            return self.factor_server_hessian(state, env)
        if self.phase(state) != PRETRAIN:
            return state
        from hf_fedtask.client.trainer import LocalTrainer

        task = self._task(state)
        w0 = self._model(state)
        c = self.config
        if c.pretrain_epochs > 0:
            args = dataclasses.replace(env.trainer.args, local_epochs=c.pretrain_epochs, local_steps=-1,
                                       learning_rate=c.pretrain_lr, optimizer="adamw_torch", lr_scheduler="cosine",
                                       warmup_steps=0, weight_decay=0.0)
            w0, _ = LocalTrainer(env.host, args).train(w0, self.server_split(env, task)[0], seed=env.config.seed)
        pretrained = task_vectors(w0, state.vectors, task)
        vectors = as_point(pretrained)
        if c.start == "pretrained":  # w⁰ = w₀; otherwise training starts from the initialization
            vectors.update(pretrained)
        scalars = {**state.scalars, "phase": LINEAR}
        if c.ridge > 0:
            from hf_fedtask.model.newton import hessian, largest_eigenvalue

            with hessian(env.host, w0, self.server_split(env, task)[1], env.config.eval_batch_size) as products:
                lambda_max, _ = largest_eigenvalue(products, w0, iterations=EIGEN_ITERATIONS, seed=env.config.seed)
            scalars.update(ridge_lambda=c.ridge * lambda_max, ridge_lambda_max=lambda_max)
        state = GlobalState(state.round, {**state.vectors, **vectors}, scalars)
        return self.factor_server_hessian(state, env) if c.linear_solver == CG else state  # CG's preconditioner

    def factor_server_hessian(self, state: GlobalState, env) -> GlobalState:
        """The state with the server's factor F_s of H_s at w₀ (`SERVER_CURVATURE`, FᵀF ≈ H_s, the top
        `server_curvature_rank` eigenpairs, the rank lowered to fit `SERVER_FACTOR_BYTES`). It depends on w₀
        and D_s alone, so the server can form it before any removal is asked for, and every removal then
        reads λ_max from it and preconditions its solves with it (`SpectralPreconditioner`)."""
        rank = self.config.server_curvature_rank
        if not rank or SERVER_CURVATURE in state.vectors:
            return state
        from hf_fedtask.model.newton import curvature_factor, hessian

        task = self._task(state)
        point = task_point(state.vectors, task)
        rank = min(rank, SERVER_FACTOR_BYTES // (4 * sum(t.numel() for t in point.values())))
        if rank < 1:
            return state
        with hessian(env.host, point, self.server_split(env, task)[1], env.config.eval_batch_size) as products:
            factor = curvature_factor(products, point, rank, seed=env.config.seed)
        return GlobalState(state.round, {**state.vectors, SERVER_CURVATURE: factor},
                           {**state.scalars, "server_curvature_rank": rank})

    # -- communication -----------------------------------------------------------------------------
    def message_kind(self, state: GlobalState) -> str:
        phase = self.phase(state)
        if phase == DONE:
            raise ConfigError("f2l2: the run ended with its gradient round; more rounds would make the clients' "
                              "gradients stale (start a new run)")
        return QUERY if phase == GRADIENTS or self.config.linear_solver == CG else TRAIN

    def query_name(self, state: GlobalState) -> str:
        if self.phase(state) == GRADIENTS:
            return GRADIENT_QUERY
        if self.config.linear_solver == CG:
            return CG_PRODUCT if "cg_iterations" in state.scalars else CG_START
        return ""

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        """w, the linearization point w₀ and, with a ridge, λ_r (clients cannot rebuild either: D_s is
        the server's)."""
        model = super().downlink(state, client_id, tasks)
        extra = {RIDGE: TaskVector({"lambda": torch.tensor([self.ridge_lambda(state)])})} if self.config.ridge else {}
        if CG_DIRECTION in state.vectors and self.phase(state) == LINEAR:  # linear_solver cg: the direction p
            extra[CG_DIRECTION] = state.vectors[CG_DIRECTION]
        return {**model, **{point_name(k): state.vectors[point_name(k)] for k in model}, **extra}

    def factor_query(self, query: str) -> bool:
        """Whether the clients' curvature factors (`curvature_rank` > 0) come with this query's answer: the
        gradient round's, or with linear_solver cg the first round's, where they also precondition training (the
        model is linear in w, so H_k at w₀ is the same in every round)."""
        return bool(self.config.curvature_rank) and query == (CG_START if self.config.linear_solver == CG
                                                               else GRADIENT_QUERY)

    def update_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        query = self.query_name(state)
        if query == CG_PRODUCT:
            return {PRODUCT: self._model(state)}
        if query in (GRADIENT_QUERY, CG_START):
            model = self._model(state)
            if not self.factor_query(query):
                return {GRADIENT: model}
            return {GRADIENT: model, CURVATURE: self._factor_template(model, self.config.curvature_rank)}
        return super().downlink(state, client_id, tasks)

    # -- client ------------------------------------------------------------------------------------
    def client_update(self, downlink, job: ClientJob, trainer) -> ClientUpdate:
        ridge = float(downlink[RIDGE]["lambda"][0]) if RIDGE in downlink else 0.0

        def options(task: str) -> dict:
            point = task_point(downlink, task)
            objectives = [OneHotMSE(l2=self.config.l2)] + ([AnchoredRidge(ridge, point)] if ridge else [])
            return {"linearize_at": point, "objectives": objectives}

        model = {k: v for k, v in downlink.items() if not k.startswith(POINT) and k != RIDGE}
        return delta_update(model, job, trainer, options=options)

    def client_query(self, downlink, job: ClientJob, trainer) -> ClientUpdate:
        if job.query not in (GRADIENT_QUERY, CG_START, CG_PRODUCT):
            raise ProtocolError(f"f2l2: unknown query {job.query!r}")
        from hf_fedtask.model.newton import data_gradient, gauss_newton_product

        (task,) = job.tasks
        model, point, data = task_model(downlink, task), task_point(downlink, task), job.data[task]
        if job.query == CG_PRODUCT:  # H_k·p; a zero direction (CG has converged) needs no pass over the data
            direction = downlink[CG_DIRECTION]
            product = (direction.zeros_like() if direction.norm() == 0
                       else gauss_newton_product(trainer.host, point, direction, data))
            return ClientUpdate(job.client_id, job.round, {PRODUCT: product}, job.num_samples(), {})
        gradient, loss = data_gradient(trainer.host, model, point, data)
        vectors = {GRADIENT: gradient}
        if self.factor_query(job.query):  # the top eigenpairs of this client's H_k, for the removal's H₋
            vectors[CURVATURE] = client_curvature(trainer.host, model, point, data, self.config.curvature_rank,
                                                  seed=job.client_id)
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), {"data_loss": loss})

    # -- server ------------------------------------------------------------------------------------
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        if self.phase(state) == GRADIENTS:
            vectors = {gradient_name(u.client_id): u.vectors[GRADIENT] for u in updates}
            samples = {str(u.client_id): u.total_samples for u in updates}
            return state.next({**vectors, **self.uploaded_factors(updates, GRADIENT_QUERY)}, phase=DONE,
                              gradient_samples=samples, **self.factor_scalars(state, updates, GRADIENT_QUERY))
        last_training = self.total_rounds is not None and state.round + 2 >= self.total_rounds
        if self.config.linear_solver == CG:
            return self.conjugate_gradient_step(state, updates, last_training)
        vectors = {SHARED: fedavg_shared(state, updates), **average_heads(state, updates)}
        return state.next(vectors, phase=GRADIENTS if last_training else LINEAR)

    @staticmethod
    def factor_clients(scalars: dict) -> list[str]:
        """The clients whose factors the state holds, in the order of their kept Gram's rows (runs made before
        `factor_clients` was kept: the gradient round's clients)."""
        return scalars.get("factor_clients", list(scalars.get("gradient_samples", {})))

    def uploaded_factors(self, updates: list[ClientUpdate], query: str) -> dict[str, TaskVector]:
        """The clients' curvature factors this query's answers carry, by their state names, and their Gram at
        unit weights (`CURVATURE_GRAM`, rows in `factor_clients` order), formed here once so that neither training
        nor a removal takes the block products again (for two LoRA clients of rank 1,920, seconds of a removal's
        time); none: {}."""
        if not self.factor_query(query):
            return {}
        by_client = {str(u.client_id): u.vectors[CURVATURE] for u in updates}
        factors = {curvature_name(int(c)): by_client[c] for c in sorted(by_client)}
        return {**factors, CURVATURE_GRAM: self.factor_gram(list(factors.values()))}

    @staticmethod
    def factor_gram(factors: list[TaskVector]) -> TaskVector:
        """The Gram of these factors' stacked rows at unit weights (`LowRankGaussNewton.gram`, float32), as the
        state keeps it (`CURVATURE_GRAM`)."""
        from hf_fedtask.model.newton import LowRankGaussNewton

        with LowRankGaussNewton([(f, 1.0) for f in factors]) as stack:
            return TaskVector({"gram": stack.gram().float()})

    def factor_scalars(self, state: GlobalState, updates: list[ClientUpdate], query: str) -> dict:
        """The scalars that say which factors the state holds (`curvature_rank`, `factor_clients`, `factor_gram`):
        set by the query that carried them, kept after."""
        if not self.factor_query(query):
            return {"curvature_rank": state.scalars.get("curvature_rank", 0)}
        return {"curvature_rank": self.config.curvature_rank, "factor_gram": True,
                "factor_clients": sorted(str(u.client_id) for u in updates)}

    def factor_inverse(self, state: GlobalState, weights: dict[str, float]):
        """(the operator v ↦ Σ_c w_c·F_cᵀF_c·v over the factors of the clients in `weights`, as a context manager
        (`LowRankGaussNewton`), a function of it giving its `LowRankInverse` from the kept Gram where the run
        kept one)."""
        from hf_fedtask.model.newton import LowRankGaussNewton

        clients, rank = self.factor_clients(state.scalars), state.scalars["curvature_rank"]
        chosen = [c for c in clients if c in weights]
        operator = LowRankGaussNewton([(state.vectors[curvature_name(int(c))], weights[c]) for c in chosen])
        if CURVATURE_GRAM not in state.vectors:
            return operator, lambda stack: stack.inverse()
        rows = torch.cat([torch.arange(i * rank, (i + 1) * rank) for i, c in enumerate(clients) if c in weights])
        unit = state.vectors[CURVATURE_GRAM]["gram"][rows][:, rows]
        return operator, lambda stack: stack.inverse(unit)

    def training_preconditioner(self, state: GlobalState, updates: list[ClientUpdate], lam: float):
        """linear_solver cg's M⁻¹ at λ = l2 + λ_r: with the clients' factors (`curvature_rank` > 0), the Woodbury
        inverse of Σ_k (n_k/n)·F_kᵀF_k + λI (`LowRankInverse`), the system's own Hessian (complete factors: exact
        up to float32, so CG stops in a few rounds: 2 on a probe, 4-9 on LoRA); else the server's factor of H_s
        (`SpectralPreconditioner`), which stands in for it; with λ = 0, none (M⁻¹ divides by λ beyond the factors'
        span)."""
        from hf_fedtask.model.newton import SpectralPreconditioner

        clients = state.scalars.get("factor_clients", [])
        if lam <= 0 or (not clients and SERVER_CURVATURE not in state.vectors):
            return lambda r: r
        if not clients:
            server = SpectralPreconditioner(state.vectors[SERVER_CURVATURE])
            return lambda r: server(r, lam)
        n = {str(u.client_id): u.total_samples for u in updates}
        total = sum(n[c] for c in clients)
        factors = [(state.vectors[curvature_name(int(c))], n[c] / total) for c in clients]
        cached = self._training_inverse
        if cached is None or len(cached[0]) != len(factors) or not all(
                f is g and a == b for (f, a), (g, b) in zip(cached[0], factors)):  # the same factors every round
            operator, inverse = self.factor_inverse(state, {c: n[c] / total for c in clients})
            with operator as stack:  # stacked once a run (and after a resume)
                self._training_inverse = cached = (factors, inverse(stack))
        return lambda r: cached[1](r, lam)

    @staticmethod
    def check_cg_clients(state: GlobalState, updates: list[ClientUpdate]) -> list[int]:
        """The clients of linear_solver cg's first round (`cg_clients`, kept in the state's scalars, so they survive
        a resume), refusing a later round whose replies are not exactly theirs: each CG product must be
        Σ_k (n_k/n)·H_k·p over the same clients as r₀, or the iterates stop being conjugate gradient of one
        system (and the clients' factors, with `curvature_rank` > 0, would miss a client's sample count).
        Raised in `server_aggregate`: the run loop neither checkpoints nor records the round. A checkpoint made before
        `cg_clients` was kept: the factors' clients where it has them, else this round's."""
        replied = sorted(u.client_id for u in updates)
        kept = state.scalars.get("cg_clients", state.scalars.get("factor_clients"))
        if kept is None:
            return replied
        expected = sorted(int(c) for c in kept)
        missing, extra = sorted(set(expected) - set(replied)), sorted(set(replied) - set(expected))
        if not missing and not extra:
            return expected

        def named(ids: list[int]) -> str:
            return f"client{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}"

        faults = ([f"{named(missing)} did not reply"] if missing else []) + (
            [f"{named(extra)} replied but took no part in the first round"] if extra else [])
        raise ProtocolError(f"f2l2 linear_solver cg, round {state.round + 1}: {' and '.join(faults)} (clients of the "
                            f"first round: {', '.join(map(str, expected))}); conjugate gradient needs every "
                            f"product over the same clients; round {state.round + 1} is not checkpointed: rerun "
                            "with --resume once every client of the first round replies")

    def conjugate_gradient_step(self, state: GlobalState, updates: list[ClientUpdate],
                                last_training: bool) -> AggregatedState:
        """linear_solver cg's server side: one iteration of preconditioned CG on ∇F(w) = 0 (`CGIterate`, the
        iteration `conjugate_gradient` loops over; here each product A·p = Σ_k (n_k/n)·H_k·p + (l2 + λ_r)·p is a
        round). The first round's uploads are the clients' data gradients at w⁰, which give r₀ = −∇F(w⁰); each
        later round's are H_k·p. The diagnostics log ‖r‖/‖r₀‖ each round; at `CG_TOLERANCE` the direction
        becomes zero and the model stays."""
        from hf_fedtask.model.newton import CGIterate

        first = "cg_iterations" not in state.scalars
        clients = sorted(u.client_id for u in updates) if first else self.check_cg_clients(state, updates)
        task, n = self._task(state), sum(u.total_samples for u in updates)
        w, w0 = self._model(state), task_point(state.vectors, task)
        lam = self.config.l2 + self.ridge_lambda(state)
        factors = self.uploaded_factors(updates, CG_START) if first else {}
        scalars = {**state.scalars, **(self.factor_scalars(state, updates, CG_START) if first else {}),
                   "cg_clients": clients}
        precondition = self.training_preconditioner(GlobalState(state.round, {**state.vectors, **factors}, scalars),
                                                    updates, lam)

        def mean(name: str) -> TaskVector:  # Σ_k (n_k/n)·upload_k
            return sum((u.vectors[name] * (u.total_samples / n) for u in updates), w.zeros_like())

        if first:  # r₀ = −∇F(w⁰) from the clients' data gradients
            r = (mean(GRADIENT) + self.regularizer_gradient(state, w, w0)) * -1.0
            iterate, stopped = CGIterate.start(w, r, precondition), r.norm() == 0
            scalars.update(cg_iterations=0, cg_initial=float(r.norm()))
        else:
            iterate = CGIterate(w, state.vectors[CG_RESIDUAL], state.vectors[CG_DIRECTION], scalars["cg_rz"])
            stopped = iterate.p.norm() == 0
            if not stopped:
                iterate, stopped = iterate.step(mean(PRODUCT) + iterate.p * lam, precondition,
                                                CG_TOLERANCE * scalars["cg_initial"])
                scalars["cg_iterations"] += 1
        relative = float(iterate.r.norm()) / scalars["cg_initial"] if scalars["cg_initial"] > 0 else 0.0
        scalars.update(cg_rz=iterate.rz, cg_relative_residual=relative, phase=GRADIENTS if last_training else LINEAR)
        vectors = {k: v for k, v in {**state.vectors, **factors}.items() if k not in (CG_DIRECTION, CG_RESIDUAL)}
        if not last_training:  # the gradient round needs neither; a zero direction: converged, no more passes
            vectors.update({CG_DIRECTION: iterate.p.zeros_like() if stopped else iterate.p, CG_RESIDUAL: iterate.r})
        vectors.update(task_vectors(iterate.x, state.vectors, task))
        return AggregatedState(state.round + 1, vectors, scalars,
                               diagnostics={"cg_iterations": scalars["cg_iterations"],
                                            "cg_relative_residual": relative})

    # -- removal -----------------------------------------------------------------------------------
    def remove_client(self, state: GlobalState, env, client: int, options: RemovalOptions | None = None, *,
                      hessian_data=None) -> RemovalResult:
        """w₋ = w* − (H_s + λI)⁻¹·g₋ from the final state and the server's data alone (no client is
        contacted), as `options` say (`RemovalOptions`: by default the run's damping, λ = ρ·λ_max(H_s)
        with λ_max from the server's stored factor of H_s, which also preconditions every CG solve (a run
        without one: λ_max by Lanczos over the same products CG uses, plain CG), and the auto form of g₋: the
        anchored form where the clients' factors leave out at most `COMPLETE_TAIL`·λ (of a regularized objective:
        the retained form at λ = l2 + λ_r, its exact Newton step), else the split form
        where the difference step fits the trust region, else the retained form; see the module docstring).
        `hessian_data`: prepared data to build H from instead of D_s, for measurement only (the retained
        clients' data give the step the approximation H_s ≈ H₋ stands in for)."""
        from hf_fedtask.model.newton import (
            SpectralPreconditioner,
            TrustInfo,
            conjugate_gradient,
            hessian,
            largest_eigenvalue,
            solve_within_radius,
        )

        options = options or RemovalOptions()
        if self.phase(state) != DONE:
            raise ConfigError("f2l2 removal needs a finished F²L² run (its last round collects the clients' gradients)")
        samples = {int(c): int(n) for c, n in state.scalars["gradient_samples"].items()}
        if client not in samples:
            raise ConfigError(f"unknown client {client}; the run's clients with gradients are "
                              f"{', '.join(map(str, sorted(samples)))}")
        if len(samples) < 2:
            raise ConfigError("f2l2 removal needs at least one client left after the removal")
        c = self.config
        lam_train, gradient = c.l2, options.gradient
        ridge = self.ridge_lambda(state)
        regularized = lam_train + ridge  # the trained objective's own curvature beyond the data's
        task = self._task(state)
        w, w0 = self._model(state), task_point(state.vectors, task)
        regularizer = self.regularizer_gradient(state, w, w0)  # r(w*), see the module docstring
        n_m, n_rest = samples[client], sum(samples.values()) - samples[client]
        g_m = state.vectors[gradient_name(client)]
        retained = sum((state.vectors[gradient_name(k)] * (n / n_rest) for k, n in samples.items() if k != client),
                       w.zeros_like())  # ḡ₋
        forms = {"target": lambda: (g_m + regularizer) * (-n_m / n_rest),
                 "difference": lambda: (retained - g_m) * (n_m / (n_rest + n_m)),
                 "retained": lambda: retained + regularizer}
        # how far w* is from the full objective's stationary point: ‖∇F(w*)‖ over ‖∇F₋(w*)‖, from the uploads
        stationarity = None
        if regularized > 0:
            full = ((retained * n_rest + g_m * n_m) * (1 / (n_rest + n_m)) + regularizer).norm()
            rest = forms["retained"]().norm()
            stationarity = float(full / rest) if rest > 0 else (0.0 if full == 0 else float("inf"))
        uploaded = bool(state.scalars.get("curvature_rank"))
        if options.hessian == CLIENTS and not uploaded:
            raise ConfigError(NO_FACTORS)
        if options.hessian == CLIENTS and hessian_data is not None:
            raise ConfigError("f2l2 removal: hessian_data builds H from data; it does not combine with hessian "
                              "'clients' (the uploaded factors)")
        source = CLIENTS if uploaded and options.hessian != SERVER and hessian_data is None else SERVER
        if source == CLIENTS:  # H₋ ≈ Σ_k (n_k/n₋)·F_kᵀF_k over the retained clients' uploaded factors
            operator, factor_inverse = self.factor_inverse(
                state, {str(k): n / n_rest for k, n in samples.items() if k != client})
        else:
            data = self.server_split(env, task)[1] if hessian_data is None else hessian_data
            operator = hessian(env.host, w0, data, env.config.eval_batch_size)
        lambda_max, eigen_iterations = None, 0
        factor = c.removal_trust_radius if options.trust_radius is None else options.trust_radius
        if gradient == AUTO and factor == 0:
            raise ConfigError("f2l2 removal: the auto gradient form picks its form by the trust region, and this "
                              "run's removal_trust_radius is 0; give trust_radius > 0 or a form (difference, "
                              "target, retained)")
        radius = factor * (w - w0).norm()
        tail = None if source == SERVER else sum(
            factor_tail(state.vectors[curvature_name(k)]) * n / n_rest for k, n in samples.items() if k != client)
        whole = regularized > 0 and tail is not None and tail <= COMPLETE_TAIL * regularized  # H₋ complete at l2+λ_r
        stationary = stationarity is not None and stationarity <= STATIONARY
        # at the optimum, H_s's λ is the objective's; truncated factors keep the relative damping, which covers
        # the curvature they leave out (on digits at the optimum, rank 32 at λ = l2 costs 32 points)
        if options.l2 is not None or (options.rho is None and c.removal_damping == ABSOLUTE):
            damping, rho = ABSOLUTE, None
            lam = c.removal_l2 if options.l2 is None else options.l2
        elif options.rho is None and (c.removal_damping == OBJECTIVE
                                      or (c.removal_damping == AUTO and (whole or (stationary and source == SERVER)))):
            damping, rho, lam = OBJECTIVE, None, regularized
        else:
            damping, rho = RELATIVE, c.removal_rho if options.rho is None else options.rho
        # the server's stored factor of H_s (formed in the gradient round): λ_max and the solves' preconditioner
        stored = source == SERVER and hessian_data is None and SERVER_CURVATURE in state.vectors
        preconditioner = SpectralPreconditioner(state.vectors[SERVER_CURVATURE]) if stored else None
        with operator as products:
            if source == CLIENTS:  # H₋ is the factors' stack: its exact inverse at any λ, from their kept Gram
                preconditioner = factor_inverse(products)
            if damping == RELATIVE and preconditioner is not None:
                lambda_max = preconditioner.largest
                lam = rho * lambda_max
            elif damping == RELATIVE:
                lambda_max, eigen = largest_eigenvalue(products, w, iterations=EIGEN_ITERATIONS, seed=env.config.seed)
                lam, eigen_iterations = rho * lambda_max, eigen.iterations
            if not lam > 0:
                preconditioner = None  # M⁻¹ divides by λ; an undamped solve runs plain CG
            solve = dict(iterations=options.iterations, tolerance=options.tolerance, preconditioner=preconditioner)
            form, difference_step, trust, tried, exact = gradient, None, None, 0, False
            complete = tail is not None and tail <= COMPLETE_TAIL * lam  # the factors hold H₋ at λ's resolution
            if gradient == AUTO and complete and regularized > 0:
                form, exact = "retained", True  # one minimizer, H₋ whole: the exact Newton step, no trust region
            elif gradient == AUTO and complete:
                form = ANCHORED  # many minimizers: the one nearest w₀
            elif gradient == AUTO and damping == OBJECTIVE and stationary:
                form = "retained"  # at the optimum: the objective's own Newton step, inside the trust region
            if form == ANCHORED:  # w₋ = w₀ − (H + λI)⁻¹·(ĝ₋ − H·(w* − w₀)): a damped Newton step from w₀
                moved, g = w - w0, forms["retained"]()
                from_w0, trust = solve_within_radius(products, g - products(moved), damping=lam, radius=radius,
                                                     offset=moved, **solve)
                step = moved + from_w0
            elif form in (AUTO, SPLIT):  # the split form where the server's Hessian vouches for the client's
                # share (its difference step fits the trust region), else (auto) the retained form
                if gradient == AUTO:
                    share, info = conjugate_gradient(products, forms["difference"](), damping=lam, **solve)
                    share_trust = TrustInfo(lam, 1, info)
                else:
                    share, share_trust = solve_within_radius(products, forms["difference"](), damping=lam,
                                                             radius=radius, **solve)
                difference_step = share.norm()
                if gradient == SPLIT or difference_step <= radius:
                    form, lam_split = SPLIT, share_trust.damping
                    g = forms["retained"]() + share * lam_split  # λ·(H_s+λI)⁻¹·g_diff: the share H_s is blind to
                    step, info = conjugate_gradient(products, g, damping=lam_split, **solve)
                    trust = TrustInfo(lam_split, share_trust.solves + 1, info)
                else:
                    form, tried = "retained", 1
            if trust is None and exact:
                g = forms[form]()
                step, info = conjugate_gradient(products, g, damping=lam, **solve)
                trust = TrustInfo(lam, 1, info)
            elif trust is None:
                g = forms[form]()
                step, trust = solve_within_radius(products, g, damping=lam, radius=radius, **solve)
        untrusted, lam, info = (lam if trust.damping != lam else None), trust.damping, trust.solve
        removed = w - step
        new = GlobalState(state.round, {**state.vectors, **task_vectors(removed, state.vectors, task)},
                          dict(state.scalars))
        return RemovalResult(new, client, lam, gradient, info.iterations, info.relative_residual, step.norm(),
                             g.norm(), damping, rho, lambda_max, eigen_iterations, radius, untrusted,
                             trust.solves + tried, form, difference_step, source, tail, stationarity,
                             len(preconditioner.values) if stored and preconditioner is not None else 0)
