"""F²L²'s certified removal of a client: w₋ = w* − (H + λI)⁻¹·g₋, one Newton step on the server, no message
to any client. H is the server's slice H_s or the retained clients' uploaded curvature factors (`hessian`); λ
is relative to H's scale (ρ·λ_max), absolute, or the trained objective's own (`damping`); a step longer than
`trust_radius`·‖w* − w₀‖ raises λ until it fits (a Levenberg-Marquardt trust region). g₋, the gradient of the
objective without the client at w*, takes one of five forms (`gradient`): retained (exact), target (the
paper's), difference (the client's share alone), split (the retained form, plus the client's share where H_s
has no curvature) and anchored (a damped step from w₀ instead of w*); `auto` picks by how complete the
factors are, how near w* is to the optimum, and the trust region. The derivation of each form and the
measurements behind each choice: docs/results/f2l2.md. `CertifiedRemoval` is the part of the `F2L2`
strategy that takes the step (it uses `F2L2`'s model, regularizer and curvature factors)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_fedtask.core.state import SERVER_CURVATURE, curvature_name, gradient_name
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies.base import ClientRemoval, GlobalState, task_point, task_vectors
from hf_fedtask.strategies.configs import AUTO, GRADIENT_FORMS, HESSIANS
from hf_fedtask.strategies.f2l2.curvature import EIGEN_ITERATIONS, factor_tail
from hf_fedtask.strategies.f2l2.protocol import DONE

SPLIT, ANCHORED = "split", "anchored"
COMPLETE_TAIL = 0.01  # auto takes the anchored form where the factors' tail is at most this share of λ
STATIONARY = 0.1  # auto damping: w* is at the regularized objective's optimum where ‖∇F(w*)‖ ≤ this × ‖∇F₋(w*)‖
RELATIVE, ABSOLUTE, OBJECTIVE = "relative", "absolute", "objective"
SERVER, CLIENTS = HESSIANS[1:]  # the removal's Hessian: the server's slice H_s, the clients' factors
NO_FACTORS = ("f2l2 removal: hessian 'clients' needs the clients' curvature factors, and this run's clients uploaded "
              "none (train with curvature_rank > 0, or take hessian 'server')")


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


class CertifiedRemoval(ClientRemoval):
    """`ClientRemoval` for an `F2L2` run: the Newton step, as `RemovalOptions` say."""

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
