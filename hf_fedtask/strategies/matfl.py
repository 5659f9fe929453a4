"""A MaT-FL-style grouped aggregation (after Cai et al., "Many-Task Federated Learning: A New
Problem Setting and a Simple Baseline", CVPRW 2023).

Our reading: every client keeps its own model on the server (the cost MaTU removes). Each round the
server measures the cosine similarity of the participants' updates (changes of the shared PEFT
modules) and moves each participant's model by the sample-weighted mean of the updates of its
`group_size` most similar participants, itself included — a dynamic grouping by update similarity.
Task heads are averaged per task over their holders as in FedAvg. A task's evaluated and exported
model uses the mean of its holders' models.
"""

from __future__ import annotations

import torch

from hf_fedtask.core.state import model_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.merge import weighted_average
from hf_fedtask.strategies.base import (
    SHARED,
    GlobalState,
    Strategy,
    average_heads,
    head_name,
    register_strategy,
)
from hf_fedtask.strategies.configs import MaTFLConfig
from hf_fedtask.strategies.fedavg import delta_update


def cosine_similarity_matrix(vectors: list[TaskVector]) -> torch.Tensor:
    flat = torch.stack([v.flatten().double() for v in vectors])
    flat = flat / flat.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return flat @ flat.T


@register_strategy
class MaTFL(Strategy):
    name = "matfl"
    paper = "Cai et al., Many-Task Federated Learning: A New Problem Setting and a Simple Baseline, CVPRW 2023"
    config_class = MaTFLConfig

    def client_update(self, downlink, job, trainer) -> ClientUpdate:
        return delta_update(downlink, job, trainer)

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.vectors.update({model_name(c): state.vectors[SHARED] for c in allocation})
        return state

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        return {SHARED: state.vectors[model_name(client_id)], **state.heads(tasks)}

    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        similarity = cosine_similarity_matrix([u.vectors[SHARED] for u in updates])
        vectors = {}
        for i, u in enumerate(updates):
            group = torch.argsort(similarity[i], descending=True, stable=True)[: self.config.group_size].tolist()
            mean = weighted_average([updates[j].vectors[SHARED] for j in group],
                                    (updates[j].total_samples for j in group))
            vectors[model_name(u.client_id)] = state.vectors[model_name(u.client_id)] + self.config.server_lr * mean
        vectors.update(average_heads(state, updates, self.config.server_lr))
        return state.next(vectors)

    def task_parameters(self, state, task, stores=None) -> TaskVector:
        holders = state.holders(task)
        shared = weighted_average([state.vectors[model_name(c)] for c in holders], [1.0] * len(holders))
        return TaskVector({**shared, **state.vectors[head_name(task)]})
