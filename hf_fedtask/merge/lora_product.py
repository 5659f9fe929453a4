"""Exact aggregation of LoRA factors: the weighted mean of the clients' products ΔW_i = s_i·B_i·A_i
(s_i = α/r_i, or α/√r_i with rsLoRA), split back into rank-r factors, from the factors alone.

Averaging A and B on their own (FedIT-style factor averaging: Zhang et al., 2024, as FlowerTune and
OpenFedLLM do) gives B̄·Ā, which is not mean_i(B_i·A_i): the cross terms B_i·A_j (i ≠ j) enter it.
FlexLoRA (Bai et al., 2024) averages the products and re-factorizes the mean by a truncated SVD, which
also lets clients hold different ranks, HetLoRA's setting (Cho et al., 2024). Here no d_out×d_in matrix is ever
formed: a sum Σ_j c_j·B_j·A_j is the product C·D of the stacked factors C = [√c_1·B_1 | … ] (d_out×R)
and D = [√c_1·A_1; …] (R×d_in), R = Σ_j r_j, so QR of C and Dᵀ reduces its SVD to that of an R×R core,
and its Frobenius norm to two R×R Gram matrices. The small factorizations run in float64; results come
back in the inputs' dtype, on their device.

`product_step` is the server step (exact mean, re-factorized, with its truncation residual);
`factor_step_error` measures how far factor averaging lands from it; `lora_pairs` finds the (A, B)
pairs of a PEFT state. `effective_rank`, `energy_rank` and `tail_energy` read a matrix's spectrum (the
singular values `truncate` found): how many directions its energy spreads over, and what a truncation to any
rank discards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Factors = tuple[torch.Tensor, torch.Tensor]
"""One LoRA module's factors (B, A): B of shape (d_out, r), A of shape (r, d_in)."""

Term = tuple[float, torch.Tensor, torch.Tensor]
"""c, B, A: the matrix c·B·A."""

_A_KEY = re.compile(r"(^|\.)lora_A\.weight$|(^|\.)lora_embedding_A$")
_B_KEY = re.compile(r"(^|\.)lora_B\.weight$|(^|\.)lora_embedding_B$")


@dataclass(frozen=True)
class Refactorized:
    """Rank-r factors of a matrix M (scaling·B·A = M_r, its best rank-r approximation) with the squared
    Frobenius norms of what the truncation dropped (‖M − M_r‖², the discarded singular values) and of M."""

    B: torch.Tensor
    A: torch.Tensor
    discarded: float
    total: float
    singular_values: torch.Tensor | None = None  # all of M's, descending, float64 on the CPU (empty for M = 0)

    @property
    def residual(self) -> float:
        """‖M − M_r‖_F / ‖M‖_F (0 for M = 0)."""
        return math.sqrt(self.discarded / self.total) if self.total > 0 else 0.0


