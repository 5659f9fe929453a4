"""TCT, Train-Convexify-Train (Yu, Wei, Karimireddy, Ma and Jordan, NeurIPS 2022), over any PEFT
method (or a small network trained in full).

    stage 1    rounds 1..T₁: FedAvg (shared modules + one head per task)
    normalize  round T₁+1, a query: each client computes the eNTK features z(x) = ∇_θ f₁(x)[0] of
               its samples at θ_{T₁} with each task's head re-initialized from `feature_seed`, over
               all trainable parameters, keeps the seeded coordinate subset (p of P, the same
               everywhere) and sends per-coordinate Σz, Σz² and n; the server keeps the global
               mean μ and std σ (σ = 0 → 1). Without `normalize`, μ = 0 and σ = 1.
    stage 2    rounds T₁+2..R: federated linear regression of one-hot − 1/C targets on
               z̃ = (z − μ)/σ, a model W (p × C) and bias b per task, loss (1/n_k)·½‖Z̃W + b − Y‖²;
               client k keeps h_k and its last model θ̂_k, sets h_k ← h_k + (θᵗ − θ̂_k)/(M·η_k),
               runs M full-batch steps θ ← θ − η_k(∇L_k(θ) − h_k) from θᵗ and sends θ − θᵗ; the
               server takes the n_k-weighted mean (SCAFFOLD option II with η_g = 1, the paper's
               Alg. 2). `solver: fedavg` keeps h_k = 0 (the ablation).
    predict    argmax_j (z̃ᵀW + b)_j

Gaps of the paper and its code resolved as follows: stage 2 starts from the averaged global
model (the code loads client 0's), uses all client data (the code one batch), normalizes, has a
bias, uses the mean loss (Alg. 2 a sum) and η_k = 1/λ_max(Z̃ᵀZ̃/n_k) per client unless `stage2_lr`
is set. Features stay on the client (memory, or disk when large) and are recomputed from θ_{T₁},
which the client keeps in its private store, after a restart; they never enter a checkpoint.
Every client takes part in every round (participation 1).
"""

from __future__ import annotations

import hashlib
import tempfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from hf_fedtask.core.state import (
    TCT_LINEAR,
    TCT_POINT,
    linear_name,
    moments_name,
    norm_name,
    tct_h_name,
    tct_last_name,
    tct_lr_name,
)
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, ProtocolError
from hf_fedtask.merge import weighted_average
from hf_fedtask.strategies.base import (
    QUERY,
    SHARED,
    TRAIN,
    Capabilities,
    ClientJob,
    GlobalState,
    Packaging,
    Strategy,
    average_heads,
    fedavg_shared,
    head_name,
    register_strategy,
    updates_by_task,
)
from hf_fedtask.strategies.configs import TCTConfig
from hf_fedtask.strategies.fedavg import delta_update

if TYPE_CHECKING:
    from datasets import Dataset

    from hf_fedtask.client.trainer import LocalTrainer
    from hf_fedtask.model.host import PeftHost

STAGE1, NORMALIZE, STAGE2 = "stage1", "normalize", "stage2"
MOMENTS_QUERY = "entk_moments"
SPILL_BYTES = 256 << 20  # features of one (client, task) larger than this live on disk


def feature_head(template: TaskVector, task: str, seed: int, std: float = 0.02) -> TaskVector:
    """The re-initialized head (shaped like `template`) whose first output defines the features, the
    same on every client, the server and in exports: weights N(0, std²) from a seeded generator (BERT's
    and ViT's initializer range), biases zero."""
    gen = torch.Generator().manual_seed(seed * 100003 + zlib.crc32(task.encode()) % 100003)
    return TaskVector({k: torch.randn(t.shape, generator=gen) * std if k.endswith("weight") else torch.zeros(t.shape)
                       for k, t in template.items()})


def head_labels(head: TaskVector) -> int:
    """The number of outputs of a head (its weight's rows)."""
    return next(t for k, t in head.items() if k.endswith("weight")).shape[0]


