"""Second-order pieces of F²L²'s removal step (Jin et al., 2023) for a model linearized around w₀
(`hf_fedtask.model.linearize`, whole network), with the loss of its training, the squared error
against one-hot targets summed over classes and averaged over samples (`OneHotMSE`):

    D(w)  = (1/n)·Σ_x ‖f_lin(x; w) − onehot(y)‖²          data term
    ∇D(w) = (2/n)·Σ_x J(x)ᵀ(f_lin(x; w) − onehot(y))     `data_gradient`
    H·v   = (2/n)·Σ_x J(x)ᵀJ(x)·v                        `gauss_newton_product` (exact: D is quadratic)

H·v costs one forward pass with a jvp (J·v) and one backward pass (Jᵀ·), never the P × P matrix
(`GaussNewton`); where the trainable part is small beside the frozen model and the Jacobian itself, n·C × P
floats (C outputs), fits `JACOBIAN_BYTES`, it is formed once from the per-sample output gradients
(`hf_fedtask.model.entk`, C backward passes over the data) and every product is two matrix products
(`JacobianGaussNewton`): a linear probe or LoRA on a few hundred server texts then takes a removal's 30-250
products for about the price of two (`hessian` picks; `benchmarks/gauss_newton_bench.py` measures it).
`conjugate_gradient` solves (H + λI)·v = g with these products, and `largest_eigenvalue` finds λ_max(H) with
them (Lanczos), the scale F²L²'s default damping λ = ρ·λ_max is set against; `objective_minimizer` is
where training that reached its optimum ends. `curvature_factor` keeps H's top
eigenpairs (Lanczos over one basis matrix), and two preconditioners make CG take a few iterations where a
long-tailed H at λ = 0.002·λ_max takes a hundred: `SpectralPreconditioner` from such a factor of H (the
server's, formed before any removal) and `LowRankInverse`, the exact inverse of a stack of factors
(`LowRankGaussNewton`, the clients' uploads). Vectors are `TaskVector`s of
the trainable parameters by PEFT saved name. Hand-written: torch has no CG over parameter dicts and the
Hessian-free libraries around are unmaintained. Batches go to the host model's device; the
vectors returned are CPU tensors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from datasets import Dataset
from torch.utils.data import DataLoader

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.model.device import model_device, to_cpu, to_device
from hf_fedtask.model.host import PeftHost


def _batches(host: PeftHost, data: Dataset, batch_size: int):
    for batch in DataLoader(data, batch_size=batch_size, collate_fn=host.inputs.collator):
        labels = batch.pop("labels")
        yield batch, labels


def _gradients(host: PeftHost) -> TaskVector:
    """The trainable parameters' gradients by saved name, as CPU tensors."""
    params = host.trainable_by_name()
    return TaskVector({k: to_cpu(p.grad) if p.grad is not None else torch.zeros_like(p, device="cpu")
                       for k, p in params.items()})


def data_gradient(host: PeftHost, state: TaskVector, point: TaskVector, data: Dataset,
                  batch_size: int = 128) -> tuple[TaskVector, float]:
    """(∇D(w), D(w)) at w = `state` for the model linearized at `point`, over prepared `data` (eval mode)."""
    n = len(data)
    with host.loaded(state, point) as model:
        model.eval()
        model.zero_grad(set_to_none=True)
        device = model_device(model)
        total = 0.0
        with torch.enable_grad():
            for inputs, labels in _batches(host, data, batch_size):
                inputs, labels = to_device(inputs, device), labels.to(device)
                logits = model(**inputs).logits
                loss = ((logits - F.one_hot(labels, logits.shape[-1]).to(logits.dtype)) ** 2).sum() / n
                loss.backward()
                total += float(loss.detach())
        grads = _gradients(host)
        model.zero_grad(set_to_none=True)
    return grads, total


