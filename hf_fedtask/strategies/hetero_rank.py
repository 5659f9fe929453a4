"""Clients of different LoRA ranks in one run (`lora_ranks`; FlexLoRA: Bai et al., 2024, arXiv:2402.11505, in
the setting of HetLoRA: Cho et al., 2024): client c trains LoRA at its own rank r_c, the server keeps the
global rank r_g = `lora_r` >= every r_c.

Downlink: each LoRA module's global product ΔW = s·B_g·A_g truncated to r_c by an SVD, its best rank-r_c
approximation (Eckart-Young), as balanced factors B_c (d_out×r_c) and A_c (r_c×d_in) with s·B_c·A_c =
trunc_r_c(ΔW); a rank-r_g client gets the global factors as they are. A component ΔW does not have (a zero
singular value: every module at the start, where B = 0, or after a round whose clients' ranks sum below r_g) is
sent as LoRA's own init, B's column zero and A's row a seeded draw: the product, so the truncation, is unchanged,
and the component can train (a pair of zero factors has zero gradients and never would).

Client: trains in its own PEFT adapter on the one shared host (`at_rank`): the run's LoRA config at r = r_c
with α scaled by r_c/r_g (by √(r_c/r_g) under rsLoRA), so that its scaling s = α/r is the server's and its
B_c·A_c is the global product's leading r_c components in the server's own scale, with no rescaling on either
side. It uploads the change of its rank-r_c factors.

Server: the clients' products (downlink plus change), of ranks r_c, enter FlexLoRA's exact step
(`hf_fedtask.merge.lora_product.product_step`), re-factorized to r_g; other shared keys take FedAvg's mean.
The step's spectrum is each round's record (`aggregation`): the truncation residual ‖M − M_r‖_F/‖M‖_F at r_g
(`lora_truncation_residual`) and at every client rank (`lora_rank_residuals`), and the effective rank of M
(`lora_effective_rank`, Roy & Vetterli's entropy form; `lora_rank_99`, the singular values holding 99% of its
energy), means over the LoRA modules. In FlexLoRA's mean of products a component past a small client's rank is
averaged with that client's zero, so the update's energy drifts into the ranks every client holds ("rank
collapse"); these numbers show how far, round by round.

PEFT configures ranks per module (`rank_pattern`), not per client, and no library aggregates LoRA factors of
different ranks: this module is hand-written on `product_step` and PEFT's named adapters.
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hf_fedtask.core.state import SHARED
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import weighted_average
from hf_fedtask.merge.lora_product import (
    as_factors,
    effective_rank,
    energy_rank,
    lora_pairs,
    product_step,
    stack,
    tail_energy,
    truncate,
)

if TYPE_CHECKING:
    from peft import LoraConfig

    from hf_fedtask.model.host import PeftHost

ADAPTER_PREFIX = "lora_rank_"
"""A client of rank r trains in the host's PEFT adapter `lora_rank_<r>` (the server's rank: in "default")."""

ENERGY_SHARE = 0.99  # `lora_rank_99`: the singular values holding this share of ‖M‖_F²


def client_rank(ranks: Sequence[int], client: int) -> int:
    """Client `client`'s LoRA rank: one rank per client, or fewer cycled over the clients ((c mod k)-th)."""
    return int(ranks[client % len(ranks)])


def check_ranks(ranks: Sequence[int], config) -> None:
    """Refuse `lora_ranks` a run (`config`, a `RunConfig`) cannot honour: a client rank above the global
    `lora_r`, or more ranks than clients. One line each, a ConfigError."""
    top = max(ranks)
    if top > config.lora_r:
        raise ConfigError(f"lora_ranks: the largest client rank {top} is above lora_r {config.lora_r}, the "
                          f"server's global rank: set lora_r >= {top}")
    n = config.client_count
    if len(ranks) > n:
        raise ConfigError(f"lora_ranks: {len(ranks)} ranks for this run's {n} clients: give one per client, or fewer "
                          "(cycled over the clients)")


def client_lora_config(config: LoraConfig, rank: int) -> LoraConfig:
    """The host's LoRA `config` at `rank`, its α scaled so that the scaling α/r (α/√r under rsLoRA) stays the
    host's: a rank-`rank` client's factors are then the global product's leading components as they are."""
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        raise ConfigError("lora_ranks: the host's LoRA config sets per-module ranks (rank_pattern/alpha_pattern), "
                          "which per-client ranks cannot also change")
    out = copy.deepcopy(config)
    ratio = rank / config.r
    out.lora_alpha = config.lora_alpha * (math.sqrt(ratio) if config.use_rslora else ratio)
    out.r = rank
    return out


@contextlib.contextmanager
def at_rank(host: PeftHost, rank: int) -> Iterator[None]:
    """The host training (`state`, `load_state`, the Trainer) at LoRA rank `rank`: its own adapter
    `lora_rank_<rank>` (`client_lora_config`) while inside, the host's "default" again on exit; the default
    adapter itself at the host's own rank."""
    if rank == host.peft_config.r:
        yield
        return
    with host.adapter(f"{ADAPTER_PREFIX}{rank}", client_lora_config(host.peft_config, rank)):
        yield


