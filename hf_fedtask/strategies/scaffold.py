"""SCAFFOLD (Karimireddy et al., 2020), option II, over PEFT task vectors.

Server state: the model x (shared modules + one head per task) and the server control variate c
(`control/shared`, `control/head/<task>`). Each client keeps its own control variate c_i in its
private store (zero at first). A sampled client starts from x and trains with every gradient
corrected by c − c_i (the `LinearCorrection` objective), then sets

    c_i⁺ = c_i − c + (x − y) / Σ_k η_k        (option II; Σ_k η_k = K·η_l at a constant rate)

and sends Δy = y − x and Δc_i = c_i⁺ − c_i. The server moves x ← x + η_g·mean(Δy) (sample-weighted,
as NIID-Bench does) and c ← c + (|S|/N)·mean(Δc_i). A head is corrected and updated like the
shared modules over the clients holding its task (|S_t| of its N_t holders). Clients holding
several tasks train them in turn, so the shared modules' K counts the steps of all of them.

Option II assumes plain SGD steps: the run's `optimizer` must be `sgd` (an AdamW step would rescale
the correction per coordinate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_fedtask.client.objectives import LinearCorrection
from hf_fedtask.core.state import control_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import weighted_average
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.strategies.base import (
    SHARED,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    average_heads,
    fedavg_shared,
    head_name,
    register_strategy,
    updates_by_task,
)
from hf_fedtask.strategies.configs import ScaffoldConfig
from hf_fedtask.strategies.fedavg import train_tasks_in_turn

if TYPE_CHECKING:
    from hf_fedtask.client.trainer import LocalTrainer


@register_strategy
class Scaffold(Strategy, ClientPrivacy):
    name = "scaffold"
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"
    config_class = ScaffoldConfig
    capabilities = Capabilities(client_dp=True)

    def check_run(self, config) -> None:
        if config.optimizer != "sgd":
            raise ConfigError(f"strategy 'scaffold' corrects SGD steps (option II): set optimizer: sgd "
                              f"(got {config.optimizer!r})")

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.vectors.update({control_name(k): v.zeros_like() for k, v in list(state.vectors.items())})
        return state

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        names = [SHARED, *(head_name(t) for t in tasks)]
        return {**{n: state.vectors[n] for n in names},
                **{control_name(n): state.vectors[control_name(n)] for n in names}}

    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        names = [SHARED, *(head_name(t) for t in job.tasks)]
        own = {n: job.store.get(control_name(n), downlink[n].zeros_like()) for n in names}  # c_i
        correction = {n: downlink[control_name(n)] - own[n] for n in names}  # c − c_i

        def options(task: str) -> dict:
            return {"objectives": [LinearCorrection({**correction[SHARED], **correction[head_name(task)]})]}

        shared, heads, metrics = train_tasks_in_turn(downlink, job, trainer, options=options)
        trained = {SHARED: shared, **{head_name(t): h for t, h in heads.items()}}
        steps = {SHARED: sum(metrics[f"{t}/lr_sum"] for t in job.tasks),
                 **{head_name(t): metrics[f"{t}/lr_sum"] for t in job.tasks}}
        deltas, controls = {}, {}  # in the downlink's order: the model's, then the control variates'
        for n in names:
            deltas[n] = delta = trained[n] - downlink[n]  # Δy = y − x
            # c_i⁺ − c_i = −c + (x − y)/Σ η_k
            dc = delta * (-1.0 / steps[n]) - downlink[control_name(n)] if steps[n] > 0 else delta.zeros_like()
            job.store[control_name(n)] = own[n] + dc
            controls[control_name(n)] = dc
        return ClientUpdate(job.client_id, job.round, {**deltas, **controls}, job.num_samples(), metrics)

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate], *, uniform: bool = False
                         ) -> GlobalState:
        eta, allocation = self.config.server_lr, state.allocation
        vectors = {SHARED: fedavg_shared(state, updates, eta, uniform), **average_heads(state, updates, eta)}
        share = len(updates) / len(allocation)  # |S| / N
        vectors[control_name(SHARED)] = state.vectors[control_name(SHARED)] + share * plain_mean(
            u.vectors[control_name(SHARED)] for u in updates)
        for task, holders in updates_by_task(updates).items():
            n = control_name(head_name(task))
            share = len(holders) / len(state.holders(task))  # |S_t| / N_t
            vectors[n] = state.vectors[n] + share * plain_mean(u.vectors[n] for u in holders)
        return state.next(vectors)

    def private_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        """Under client-level DP: the same step with every client weighing 1 in x's shared mean (heads: sample
        counts are 1 under DP), so Δy and Δc_i, clipped together on the client, enter only noisy sums. The
        server's c then follows the clipped, noised Δc_i, not the clients' own c_i exactly."""
        return self.server_aggregate(state, updates, uniform=True)


def plain_mean(vectors) -> TaskVector:
    vectors = list(vectors)
    return weighted_average(vectors, [1.0] * len(vectors))