class GaussNewton:
    """v ↦ H·v over prepared `data`, H the Hessian of D (independent of w for the linearized model).
    Used as a context manager: the model is linearized at `point` and the data collated once, and
    each product only moves the live parameters to point + v (the batches are moved to the model's
    device once, on entering)."""

    def __init__(self, host: PeftHost, point: TaskVector, data: Dataset, batch_size: int = 512):
        self.host, self.point, self.n = host, point, len(data)
        self.batches = [inputs for inputs, _ in _batches(host, data, batch_size)]

    def __enter__(self) -> GaussNewton:
        self._context = self.host.loaded(self.point, self.point)
        self.model = self._context.__enter__()
        self.model.eval()
        self.params = self.host.trainable_by_name()
        device = model_device(self.model)
        self.batches = [to_device(inputs, device) for inputs in self.batches]
        return self

    def __exit__(self, *exc) -> None:
        self.model.zero_grad(set_to_none=True)
        self._context.__exit__(*exc)

    def __call__(self, v: TaskVector) -> TaskVector:
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(self.point[k] + v[k])
        self.model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            for inputs in self.batches:
                jv = self.model.tangent_logits(inputs)  # J·v, since the model sits at point + v
                ((jv ** 2).sum() / self.n).backward()  # gradient (2/n)·Jᵀ(J·v)
        return _gradients(self.host)


JACOBIAN_BYTES = 512 << 20  # the largest Jacobian `hessian` forms (float32): LoRA on MiniLM over 320 texts is ~190 MB


class JacobianGaussNewton:
    """v ↦ H·v = (2/n)·Jᵀ(J·v) with J (n·C × P, float32, on the CPU) formed on entering from the model's
    per-sample output gradients at `point` (`hf_fedtask.model.entk`: one forward and C backward passes
    per batch); the same operator as `GaussNewton` (J is the linearized model's Jacobian at its point),
    for `outputs` = C classes. Vectors map to J's columns in the host's saved-name order."""

    def __init__(self, host: PeftHost, point: TaskVector, data: Dataset, outputs: int):
        self.host, self.point, self.data, self.outputs, self.n = host, point, data, outputs, len(data)

    def __enter__(self) -> JacobianGaussNewton:
        from hf_fedtask.model.entk import entk_features

        self.keys = self.host.state_keys()  # J's column order
        self.shapes = {k: self.point[k].shape for k in self.keys}
        index = torch.arange(sum(math.prod(shape) for shape in self.shapes.values()))
        self.jacobian = torch.cat([entk_features(self.host, self.point, self.data, index, output=c)
                                   for c in range(self.outputs)])
        return self

    def __exit__(self, *exc) -> None:
        self.jacobian = None

    def __call__(self, v: TaskVector) -> TaskVector:
        flat = TaskVector({k: v[k] for k in self.keys}).flatten().float()
        return TaskVector.unflatten(self.jacobian.T @ (self.jacobian @ flat) * (2.0 / self.n), self.shapes)


def hessian(host: PeftHost, point: TaskVector, data: Dataset, batch_size: int = 512,
            max_bytes: int = JACOBIAN_BYTES) -> GaussNewton | JacobianGaussNewton:
    """The Gauss-Newton operator of `data` at `point`, as a context manager: with the Jacobian formed
    (`JacobianGaussNewton`) when it pays and fits, else matrix-free (`GaussNewton`). It pays when the C·P
    trainable outputs' derivatives are at most half the model's parameter count N: a product through J
    costs 2·C·P multiply-adds per sample, a matrix-free one at least a forward pass, ≥ N (a probe or LoRA on
    a frozen encoder: C·P ≪ N; a model trained in full: C·P = C·N, and the jvp is cheaper). It fits when its
    n·C·P float32 are at most `max_bytes`. C is read from one forward pass of the model at `point`."""
    trainable = sum(t.numel() for t in point.values())
    with host.loaded(point) as model:
        model.eval()
        first = next(_batches(host, data.select(range(min(1, len(data)))), 1))[0]
        with torch.no_grad():
            outputs = model(**to_device(first, model_device(model))).logits.shape[-1]
        parameters = sum(p.numel() for p in model.parameters())
    if 2 * outputs * trainable <= parameters and len(data) * outputs * trainable * 4 <= max_bytes:
        return JacobianGaussNewton(host, point, data, outputs)
    return GaussNewton(host, point, data, batch_size)


def gauss_newton_product(host: PeftHost, point: TaskVector, v: TaskVector, data: Dataset,
                         batch_size: int = 512) -> TaskVector:
    """H·v once (`GaussNewton` for many products)."""
    with GaussNewton(host, point, data, batch_size) as product:
        return product(v)