def stack(terms: Sequence[Term]) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, D) in float64 with C·D = Σ_j c_j·B_j·A_j: √|c_j|·B_j side by side (its sign on C), √|c_j|·A_j
    stacked; terms with c_j = 0 are left out. Ranks may differ between terms."""
    terms = [(float(c), B, A) for c, B, A in terms if c != 0]
    if not terms:
        raise ValueError("no nonzero term to stack")
    for c, B, A in terms:
        if B.ndim != 2 or A.ndim != 2 or B.shape[1] != A.shape[0]:
            raise ValueError(f"factors B {tuple(B.shape)} and A {tuple(A.shape)} do not chain as B·A")
    d_out, d_in = terms[0][1].shape[0], terms[0][2].shape[1]
    if any(B.shape[0] != d_out or A.shape[1] != d_in for _, B, A in terms):
        raise ValueError("terms of different shapes: every B·A must be (d_out, d_in) alike")
    C = torch.cat([B.to(torch.float64) * (math.copysign(math.sqrt(abs(c)), c)) for c, B, _ in terms], dim=1)
    D = torch.cat([A.to(torch.float64) * math.sqrt(abs(c)) for c, _, A in terms], dim=0)
    return C, D


def low_rank_norm_sq(C: torch.Tensor, D: torch.Tensor) -> float:
    """‖C·D‖_F² = tr((CᵀC)(DDᵀ)) from two R×R Gram matrices (never the d_out×d_in product). A difference
    of nearly equal products loses precision to cancellation: its relative norm is good to about 1e-8."""
    C, D = C.to(torch.float64), D.to(torch.float64)
    return max(float(((C.T @ C) * (D @ D.T)).sum()), 0.0)


def truncate(C: torch.Tensor, D: torch.Tensor, rank: int, scaling: float = 1.0,
             dtype: torch.dtype | None = None) -> Refactorized:
    """The best rank-`rank` approximation M_r of M = C·D (Eckart–Young) as balanced factors (as FlexLoRA
    splits them): C = Q_c R_c, Dᵀ = Q_d R_d, R_c R_dᵀ = U S Vᵀ, then B = Q_c U_r √(S_r/scaling) and
    A = √(S_r/scaling) V_rᵀ Q_dᵀ, so scaling·B·A = M_r. Where M has rank below `rank` the extra columns of
    B and rows of A are zero. Results in `dtype` (default C's), on C's device."""
    if rank < 1 or not scaling > 0:
        raise ValueError(f"rank must be >= 1 and scaling > 0, got rank {rank}, scaling {scaling}")
    dtype = dtype or C.dtype
    C, D = C.to(torch.float64), D.to(torch.float64)
    Qc, Rc = torch.linalg.qr(C)  # reduced: Qc (d_out, k), Rc (k, R)
    Qd, Rd = torch.linalg.qr(D.T)  # Qd (d_in, k'), Rd (k', R)
    U, S, Vh = torch.linalg.svd(Rc @ Rd.T, full_matrices=False)
    k = min(rank, S.numel())
    power = S.square()
    root = (S[:k] / scaling).sqrt()
    B = torch.zeros(C.shape[0], rank, dtype=torch.float64, device=C.device)
    A = torch.zeros(rank, D.shape[1], dtype=torch.float64, device=C.device)
    B[:, :k] = (Qc @ U[:, :k]) * root
    A[:k] = root[:, None] * (Vh[:k] @ Qd.T)
    return Refactorized(B.to(dtype), A.to(dtype), float(power[k:].sum()), float(power.sum()), S.detach().cpu())


def step_terms(start: Factors | None, clients: Sequence[Factors], weights: Sequence[float],
               scalings: Sequence[float], scaling: float = 1.0, server_lr: float = 1.0,
               signs: Sequence[float] | None = None) -> list[Term]:
    """The terms of the exact server step M = s·B_g·A_g + η·Σ_i w_i σ_i (s_i·B_i·A_i − s·B_g·A_g) / Σ_i w_i
    (s: the server's scaling, of `start` = (B_g, A_g); η: `server_lr`; σ_i = ±1: `signs`, −1 negating a
    client's update for unlearning). Without `start`, M is the (signed) weighted mean of the products. The
    coefficient of the start term is computed exactly, so it vanishes (and leaves no term) at η = 1 without
    negation."""
    n = len(clients)
    signs = [1.0] * n if signs is None else [float(s) for s in signs]
    weights = [float(w) for w in weights]
    if not (len(weights) == len(scalings) == len(signs) == n) or n == 0:
        raise ValueError(f"{n} clients need as many weights, scalings and signs (got {len(weights)}, "
                         f"{len(scalings)}, {len(signs)})")
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be >= 0 with a positive total, got {weights}")
    total = math.fsum(weights)
    terms = [(server_lr * w * s * si / total, B, A) for w, s, si, (B, A) in zip(weights, signs, scalings, clients)]
    if start is not None:
        kept = math.fsum([total, -server_lr * math.fsum(w * s for w, s in zip(weights, signs))]) / total
        terms.append((scaling * kept, *start))
    return [t for t in terms if t[0] != 0]


def product_step(start: Factors | None, clients: Sequence[Factors], weights: Sequence[float],
                 scalings: Sequence[float], *, rank: int, scaling: float, server_lr: float = 1.0,
                 signs: Sequence[float] | None = None) -> Refactorized:
    """FlexLoRA's server step without a dense matrix: the exact update of `step_terms` (the global factors
    `start`, at the server's `rank` and `scaling`, moved by `server_lr` times the `weights`-weighted mean of
    the clients' changes of s_i·B_i·A_i; each client at its own rank r_i and scaling s_i = `scalings[i]`)
    re-factorized to `rank` by `truncate`. Returns B, A (scaling·B·A = M_r) in the start's dtype (else
    the first client's) with the truncation's residual. Exact (residual 0) when the ranks of the terms
    sum to at most `rank`."""
    terms = step_terms(start, clients, weights, scalings, scaling, server_lr, signs)
    dtype = (start or clients[0])[0].dtype
    if not terms:  # every coefficient 0 (e.g. server_lr 0 from a zero start): M = 0
        B, A = start or clients[0]
        return Refactorized(B.new_zeros(B.shape[0], rank), A.new_zeros(rank, A.shape[1]), 0.0, 0.0,
                            torch.zeros(0, dtype=torch.float64))
    C, D = stack(terms)
    return truncate(C, D, rank, scaling, dtype=dtype)


def tail_energy(singular_values: torch.Tensor, rank: int) -> float:
    """‖M − M_r‖_F² of the best rank-`rank` approximation M_r: the energy of the singular values past `rank`."""
    return float(singular_values[rank:].to(torch.float64).square().sum())


def energy_rank(singular_values: torch.Tensor, share: float = 0.99) -> int:
    """The fewest leading singular values that hold `share` of ‖M‖_F² (Σσ²); 0 for M = 0."""
    power = singular_values.to(torch.float64).square()
    total = float(power.sum())
    if total <= 0:
        return 0
    held = torch.cumsum(power, 0) >= share * total * (1 - 1e-12)  # the last one always holds it (rounding)
    return int(torch.nonzero(held)[0]) + 1


def effective_rank(singular_values: torch.Tensor) -> float:
    """Roy & Vetterli's (2007) effective rank exp(H(p)), p_i = σ_i / Σσ: how many directions M's singular
    values spread evenly over (1 for a rank-1 matrix, r for r equal ones); 0 for M = 0."""
    S = singular_values.to(torch.float64)
    total = float(S.sum())
    if total <= 0:
        return 0.0
    p = S[S > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def factor_step_error(start: Factors | None, clients: Sequence[Factors], weights: Sequence[float],
                      averaged: Factors, *, server_lr: float = 1.0,
                      signs: Sequence[float] | None = None) -> tuple[float, float]:
    """(‖M − B̄·Ā‖_F², ‖M‖_F²): how far factor averaging's result `averaged` = (B̄, Ā) lands from the exact
    step M of `step_terms` (clients and server at one rank and scaling, which then cancels from the
    ratio). Computed from Gram matrices (`low_rank_norm_sq`), never a d_out×d_in matrix."""
    terms = step_terms(start, clients, weights, [1.0] * len(clients), 1.0, server_lr, signs)
    if not terms:
        return low_rank_norm_sq(*stack([(1.0, *averaged)])), 0.0
    target = low_rank_norm_sq(*stack(terms))
    return low_rank_norm_sq(*stack([*terms, (-1.0, *averaged)])), target


def lora_pairs(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The (A key, B key) pairs of a PEFT state in PEFT's saved naming (`….lora_A.weight` with
    `….lora_B.weight`; `lora_embedding_A` with `lora_embedding_B`), in the A keys' order; [] for a state
    without LoRA factors. Raises ValueError (one line) for an A or B without its partner, or a pair whose
    shapes do not chain (A (r, d_in, …), B (d_out, r, 1, …))."""
    pairs = []
    for key in tensors:
        if _A_KEY.search(key):
            partner = key[: -len("A.weight")] + "B.weight" if key.endswith(".weight") else key[:-1] + "B"
            if partner not in tensors:
                raise ValueError(f"LoRA factor {key!r} has no partner {partner!r}")
            A, B = tensors[key], tensors[partner]
            if A.ndim < 2 or B.ndim < 2 or A.shape[0] != B.shape[1] or any(n != 1 for n in B.shape[2:]):
                raise ValueError(f"LoRA factors {key!r} {tuple(A.shape)} and {partner!r} {tuple(B.shape)} do "
                                 "not chain as B·A")
            pairs.append((key, partner))
    paired = {b for _, b in pairs}
    for key in tensors:
        if _B_KEY.search(key) and key not in paired:
            raise ValueError(f"LoRA factor {key!r} has no A partner")
    return pairs


def as_factors(B: torch.Tensor, A: torch.Tensor) -> Factors:
    """A pair as matrices: B (d_out, r), A (r, d_in·k…) (a convolution's A flattened over its kernel)."""
    return B.reshape(B.shape[0], B.shape[1]), A.reshape(A.shape[0], -1)