def state_digest(vector: TaskVector) -> str:
    digest = hashlib.sha256()
    for key, t in vector.items():
        digest.update(key.encode())
        digest.update(t.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class FeatureCache:
    """eNTK features by (who, task, θ digest): in memory, or in a private temp folder when large."""

    def __init__(self):
        self._memory: dict[tuple, torch.Tensor] = {}
        self._folder: tempfile.TemporaryDirectory | None = None

    def get(self, key: tuple, compute) -> torch.Tensor:
        if key in self._memory:
            return self._memory[key]
        path = self._path(key) if self._folder else None
        if path is not None and path.exists():
            return load_file(path)["z"]
        z = compute()
        if z.numel() * z.element_size() > SPILL_BYTES:
            self._folder = self._folder or tempfile.TemporaryDirectory(prefix="hf_fedtask_entk_")
            save_file({"z": z.contiguous()}, self._path(key))
        else:
            self._memory = {k: v for k, v in self._memory.items() if k[2] == key[2]}  # drop other θ's
            self._memory[key] = z
        return z

    def _path(self, key: tuple) -> Path:
        return Path(self._folder.name) / (hashlib.sha256(repr(key).encode()).hexdigest()[:24] + ".safetensors")


def targets(labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """One-hot − 1/C."""
    return torch.nn.functional.one_hot(labels, num_labels).float() - 1.0 / num_labels


def largest_eigenvalue(z: torch.Tensor, bias: bool, iterations: int = 50) -> float:
    """λ_max of [Z 1]ᵀ[Z 1]/n by power iteration (Z is n × p, so this costs 2·n·p per step)."""
    z = torch.cat([z, torch.ones(len(z), 1)], 1) if bias else z
    v = torch.randn(z.shape[1], generator=torch.Generator().manual_seed(0))
    lam = 0.0
    for _ in range(iterations):
        w = z.T @ (z @ v) / len(z)
        lam = float(w.norm())
        if lam == 0:
            return 0.0
        v = w / lam
    return lam


def regression_steps(z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     h_weight: torch.Tensor, h_bias: torch.Tensor | None, steps: int, lr: float):
    """M full-batch steps θ ← θ − η(∇L(θ) − h) of L = (1/n)·½‖ZW + b − Y‖²; returns (W, b, final loss)."""
    n = len(z)
    for _ in range(steps):
        residual = z @ weight - y
        if bias is not None:
            residual = residual + bias
        weight = weight - lr * (z.T @ residual / n - h_weight)
        if bias is not None:
            bias = bias - lr * (residual.mean(0) - h_bias)
    residual = z @ weight - y + (bias if bias is not None else 0)
    return weight, bias, float((residual ** 2).sum(1).mean() / 2)


@register_strategy
class TCT(Strategy, Packaging):
    name = "tct"
    paper = ("Yu, Wei, Karimireddy, Ma and Jordan, TCT: Convexifying Federated Learning using Bootstrapped Neural "
             "Tangent Kernels, NeurIPS 2022")
    config_class = TCTConfig
    capabilities = Capabilities(personalization=False, exports=("adapters", "tct"), classifier_only=(
        "its stage 2 regresses one-hot targets on eNTK features of a per-task classification head's C outputs; a "
        "causal LM's outputs are its whole vocabulary, whose eNTK features would not fit in memory"))

    def __init__(self, config=None, **options):
        super().__init__(config, **options)
        self.features = FeatureCache()

    def check_run(self, config) -> None:
        if config.output_space != "per_task":
            raise ConfigError(f"strategy 'tct' does not support output_space {config.output_space!r}: its stage-2 "
                              "linear model is fitted per task over that task's labels (use output_space per_task)")
        if config.participation < 1:
            raise ConfigError(f"strategy 'tct' needs every client in every round (participation 1, got "
                              f"{config.participation}): its normalization round and stage-2 solver assume it")
        need = self.config.stage1_rounds + 2
        if config.rounds < need:
            raise ConfigError(f"strategy 'tct': rounds={config.rounds} leaves no stage-2 round after "
                              f"stage1_rounds={self.config.stage1_rounds} and the normalization round "
                              f"(need rounds >= {need})")

    # -- state -------------------------------------------------------------------------------------
    def phase(self, state: GlobalState) -> str:
        return state.scalars.get("phase", STAGE1)

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.scalars.update(phase=STAGE1 if self.config.stage1_rounds > 0 else NORMALIZE, stage2_rounds=0)
        return state

    def num_features(self, state: GlobalState, task: str) -> int:
        total = state.vectors[SHARED].numel() + state.vectors[head_name(task)].numel()
        return min(self.config.num_features, total)

    def _stage2_vectors(self, state: GlobalState) -> dict[str, TaskVector]:
        out = {}
        for task in state.tasks:
            p, c = self.num_features(state, task), head_labels(state.vectors[head_name(task)])
            out[norm_name(task)] = TaskVector({"mean": torch.zeros(p), "std": torch.ones(p)})
            linear = {"weight": torch.zeros(p, c)}
            if self.config.bias:
                linear["bias"] = torch.zeros(c)
            out[linear_name(task)] = TaskVector(linear)
        return out

    def state_template(self, initial: GlobalState, scalars: dict) -> GlobalState:
        if scalars.get("phase") != STAGE2:
            return initial
        return GlobalState(initial.round, {**initial.vectors, **self._stage2_vectors(initial)}, dict(scalars))

    # -- communication -----------------------------------------------------------------------------
    def message_kind(self, state: GlobalState) -> str:
        return QUERY if self.phase(state) == NORMALIZE else TRAIN

    def query_name(self, state: GlobalState) -> str:
        return MOMENTS_QUERY if self.phase(state) == NORMALIZE else ""

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        if self.phase(state) == STAGE2:  # θ_{T₁} is in the client's store since the normalization round
            return {**{norm_name(t): state.vectors[norm_name(t)] for t in tasks},
                    **{linear_name(t): state.vectors[linear_name(t)] for t in tasks}}
        return super().downlink(state, client_id, tasks)

    def update_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        phase = self.phase(state)
        if phase == NORMALIZE:
            return {moments_name(t): self._moments_template(self.num_features(state, t)) for t in tasks}
        if phase == STAGE2:
            return {linear_name(t): state.vectors[linear_name(t)] for t in tasks}
        return super().update_templates(state, client_id, tasks)

    @staticmethod
    def _moments_template(p: int) -> TaskVector:
        return TaskVector({"sum": torch.zeros(p, dtype=torch.float64), "sumsq": torch.zeros(p, dtype=torch.float64),
                           "count": torch.zeros(1, dtype=torch.float64)})

    # -- features ----------------------------------------------------------------------------------
    def feature_index(self, point: TaskVector, head: TaskVector) -> torch.Tensor:
        from hf_fedtask.model.entk import coordinate_subset

        return coordinate_subset(point.numel() + head.numel(), self.config.num_features, self.config.feature_seed)

    def compute_features(self, host: PeftHost, point: TaskVector, task: str, head_template: TaskVector,
                         data: Dataset, who: str) -> torch.Tensor:
        """z for prepared `data` at θ_{T₁} = `point` (cached by who, task and θ's digest)."""
        from hf_fedtask.model.entk import entk_features

        head = feature_head(head_template, task, self.config.feature_seed)
        index = self.feature_index(point, head)

        def compute() -> torch.Tensor:
            return entk_features(host, TaskVector({**point, **head}), data, index,
                                 batch_size=self.config.feature_batch_size)

        return self.features.get((who, task, state_digest(point), len(data)), compute)

    def _client_features(self, job: ClientJob, trainer: LocalTrainer, task: str) -> torch.Tensor:
        if TCT_POINT not in job.store:
            raise ProtocolError(f"tct: client {job.client_id} holds no stage-1 model "
                                "(it missed the normalization round)")
        return self.compute_features(trainer.host, job.store[TCT_POINT], task, job.initial_heads[task], job.data[task],
                                     who=f"client {job.client_id}")

    # -- client ------------------------------------------------------------------------------------
    def client_query(self, downlink, job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        if job.query != MOMENTS_QUERY:
            raise ProtocolError(f"tct: unknown query {job.query!r}")
        job.store[TCT_POINT] = downlink[SHARED]
        vectors = {}
        for task in job.tasks:
            z = self._client_features(job, trainer, task).double()
            vectors[moments_name(task)] = TaskVector({"sum": z.sum(0), "sumsq": (z ** 2).sum(0),
                                                      "count": torch.tensor([float(len(z))], dtype=torch.float64)})
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), {})

    def client_update(self, downlink, job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        if self.phase_of_downlink(downlink) != STAGE2:
            return delta_update(downlink, job, trainer)
        c, vectors, metrics = self.config, {}, {}
        for task in job.tasks:
            norm, linear = downlink[norm_name(task)], downlink[linear_name(task)]
            z = (self._client_features(job, trainer, task) - norm["mean"]) / norm["std"]
            y = targets(torch.as_tensor(job.data[task]["labels"]), linear["weight"].shape[1])
            if tct_lr_name(task) not in job.store:
                lr = c.stage2_lr or 1.0 / max(largest_eigenvalue(z, c.bias), 1e-12)
                job.store[tct_lr_name(task)] = TaskVector({"lr": torch.tensor([lr], dtype=torch.float64)})
            lr = float(job.store[tct_lr_name(task)]["lr"])
            last = job.store.get(tct_last_name(task), linear.zeros_like())  # θ̂_k (θ⁰ = 0)
            h = job.store.get(tct_h_name(task), linear.zeros_like())
            if c.solver == "scaffold":
                h = h + (linear - last) * (1.0 / (c.stage2_steps * lr))
            weight, bias, loss = regression_steps(z, y, linear["weight"], linear.get("bias"), h["weight"],
                                                  h.get("bias"), c.stage2_steps, lr)
            trained = TaskVector({"weight": weight, **({"bias": bias} if bias is not None else {})})
            job.store[tct_last_name(task)], job.store[tct_h_name(task)] = trained, h
            vectors[linear_name(task)] = trained - linear
            metrics[f"{task}/train_loss"] = loss
            metrics[f"{task}/stage2_lr"] = lr
        return ClientUpdate(job.client_id, job.round, vectors, job.num_samples(), metrics)

    @staticmethod
    def phase_of_downlink(downlink: dict[str, TaskVector]) -> str:
        return STAGE2 if any(k.startswith(TCT_LINEAR) for k in downlink) else STAGE1

    # -- server ------------------------------------------------------------------------------------
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        phase = self.phase(state)
        if phase == NORMALIZE:
            return state.next({**self._stage2_vectors(state), **self._normalization(state, updates)}, phase=STAGE2)
        if phase == STAGE2:
            vectors = {}
            for task, holders in updates_by_task(updates).items():
                key = linear_name(task)
                mean = weighted_average([u.vectors[key] for u in holders], (u.num_samples[task] for u in holders))
                vectors[key] = state.vectors[key] + mean
            return state.next(vectors, stage2_rounds=state.scalars.get("stage2_rounds", 0) + 1)
        vectors = {SHARED: fedavg_shared(state, updates), **average_heads(state, updates)}
        return state.next(vectors, phase=NORMALIZE if state.round + 1 >= self.config.stage1_rounds else STAGE1)

    def _normalization(self, state: GlobalState, updates: list[ClientUpdate]) -> dict[str, TaskVector]:
        out = {}
        for task, holders in updates_by_task(updates).items():
            moments = [u.vectors[moments_name(task)] for u in holders]
            n = sum(float(m["count"]) for m in moments)
            mean = sum(m["sum"] for m in moments) / n
            var = (sum(m["sumsq"] for m in moments) / n - mean ** 2).clamp(min=0)
            std = var.sqrt()
            std = torch.where(std > 0, std, torch.ones_like(std))  # σ = 0: a constant coordinate
            if not self.config.normalize:
                mean, std = torch.zeros_like(mean), torch.ones_like(std)
            out[norm_name(task)] = TaskVector({"mean": mean.float(), "std": std.float()})
        return out

    # -- evaluation --------------------------------------------------------------------------------
    def predict(self, state: GlobalState, task: str, host: PeftHost, data: Dataset,
                batch_size: int) -> np.ndarray | None:
        if self.phase(state) != STAGE2 or not state.scalars.get("stage2_rounds"):
            return None  # still the stage-1 model (the host evaluates it)
        z = self.compute_features(host, state.vectors[SHARED], task, state.vectors[head_name(task)], data, who="server")
        return self.linear_logits(state, task, z).argmax(-1).cpu().numpy()

    def package(self, state: GlobalState, task: str) -> tuple[TaskVector, dict[str, torch.Tensor]] | None:
        """What `hf_fedtask.export.tct.save_tct` writes for `task`: the feature network (θ_{T₁} with the
        feature head) and the linear model with its coordinates; None before stage 2 has trained."""
        if self.phase(state) != STAGE2 or not state.scalars.get("stage2_rounds"):
            return None
        point, head = state.vectors[SHARED], feature_head(state.vectors[head_name(task)], task,
                                                          self.config.feature_seed)
        linear = {"index": self.feature_index(point, head), **state.vectors[norm_name(task)],
                  **state.vectors[linear_name(task)]}
        return TaskVector({**point, **head}), linear

    def linear_logits(self, state: GlobalState, task: str, z: torch.Tensor) -> torch.Tensor:
        norm, linear = state.vectors[norm_name(task)], state.vectors[linear_name(task)]
        logits = ((z - norm["mean"]) / norm["std"]) @ linear["weight"]
        return logits + linear["bias"] if "bias" in linear else logits