def objective_minimizer(host: PeftHost, point: TaskVector, data: Dataset, *, l2: float = 0.0, ridge: float = 0.0,
                        batch_size: int = 512, iterations: int = 5000, tolerance: float = 1e-7,
                        max_bytes: int = JACOBIAN_BYTES) -> tuple[TaskVector, SolveInfo]:
    """(w, how CG went) for w = argmin D(w) + (l2/2)·‖w‖² + (ridge/2)·‖w − w₀‖² over prepared `data`, the model
    linearized at w₀ = `point`: one exact Newton step from w₀, (H + (l2 + ridge)·I)·s = ∇D(w₀) + l2·w₀, since
    the objective is quadratic. Where training reaches it, retraining ends there in any order: the point F²L²'s
    certificate compares a removal with (`benchmarks/f2l2_at_optimum.py`). l2 + ridge must be > 0: H is
    singular where the data span fewer directions than the model has, and the minimizer is not unique.
    `max_bytes`: the largest Jacobian formed for the products (`hessian`)."""
    damping = l2 + ridge
    if not damping > 0:
        raise ValueError(f"objective_minimizer needs l2 + ridge > 0, got l2={l2:g}, ridge={ridge:g}")
    gradient, _ = data_gradient(host, point, point, data)
    with hessian(host, point, data, batch_size, max_bytes) as products:
        step, info = conjugate_gradient(products, gradient + point * l2 if l2 else gradient, damping=damping,
                                        iterations=iterations, tolerance=tolerance)
    return point - step, info


@dataclass
class SolveInfo:
    """How a conjugate-gradient solve ended: iterations and the relative residual ‖b − A·x‖ / ‖b‖."""

    iterations: int
    relative_residual: float


REFINE_SLACK = 10.0  # preconditioned CG: refine while the recomputed residual exceeds this × the tolerance


def conjugate_gradient(apply: Callable[[TaskVector], TaskVector], b: TaskVector, *, damping: float = 0.0,
                       iterations: int = 100, tolerance: float = 1e-6,
                       preconditioner: SpectralPreconditioner | LowRankInverse | None = None,
                       ) -> tuple[TaskVector, SolveInfo]:
    """x with (A + damping·I)·x = b for a symmetric positive semi-definite A given as `apply`
    (Hestenes-Stiefel CG, from x = 0; with `preconditioner`, preconditioned CG with its M⁻¹ at this damping),
    stopping when ‖r‖ ≤ tolerance·‖b‖; the residual reported is recomputed from x (one more product). A
    preconditioned solve whose recomputed residual is still above `REFINE_SLACK` × tolerance (float32 round-off
    in M⁻¹ at a large λ_max/λ makes the updated residual drift from the true one) solves again for the
    correction from the true residual (iterative refinement), within the same `iterations`, while that halves
    the residual."""
    def product(p: TaskVector) -> TaskVector:
        return apply(p) + p * damping if damping else apply(p)

    b_norm = b.norm()
    x = b.zeros_like()
    if b_norm == 0:
        return x, SolveInfo(0, 0.0)
    done, rhs, previous = 0, b, float("inf")
    while True:
        correction, steps = _cg(product, rhs, iterations - done, tolerance * b_norm, damping, preconditioner)
        x, done = x + correction, done + steps
        remaining = b - product(x)
        residual = remaining.norm() / b_norm
        if (preconditioner is None or residual <= REFINE_SLACK * tolerance or done >= iterations or steps == 0
                or residual > previous / 2):  # converged, out of iterations, or at float32's floor
            return x, SolveInfo(done, float(residual))
        rhs, previous = remaining, residual


@dataclass
class CGIterate:
    """Where (preconditioned) CG stands on A·x = b: the iterate x, the residual r = b − A·x (as updated), the
    direction p and rz = r·M⁻¹r. One step needs one product A·p, so a federated server can take it a round at
    a time (F²L²'s `linear_solver: cg`), the same iteration `conjugate_gradient` loops over."""

    x: TaskVector
    r: TaskVector
    p: TaskVector
    rz: float

    @staticmethod
    def start(x: TaskVector, r: TaskVector, precondition: Callable[[TaskVector], TaskVector]) -> CGIterate:
        z = precondition(r)
        return CGIterate(x, r, z, float(r.dot(z)))

    def step(self, ap: TaskVector, precondition: Callable[[TaskVector], TaskVector], stop: float,
             plain: bool = False) -> tuple[CGIterate, bool]:
        """(the next iterate, whether CG stops: ‖r‖ ≤ `stop`, or A is numerically singular along p) from
        ap = A·p. `plain`: no preconditioner, whose rz is ‖r‖² already (no norm to take)."""
        curvature = float(self.p.dot(ap))
        if curvature <= 0:  # numerically singular along p (damping 0): stop with what we have
            return self, True
        alpha = self.rz / curvature
        x, r = self.x + self.p * alpha, self.r - ap * alpha
        z = precondition(r)
        rz = float(r.dot(z))
        if (rz ** 0.5 if plain else float(r.norm())) <= stop:  # ‖r‖ ≤ tol·‖b‖
            return CGIterate(x, r, self.p, rz), True
        return CGIterate(x, r, z + self.p * (rz / self.rz), rz), False