def truncate_shared(shared: TaskVector, rank: int, round_: int) -> TaskVector:
    """The shared modules as a rank-`rank` client receives them from a state of round `round_`: each LoRA pair's
    product truncated to `rank` (SVD; the pair itself at its own rank), components the product lacks sent as
    LoRA's init (`_revive`, seeded by the round, the rank and the module); other keys as they are."""
    out = dict(shared)
    for a_key, b_key in lora_pairs(shared):
        A, B = shared[a_key], shared[b_key]
        if rank > A.shape[0]:
            raise ConfigError(f"lora_ranks: client rank {rank} is above the state's rank {A.shape[0]} ({a_key})")
        if rank < A.shape[0]:
            cut = truncate(*stack([(1.0, *as_factors(B, A))]), rank, dtype=A.dtype)
            A, B = cut.A.reshape(rank, *A.shape[1:]), cut.B.reshape(B.shape[0], rank, *B.shape[2:])
        seed = int(np.random.SeedSequence([round_, rank, zlib.crc32(a_key.encode())]).generate_state(1)[0])
        out[b_key], out[a_key] = _revive(B, A, embedding=a_key.endswith("lora_embedding_A"), seed=seed)
    return TaskVector(out)


def _revive(B: torch.Tensor, A: torch.Tensor, *, embedding: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) with every dead component (B's column and A's row both zero) set to LoRA's init as PEFT draws it:
    A's row kaiming-uniform (bound 1/√fan_in) and B's column zero; for an embedding, A's row zero and B's
    column standard normal. The product B·A is unchanged. The inputs themselves where nothing is dead."""
    dead = [k for k in range(A.shape[0]) if not A[k].any() and not B[:, k].any()]
    if not dead:
        return B, A
    B, A = B.clone(), A.clone()
    gen = torch.Generator().manual_seed(seed)
    for k in dead:
        if embedding:
            B[:, k] = torch.randn(B[:, k].shape, generator=gen, dtype=torch.float64).to(B.dtype)
        else:
            bound = 1.0 / math.sqrt(A[k].numel())
            A[k] = ((torch.rand(A[k].shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound).to(A.dtype)
    return B, A


def mixed_rank_step(shared: TaskVector, updates: list[ClientUpdate], negated: list[ClientUpdate],
                    ranks: Sequence[int], round_: int, server_lr: float = 1.0,
                    signs: Sequence[float] | None = None) -> tuple[TaskVector, dict]:
    """The shared modules after FedAvg's step in a mixed-rank run, and what it measured. Each client's factors
    are its downlink (`truncate_shared` of `shared`, the state of round `round_`, at its rank) plus its change
    in `updates` (as sent); each LoRA pair becomes `product_step` of the global factors and the clients'
    (weighted by sample count, negated where `signs` is -1), re-factorized to the state's rank. Other keys
    move by `server_lr` times the weighted mean of the changes in `negated` (the updates with unlearning's
    negation applied), as `fedavg_shared` moves them. Returns (the new shared modules in `shared`'s key order,
    the diagnostics of the module docstring)."""
    try:
        pairs = lora_pairs(shared)
    except ValueError as e:
        raise ConfigError(f"LoRA aggregation: {e}") from None
    if not pairs:
        raise ConfigError("lora_ranks: the shared modules hold no LoRA factors (lora_A/lora_B): per-client ranks "
                          "need peft_method lora")
    weights = [u.total_samples for u in updates]
    client_ranks = {u.client_id: client_rank(ranks, u.client_id) for u in updates}
    downlinks = {r: truncate_shared(shared, r, round_) for r in sorted(set(client_ranks.values()))}
    paired = {k for pair in pairs for k in pair}
    out = {}
    other = shared.filter(lambda k: k not in paired)
    if len(other):  # e.g. a head shared by every task: FedAvg's mean
        mean = weighted_average([u.vectors[SHARED].filter(lambda k: k not in paired) for u in negated], weights)
        out.update(other + server_lr * mean)
    global_rank = shared[pairs[0][0]].shape[0]
    spectra = []
    for a_key, b_key in pairs:
        clients = []
        for u in updates:
            down = downlinks[client_ranks[u.client_id]]
            clients.append(as_factors(down[b_key] + u.vectors[SHARED][b_key], down[a_key] + u.vectors[SHARED][a_key]))
        A = shared[a_key]
        step = product_step(as_factors(shared[b_key], A), clients, weights, [1.0] * len(clients), rank=A.shape[0],
                            scaling=1.0, server_lr=server_lr, signs=signs)
        out[a_key], out[b_key] = step.A.reshape(A.shape), step.B.reshape(shared[b_key].shape)
        spectra.append(step.singular_values)
    return TaskVector({k: out[k] for k in shared}), spectrum_diagnostics(spectra, global_rank, ranks, client_ranks)


def spectrum_diagnostics(spectra: list[torch.Tensor], global_rank: int, ranks: Sequence[int],
                         client_ranks: dict[int, int]) -> dict:
    """What a mixed-rank step records from the singular values of each LoRA module's M (`spectra`): the
    truncation residual sqrt(Σ‖M − M_r‖²/Σ‖M‖²) over all modules at the global rank and at each rank of
    `ranks`, M's effective ranks (means over the modules), and this round's clients' ranks."""
    total = sum(float(S.square().sum()) for S in spectra)

    def residual(rank: int) -> float:
        return math.sqrt(sum(tail_energy(S, rank) for S in spectra) / total) if total > 0 else 0.0

    return {"lora_truncation_residual": residual(global_rank),
            "lora_rank_residuals": {str(r): residual(r) for r in sorted(set(ranks) | {global_rank})},
            "lora_effective_rank": float(np.mean([effective_rank(S) for S in spectra])),
            "lora_rank_99": float(np.mean([energy_rank(S, ENERGY_SHARE) for S in spectra])),
            "lora_client_ranks": {str(c): r for c, r in sorted(client_ranks.items())}}