def _cg(product: Callable[[TaskVector], TaskVector], b: TaskVector, iterations: int, stop: float, damping: float,
        preconditioner) -> tuple[TaskVector, int]:
    """(x, iterations) of (preconditioned) CG for product(x) = b from x = 0, until ‖r‖ ≤ `stop`."""
    def precondition(r: TaskVector) -> TaskVector:
        return r if preconditioner is None else preconditioner(r, damping)

    iterate = CGIterate.start(b.zeros_like(), b.clone(), precondition)
    done = 0
    for done in range(1, iterations + 1):
        iterate, stopped = iterate.step(product(iterate.p), precondition, stop, plain=preconditioner is None)
        if stopped:
            break
    return iterate.x, done


class SpectralPreconditioner:
    """M⁻¹ = V·diag(1/(θ_i + λ))·Vᵀ + (I − VVᵀ)/λ for (A + λI), from a curvature factor of A
    (`curvature_factor`'s rows f_i = √θ_i·v_i, orthonormal v_i): exact on the factor's span and λI beyond it,
    so preconditioned CG sees a condition number of at most 1 + θ_min/λ (θ_min the smallest eigenvalue kept)
    instead of 1 + λ_max/λ. Symmetric positive definite for any λ > 0 whatever the factor's accuracy, so CG
    stays exact; only its speed depends on how well the factor captures A's top. Applied through the rows
    as stored, per parameter tensor (v_i·v_iᵀ = f_i·f_iᵀ/θ_i; zero rows contribute nothing):
    M⁻¹·r = r/λ + Σ_i f_i·(f_i·r)·(1/(θ_i + λ) − 1/λ)/θ_i."""

    def __init__(self, factor: TaskVector):
        self.rows = {k: t.reshape(t.shape[0], -1) for k, t in factor.items()}  # (m, p_k) views, no copy
        self.values = sum(torch.linalg.vector_norm(t, dim=1, dtype=torch.float64) ** 2 for t in self.rows.values())

    @property
    def largest(self) -> float:
        """θ₁, the factor's largest eigenvalue (A's λ_max to Lanczos' accuracy)."""
        return float(self.values.max()) if len(self.values) else 0.0

    def __call__(self, r: TaskVector, damping: float) -> TaskVector:
        if damping <= 0:
            raise ValueError("SpectralPreconditioner needs damping > 0 (M⁻¹ divides by λ beyond the factor's span)")
        kept = self.values > 0
        scale = torch.zeros_like(self.values)
        theta = self.values[kept]
        scale[kept] = (1.0 / (theta + damping) - 1.0 / damping) / theta
        coefficients = sum(rows @ r[k].reshape(-1).float() for k, rows in self.rows.items())  # F·r
        weighted = (coefficients.double() * scale).float()
        return TaskVector({k: (r[k].reshape(-1) / damping + rows.T @ weighted).reshape(r[k].shape)
                           for k, rows in self.rows.items()})


@dataclass
class TrustInfo:
    """How `solve_within_radius` ended: the damping it settled on, the solves it took (1: the first step
    fitted) and the last solve's `SolveInfo`."""

    damping: float
    solves: int
    solve: SolveInfo


def solve_within_radius(apply: Callable[[TaskVector], TaskVector], b: TaskVector, *, damping: float, radius: float,
                        iterations: int = 100, tolerance: float = 1e-6, max_solves: int = 12,
                        offset: TaskVector | None = None,
                        preconditioner: SpectralPreconditioner | LowRankInverse | None = None,
                        ) -> tuple[TaskVector, TrustInfo]:
    """x = (A + λ·I)⁻¹·b with about the smallest λ ≥ `damping` for which ‖x‖ ≤ `radius` (a Levenberg-Marquardt
    trust region; ‖x(λ)‖ falls monotonically with λ). The first solve uses `damping`; while the step is
    too long, λ grows along the secant of log ‖x‖ against log λ (slope clipped to [1/4, 1]; 1 at first,
    the flat directions' ‖x‖ ∝ 1/λ), aiming at 0.95·radius; once a step fits, log λ is bisected between
    the last λ too small and the first that fits. It stops at a step within [0.8, 1]·radius, or after
    `max_solves` with the fitting step of the smallest λ found (λ raised 100-fold if none fitted).
    `radius` ≤ 0: no region, one solve. With `offset` the region bounds ‖offset + x‖ instead (a step that
    starts from elsewhere, e.g. F²L²'s anchored form, solved from w₀ and measured from w*). `preconditioner`
    goes to every solve (`conjugate_gradient`)."""
    def solve(lam: float):
        x, info = conjugate_gradient(apply, b, damping=lam, iterations=iterations, tolerance=tolerance,
                                     preconditioner=preconditioner)
        return lam, x, info, (x if offset is None else offset + x).norm()

    low = solve(damping)  # (λ, x, info, ‖x‖), the largest λ known to give too long a step
    solves = 1
    if radius <= 0 or low[3] <= radius:
        return low[1], TrustInfo(damping, solves, low[2])
    previous, fits = None, None  # the try before `low`; the smallest λ known to fit
    while solves < max_solves:
        if fits is None:
            slope = 1.0
            if previous is not None:
                slope = -math.log(low[3] / previous[3]) / math.log(low[0] / previous[0])
                slope = min(max(slope, 0.25), 1.0)
            base = low[0] if low[0] > 0 else 1e-12 * b.norm() / radius
            lam = base * (low[3] / (0.95 * radius)) ** (1.0 / slope)
        else:
            lam = math.sqrt(low[0] * fits[0]) if low[0] > 0 else fits[0] / 10
        tried = solve(lam)
        solves += 1
        if tried[3] > radius:
            previous, low = low, tried
        else:
            fits = tried
            if tried[3] >= 0.8 * radius:
                break
    if fits is None:
        fits = solve(low[0] * 100.0)
        solves += 1
    return fits[1], TrustInfo(fits[0], solves, fits[2])


@dataclass
class EigenInfo:
    """How `largest_eigenvalue` ended: products taken and the last relative change of the estimate."""

    iterations: int
    relative_change: float


def _lanczos(apply: Callable[[TaskVector], TaskVector], template: TaskVector, steps: int, seed: int,
             tolerance: float | None = None) -> tuple[torch.Tensor, dict, torch.Tensor, EigenInfo]:
    """Lanczos with full reorthogonalization from a seeded random start: (the orthonormal basis as the rows
    of a float32 matrix over the flattened parameters, their shapes by name, the tridiagonal T = QᵀAQ in
    float64, how it ended). Stops after `steps` products, at an invariant subspace, or (`tolerance`) when T's
    top eigenvalue changes by at most that (relative). The basis is one matrix, so reorthogonalizing against
    it is two matrix products, not a loop over vectors."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {k: t.shape for k, t in template.items()}
    q = torch.cat([torch.randn(shape, generator=generator, dtype=torch.float32).reshape(-1)
                   for shape in shapes.values()])
    basis = torch.empty((steps, q.numel()), dtype=torch.float32)
    basis[0] = q / q.norm()
    alphas, betas = [], []
    estimate, change, done = 0.0, float("inf"), 0
    for done in range(1, steps + 1):
        q = basis[done - 1]
        out = apply(TaskVector.unflatten(q, shapes))
        w = TaskVector({k: out[k] for k in shapes}).flatten().float()
        alphas.append(float(w.double() @ q.double()))
        kept = basis[:done]
        for _ in range(2):  # twice: the basis stays orthonormal in float32 over hundreds of steps
            w = w - kept.T @ (kept @ w)
        beta = float(w.double().norm())
        if tolerance is not None:
            ritz = float(torch.linalg.eigvalsh(_tridiagonal(alphas, betas))[-1])
            change, estimate = abs(ritz - estimate) / max(abs(ritz), 1e-30), ritz
            if change <= tolerance:
                break
        if done == steps or beta <= 1e-6 * max(abs(a) for a in alphas):  # an invariant subspace
            break
        betas.append(beta)
        basis[done] = w / beta
    return basis[:len(alphas)], shapes, _tridiagonal(alphas, betas), EigenInfo(done, change)


def largest_eigenvalue(apply: Callable[[TaskVector], TaskVector], template: TaskVector, *, iterations: int = 30,
                       tolerance: float = 1e-4, seed: int = 0) -> tuple[float, EigenInfo]:
    """λ_max of a symmetric positive semi-definite A given as `apply`, shaped like `template`: Lanczos with
    full reorthogonalization from a seeded random start (the Krylov space power iteration explores, read
    through its best Ritz value instead of the last iterate, so a small gap λ₁/λ₂ costs far fewer products).
    Stops when the top Ritz value changes by at most `tolerance` (relative) or after `iterations` products;
    the estimate never exceeds the true λ_max."""
    _, _, t, info = _lanczos(apply, template, iterations, seed, tolerance)
    return float(torch.linalg.eigvalsh(t)[-1]), info


def curvature_factor(apply: Callable[[TaskVector], TaskVector], template: TaskVector, rank: int, *,
                     oversample: int = 20, seed: int = 0) -> TaskVector:
    """F with FᵀF ≈ A, the top `rank` eigenpairs of a symmetric positive semi-definite A given as `apply`:
    F's rows are √h_i·v_i (a row per eigenpair, largest first; saved name -> tensor of shape (rank, *shape),
    zero rows where A has fewer eigenvalues above 1e-6 of its largest), from the Ritz pairs of `rank` +
    `oversample` Lanczos steps (the extra steps converge the lowest pairs kept). A's best rank-`rank`
    approximation in every unitarily invariant norm, to Lanczos' accuracy."""
    basis, shapes, t, _ = _lanczos(apply, template, rank + oversample, seed)
    values, vectors = torch.linalg.eigh(t)
    order = values.argsort(descending=True)[:rank]
    kept = values[order]
    scales = torch.where(kept > 1e-6 * kept[0], kept, 0.0).sqrt()  # below: float32 round-off, not curvature
    ritz = (vectors[:, order].T @ basis.double()) * scales[:, None]  # (kept, P): √h_i·v_i
    padded = torch.zeros((rank, basis.shape[1]), dtype=torch.float32)
    padded[:len(order)] = ritz.float()
    return TaskVector({k: chunk.reshape(rank, *shape) for (k, shape), chunk in
                       zip(shapes.items(), padded.split([math.prod(shape) for shape in shapes.values()], 1))})


class LowRankGaussNewton:
    """v ↦ Σ_j c_j·F_jᵀ(F_j·v) for curvature factors F_j (`curvature_factor`'s layout) and weights c_j: a
    Hessian H ≈ Σ_j c_j·H_j built from factors the clients uploaded, as a context manager like `hessian`'s
    operators. The factors are stacked once into one P × Σ rank matrix; a product is two matrix products."""

    def __init__(self, factors: list[tuple[TaskVector, float]]):
        self.factors = factors

    def __enter__(self) -> LowRankGaussNewton:
        first = self.factors[0][0]
        self.shapes = {k: first[k].shape[1:] for k in first}
        sizes = [math.prod(shape) for shape in self.shapes.values()]
        self.ranks = [f[next(iter(self.shapes))].shape[0] for f, _ in self.factors]
        self.matrix = torch.empty((sum(self.ranks), sum(sizes)))
        row = 0
        for (f, weight), rank in zip(self.factors, self.ranks):  # (Σ rank, P), in place: one pass over them
            for block, k in zip(self.matrix[row:row + rank].split(sizes, 1), self.shapes):
                torch.mul(f[k].reshape(rank, -1), weight ** 0.5, out=block)
            row += rank
        return self

    def __exit__(self, *exc) -> None:
        self.matrix = None

    def __call__(self, v: TaskVector) -> TaskVector:
        flat = TaskVector({k: v[k] for k in self.shapes}).flatten().float()
        return TaskVector.unflatten(self.matrix.T @ (self.matrix @ flat), self.shapes)

    def gram(self) -> torch.Tensor:
        """MMᵀ (float64, K × K) for the stacked, weighted factors M, by blocks: a factor's own block is diagonal
        (its rows √h·v have orthonormal v: c·diag(h), from the row norms), so only the blocks between factors take
        matrix products (for two clients of rank 256 over 74,498 LoRA parameters, a third of the whole Gram's
        cost; for rank 1,920, seconds)."""
        bounds = [0, *itertools.accumulate(self.ranks)]
        gram = torch.zeros((bounds[-1], bounds[-1]), dtype=torch.float64)
        gram[range(bounds[-1]), range(bounds[-1])] = torch.linalg.vector_norm(self.matrix, dim=1).double() ** 2
        for i, j in itertools.combinations(range(len(self.ranks)), 2):
            block = (self.matrix[bounds[i]:bounds[i + 1]] @ self.matrix[bounds[j]:bounds[j + 1]].T).double()
            gram[bounds[i]:bounds[i + 1], bounds[j]:bounds[j + 1]] = block
            gram[bounds[j]:bounds[j + 1], bounds[i]:bounds[i + 1]] = block.T
        return gram

    def inverse(self, unit_gram: torch.Tensor | None = None) -> LowRankInverse:
        """(H + λI)⁻¹ for this operator, as a preconditioner (`conjugate_gradient`'s): exact, so CG stops
        after an iteration or two. `unit_gram`: the Gram of the same factors, in the same order, at unit weights,
        formed earlier (F²L² keeps it with the run), so that no block product is taken here."""
        if unit_gram is None:
            return LowRankInverse(self.matrix, self.shapes, self.gram())
        if tuple(unit_gram.shape) != (len(self.matrix),) * 2:
            raise ValueError(f"a Gram of shape {tuple(unit_gram.shape)} for {len(self.matrix)} factor rows")
        scale = torch.cat([torch.full((rank,), weight ** 0.5, dtype=torch.float64)
                           for (_, weight), rank in zip(self.factors, self.ranks)])
        return LowRankInverse(self.matrix, self.shapes, unit_gram.double() * scale[:, None] * scale[None, :])


class LowRankInverse:
    """(MᵀM + λI)⁻¹·r = (r − Mᵀ·(MMᵀ + λI)⁻¹·M·r)/λ (Woodbury) for the stacked factors M (K × P, K = Σ ranks) and
    their Gram MMᵀ (`LowRankGaussNewton.gram`), with a Cholesky factor of MMᵀ + λI per λ (K³/3 multiply-adds,
    a small share of an eigendecomposition's), so each λ costs one factorization and each product two passes
    over M. Used as a preconditioner it keeps CG exact whatever the rows' orthonormality error; `largest` is H's
    λ_max, MMᵀ's largest eigenvalue (computed when first asked: the relative damping needs it, the objective's
    does not)."""

    def __init__(self, matrix: torch.Tensor, shapes: dict, gram: torch.Tensor):
        self.matrix, self.shapes, self.gram = matrix, shapes, gram
        self._largest: float | None = None
        self._solver_at: tuple[float, Callable[[torch.Tensor], torch.Tensor]] | None = None  # the last λ's

    @property
    def largest(self) -> float:
        if self._largest is None:
            self._largest = float(torch.linalg.eigvalsh(self.gram)[-1]) if len(self.gram) else 0.0
        return self._largest

    def _solver(self, damping: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """c ↦ (MMᵀ + λI)⁻¹·c: by Cholesky; where float32 round-off in the Gram's blocks leaves MMᵀ + λI
        indefinite (λ below that round-off), by its eigendecomposition with the negative eigenvalues at 0. Kept
        for the last λ only (a CG solve asks for one λ throughout; a trust region's next solve for another)."""
        if self._solver_at is None or self._solver_at[0] != damping:
            shifted = self.gram + damping * torch.eye(len(self.gram), dtype=torch.float64)
            lower, info = torch.linalg.cholesky_ex(shifted)
            if int(info) == 0:
                solve = lambda c: torch.cholesky_solve(c[:, None], lower)[:, 0]  # noqa: E731
            else:
                values, vectors = torch.linalg.eigh(self.gram)
                scale = 1.0 / (values.clamp(min=0.0) + damping)
                solve = lambda c: vectors @ ((vectors.T @ c) * scale)  # noqa: E731
            self._solver_at = (damping, solve)
        return self._solver_at[1]

    def __call__(self, r: TaskVector, damping: float) -> TaskVector:
        if damping <= 0:
            raise ValueError("LowRankInverse needs damping > 0")
        flat = TaskVector({k: r[k] for k in self.shapes}).flatten().float()
        inner = self._solver(damping)((self.matrix @ flat).double())
        return TaskVector.unflatten((flat - self.matrix.T @ inner.float()) / damping, self.shapes)


def _tridiagonal(alphas: list[float], betas: list[float]) -> torch.Tensor:
    """The Lanczos matrix T with diagonal `alphas` and off-diagonal `betas` (float64)."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas[:len(alphas) - 1], dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    return t
