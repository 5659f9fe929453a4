"""MaTU: Tsouvalas, Ozcelebi and Meratnia, "Many-Task Federated Fine-Tuning via Unified Task Vectors",
2025 (arXiv:2502.06376), Eqs. 3-7; where the paper is silent (κ, what the vectors are) the options say.

Client n holding tasks T_n receives one unified vector τ_n, a binary mask m_n^t and a rescaler λ_n^t
per task. For each task it trains from θ_p + λ_n^t·(m_n^t ⊙ τ_n), then unifies what it measured for its
tasks and uploads τ_n, the masks and the rescalers. The server, per task t over the participating
holders N^t (x_n^t ≈ λ_n^t·(m_n^t ⊙ τ_n) is holder n's decoded upload for t):

    α^t = |mean_n sgn(x_n^t)|,  m̂^t = 1 where α^t ≥ ρ else α^t                    (Eq. 3)
    τ̂^t = m̂^t ⊙ Σ_n γ_n^t·x_n^t,   γ_n^t ∝ |D_n^t|                               (Eq. 4)
    S(t, t') = ½(mean_j sgn v^t·sgn v^t' + 1)                                     (Eq. 5)
    Z^t = top-κ tasks t' ≠ t with S(t, t') > ε
    τ̃^t = Σ_{t'∈Z^t} S(t, t')·m̂^t ⊙ a^t'                                        (Eq. 6)
    combine(τ̂^t, τ̃^t) = τ̂^t + τ̃^t (sum) | ½(τ̂^t + τ̃^t) (mean)
                       | (τ̂^t + τ̃^t) / (1 + Σ_{Z^t} S) (s_normalized)              (Eq. 7)
                       | τ̂^t + τ̃^t / (1 + Σ_{Z^t} S) (s_normalized_cross)

then sends each client the unification of {τ^t : t ∈ T_n}. S ≈ 0.5 means unrelated tasks (random
signs), S > 0.5 agreeing and S < 0.5 opposed ones. Two readings of what the vectors are (`vectors`):

    cumulative  the literal one: x_n^t is τ_n^t = trained − θ_p and τ^t ← combine(τ̂^t, τ̃^t). Starting
                each round from the decoded unification imports other tasks' magnitudes where signs
                agree and resets disagreeing entries to θ_p, so with multi-task clients the normalized
                Eq. 7 acts as a consensus iteration and the task vectors collapse into one; `sum`
                adds the neighbours' whole vectors every round and compounds (geometrically unless
                local training pulls each task most of the way back to its optimum).
    delta       (default) x_n^t is the round's change, trained − start (the client still starts from
                θ_p + λ_n^t·(m_n^t ⊙ τ_n)), and τ^t ← τ^t + combine(τ̂^t, τ̃^t): Eqs. 3-7 act on
                increments, so tasks stay distinct; `sum` adds the neighbours' increments each round,
                stable because increments are small; `mean` and `s_normalized` mix t's own step with
                its neighbours' (shrinking it: by 1 / (1 + Σ S), about half with two unrelated
                neighbours); `s_normalized_cross` keeps t's own step whole and adds the neighbours'
                with the weights `s_normalized` gives them.

Where a client starts (`downlink`): `unified` (the paper's) decodes each task's start
λ_n^t·(m_n^t ⊙ τ_n) from the unification of the client's tasks, so under delta the step is measured at
one point and added to another, τ^t: entries the unification drops for t keep receiving t's pull, and
opposed tasks can end up further apart than their optima. `per_task` sends every held task's own τ^t
(one vector per task instead of one for all, and no masks), so the step lands where it was measured.
Adding the step where the client started instead (the server can re-decode what it sent, no extra
bytes) is worse: local training moves a start only part of the way, so what the unification drops
would be lost again every round (`benchmarks/matu_start.py` measures all three). `per_task_int4` and
`per_task_int8` send each τ^t block-quantized (`hf_fedtask.merge.blockquant`: 4.25 bits an entry at 4,
0.133 of float32; the unified downlink costs 32 + 1 bits an entry per task held, so 4 bits are the cheaper
while a client holds fewer than about 10 tasks); the client trains from the decoded start. With
`downlink_feedback` (the default) the server keeps each task's rounding error e^t (per task, not per
client) and adds it to the task's next downlink, round(τ^t + e^t), as error-feedback compressors do: the
starts a task's holders train from then average to τ^t over rounds, where plain rounding would keep
measuring every step at the same rounded point (τ^t settles where its rounding is optimal, a quantization
step off). The server's τ^t, evaluated and exported, is never rounded. On the main job (builtin-30,
clients holding 7.2 tasks on average) `per_task_int4` scores as `per_task` does for 0.82 of the unified
downlink's bytes (docs/results/matu.md). Each slot of a wire form carries its task's name (`tasks`), so
slots are matched by name, never by position.

Neighbours (`neighbours`): `round` compares (v) and adds (a) only this round's τ̂ of the tasks with
participants; `all` (default) compares every task's server vector, so tasks carried forward from
earlier rounds can be neighbours: v^t is τ^t as this round's Eq. 4 leaves it (τ̂^t under cumulative,
τ^t + τ̂^t under delta; the stored τ^t for a task without participants). What such a carried-forward
neighbour adds (a) is its stored τ^t under cumulative; under delta it has no increment this round, so
it is no candidate for Z^t (it would add nothing, and averaging t's step with a zero step would only
slow t whenever a related task is not sampled): `all` then picks the neighbours among this round's
tasks by the similarity of their whole vectors τ^t + τ̂^t rather than of one round's increments. Tasks
without participants keep τ^t.

The server state is per task only (τ^t, heads), never per client. Each task is evaluated and exported
from θ_p + τ^t (`task_parameters`); each round the server also unifies all T task vectors into the
storage-saving compact form (one τ, T masks, T rescalers; `export` in the state, `compact_form`), whose
own decoding θ_p + λ_t·(m_t ⊙ τ) is `compact_task_parameters`; τ is kept in `export_dtype` (float16 by
default, so the accuracy reported for the compact form is that of what is exported), and the export
regenerates θ_p from the run's seed instead of storing it where that reproduces it bit for bit
(`hf_fedtask.export.compact`).

Heads are per task and cannot be unified (their shapes differ): they travel as float32 and are
averaged over the task's holders as in FedAvg (the paper's ViT heads are not described).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import torch

from hf_fedtask.core.state import MATU_EXPORT, MATU_WIRE, matu_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.errors import ConfigError, TaskVectorError
from hf_fedtask.merge import agreement_mask, blockquant, sign_similarity, unify, weighted_average
from hf_fedtask.merge.bitmask import packed_size, unpack_bits
from hf_fedtask.privacy.hooks import ClientPrivacy
from hf_fedtask.strategies.base import (
    SHARED,
    Capabilities,
    ClientJob,
    CompactExport,
    GlobalState,
    Strategy,
    average_heads,
    head_name,
    register_strategy,
    updates_by_task,
)

# `NAME as NAME`: re-exported, defined here before hf_fedtask.strategies.configs
from hf_fedtask.strategies.configs import COMBINE_RULES as COMBINE_RULES
from hf_fedtask.strategies.configs import DEFAULT_READING as DEFAULT_READING
from hf_fedtask.strategies.configs import DOWNLINK_BITS, EXPORT_DTYPE_NAMES, WIRE_DTYPE_NAMES, MaTUConfig
from hf_fedtask.strategies.configs import DOWNLINKS as DOWNLINKS
from hf_fedtask.strategies.configs import NEIGHBOURHOODS as NEIGHBOURHOODS
from hf_fedtask.strategies.configs import READINGS as READINGS

if TYPE_CHECKING:
    from hf_fedtask.client.trainer import LocalTrainer

WIRE_DTYPES = {name: getattr(torch, name) for name in (*WIRE_DTYPE_NAMES, *EXPORT_DTYPE_NAMES)}
DOWNLINK_ERROR = "downlink_error/"  # e^t: the rounding error a quantized per-task downlink feeds back


def downlink_error_name(task: str) -> str:
    """The state vector of `task`'s downlink rounding error (per_task_int8/int4 with `downlink_feedback`)."""
    return f"{DOWNLINK_ERROR}{task}"


def encode_tasks(tasks: list[str]) -> torch.Tensor:
    """The wire's task order as a tensor: the JSON list of names, UTF-8, one uint8 per byte."""
    return torch.tensor(list(json.dumps(list(tasks)).encode()), dtype=torch.uint8)


def wire_tasks(wire: TaskVector) -> list[str]:
    """The tasks of a wire form, in slot order (its `tasks` entry)."""
    return json.loads(bytes(wire["tasks"].tolist()).decode())


def encode_wire(vectors: dict[str, TaskVector], rescaler: str, dtype: str = "float32",
                heads: dict[str, TaskVector] | None = None, per_task: bool = False, bits: int = 32) -> TaskVector:
    """MaTU's wire form of task vectors (task -> τ^t, PEFT keys), its slots in the order given:

        tasks      the task names in slot order (`encode_tasks`), so slots are matched by name
        unified    the unified vector τ, flat (float32, or bfloat16 on request; float16 in the export)
        masks      (T, ⌈d/8⌉) uint8: task t's mask m_t, bit-packed over the same flat layout
        rescalers  (T,) float32: λ_t
        heads      the tasks' heads, flattened and concatenated in slot order (when given)

    A handful of tensors whatever T and the number of modules, so the header stays a few hundred
    bytes. `per_task` sends every τ^t itself instead of the unification: `vectors` (T, d) replaces
    unified, masks and rescalers (T times the unified vector's bytes); with `bits` 8, 4 or 2 each row
    is block-quantized instead (`hf_fedtask.merge.blockquant`): `codes` (T, ⌈d·bits/8⌉) uint8,
    `scales` (T, ⌈d/64⌉) bfloat16 and `bits` (a uint8) replace `vectors` (4.25 bits an entry at 4)."""
    tasks = list(vectors)
    if per_task and bits != 32:
        rows = [blockquant.quantize(vectors[t].flatten(), bits) for t in tasks]
        wire = {"tasks": encode_tasks(tasks), "codes": torch.stack([r.codes for r in rows]),
                "scales": torch.stack([r.scales for r in rows]), "bits": torch.tensor([bits], dtype=torch.uint8)}
    elif per_task:
        wire = {"tasks": encode_tasks(tasks),
                "vectors": torch.stack([vectors[t].flatten() for t in tasks]).to(WIRE_DTYPES[dtype])}
    else:
        u = unify([vectors[t] for t in tasks], rescaler=rescaler)
        wire = {
            "tasks": encode_tasks(tasks),
            "unified": u.vector.flatten().to(WIRE_DTYPES[dtype]),
            "masks": torch.stack(u.masks),
            "rescalers": torch.tensor(u.rescalers, dtype=torch.float32),
        }
    if heads is not None:
        wire["heads"] = torch.cat([heads[t].flatten().float() for t in tasks])
    return TaskVector(wire)


def wire_template(numel: int, tasks: list[str], dtype: str = "float32",
                  heads: dict[str, TaskVector] | None = None, per_task: bool = False) -> TaskVector:
    """Keys, shapes and dtypes of `encode_wire`'s output (values are zeros but the task names)."""
    if per_task:
        wire = {"tasks": encode_tasks(tasks), "vectors": torch.zeros(len(tasks), numel, dtype=WIRE_DTYPES[dtype])}
    else:
        wire = {
            "tasks": encode_tasks(tasks),
            "unified": torch.zeros(numel, dtype=WIRE_DTYPES[dtype]),
            "masks": torch.zeros(len(tasks), packed_size(numel), dtype=torch.uint8),
            "rescalers": torch.zeros(len(tasks)),
        }
    if heads is not None:
        wire["heads"] = torch.zeros(sum(heads[t].flatten().numel() for t in tasks))
    return TaskVector(wire)


def slot(wire: TaskVector, task: str) -> int:
    """The slot of `task` in `wire`; a wire without it is refused naming both."""
    tasks = wire_tasks(wire)
    if task not in tasks:
        raise TaskVectorError(f"MaTU wire form carries tasks {tasks}, not {task!r}")
    return tasks.index(task)


def decode_task(wire: TaskVector, task: str, like: TaskVector) -> TaskVector:
    """λ_t·(m_t ⊙ τ) of `task` (its own τ^t in a per-task wire form, as quantized there), in the keys, shapes and
    dtypes of `like`."""
    index = slot(wire, task)
    if "vectors" in wire:
        return TaskVector.unflatten(wire["vectors"][index].float(), like)
    if "codes" in wire:
        numel = sum(v.numel() for v in like.values())
        return TaskVector.unflatten(blockquant.dequantize(wire["codes"][index], wire["scales"][index],
                                                          int(wire["bits"][0]), numel), like)
    flat = wire["unified"].float()
    masked = flat * unpack_bits(wire["masks"][index], flat.numel())
    return TaskVector.unflatten(float(wire["rescalers"][index]) * masked, like)


def decode_heads(wire: TaskVector, templates: dict[str, TaskVector]) -> dict[str, TaskVector]:
    """The heads in `wire`, split by `templates` (task -> a head of the right shapes), matched by name."""
    tasks = wire_tasks(wire)
    if sorted(templates) != sorted(tasks):
        raise TaskVectorError(f"MaTU wire form carries the heads of {tasks}, expected {sorted(templates)}")
    parts = torch.split(wire["heads"], [templates[t].flatten().numel() for t in tasks])
    return {t: TaskVector.unflatten(part, templates[t]) for t, part in zip(tasks, parts)}


@register_strategy
class MaTU(Strategy, CompactExport, ClientPrivacy):
    name = "matu"
    paper = ("Tsouvalas, Ozcelebi and Meratnia, Many-Task Federated Fine-Tuning via Unified Task Vectors, 2025 "
             "(arXiv:2502.06376)")
    config_class = MaTUConfig
    capabilities = Capabilities(exports=("adapters", "compact"), client_dp=True)

    # -- state ---------------------------------------------------------------------------------
    def check_run(self, config) -> None:
        if config.peft_method == "probe":
            raise ConfigError("strategy 'matu' unifies the task vectors of shared modules; peft_method 'probe' "
                              "shares none (use lora, ia3, bottleneck, prompt or full)")

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)  # SHARED holds θ_p and never moves
        if isinstance(getattr(host, "seed", None), int):  # θ_p's seed: the compact export regenerates θ_p from it
            state.scalars["init_seed"] = host.seed
            state.scalars["shared_head"] = int(getattr(host, "shared_head", 0))
        zero = state.vectors[SHARED].zeros_like()
        for task in tasks:
            state.vectors[matu_task_vector_name(task.name)] = zero
            if self._feedback:
                state.vectors[downlink_error_name(task.name)] = zero
        state.vectors.update(self._exported(state))
        return state

    @property
    def _feedback(self) -> bool:
        """Whether the server keeps each task's downlink rounding error (quantized per-task downlink)."""
        return self._bits != 32 and self.config.downlink_feedback

    @property
    def _bits(self) -> int:
        """Bits an entry of each τ^t on a per-task downlink (32: float, in `wire_dtype`)."""
        return DOWNLINK_BITS.get(self.config.downlink, 32)

    def _task_vectors(self, state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
        return {t: state.vectors[matu_task_vector_name(t)] for t in tasks}

    def _exported(self, state: GlobalState) -> dict[str, TaskVector]:
        """All tasks unified (the compact export), kept in the state as `export`."""
        return {MATU_EXPORT: encode_wire(self._task_vectors(state, state.tasks), self.config.rescaler,
                                         self.config.export_dtype)}

    def compact_form(self, state: GlobalState) -> dict:
        """The exported form as `hf_fedtask.compact.save_compact` arguments (bool masks per key; τ in
        `export_dtype`; θ_p's seed, so the export can regenerate θ_p instead of storing it)."""
        origin = state.vectors[SHARED]
        wire = state.vectors[MATU_EXPORT]
        shapes = {k: tuple(v.shape) for k, v in origin.items()}
        numel = wire["unified"].numel()
        tasks = wire_tasks(wire)
        seed = state.scalars.get("init_seed")
        return {
            "init": origin,
            **({"init_seed": seed, "shared_head": state.scalars.get("shared_head", 0)} if seed is not None else {}),
            "unified": TaskVector.unflatten(wire["unified"], shapes),
            "masks": {t: TaskVector.unflatten(unpack_bits(wire["masks"][i], numel), shapes)
                      for i, t in enumerate(tasks)},
            "rescalers": {t: float(wire["rescalers"][i]) for i, t in enumerate(tasks)},
            "heads": {t: state.vectors[head_name(t)] for t in tasks},
        }

    def task_parameters(self, state, task, stores=None) -> TaskVector:
        """θ_p + τ^t, the server's own vector of the task, plus its head: what is evaluated and exported
        as the task's adapter (the compact form loses accuracy to unification)."""
        shared = state.vectors[SHARED] + state.vectors[matu_task_vector_name(task)]
        return TaskVector({**shared, **state.vectors[head_name(task)]})

    def compact_task_parameters(self, state: GlobalState, task: str) -> TaskVector:
        """θ_p + λ_t·(m_t ⊙ τ) from the all-task unification, plus the task's head: the task as the
        compact export (`compact_form`) gives it, so its accuracy can be reported beside `task_parameters`'."""
        origin = state.vectors[SHARED]
        shared = origin + decode_task(state.vectors[MATU_EXPORT], task, origin)
        return TaskVector({**shared, **state.vectors[head_name(task)]})

    # -- communication -----------------------------------------------------------------------------
    def _heads(self, state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
        return {t: state.vectors[head_name(t)] for t in tasks}

    def _sent(self, state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
        """What a quantized per-task downlink rounds: τ^t plus, with error feedback, what rounding left out of
        the task's previous downlinks (e^t); else τ^t."""
        vectors = self._task_vectors(state, tasks)
        if not self._feedback:
            return vectors
        return {t: v + state.vectors[downlink_error_name(t)] for t, v in vectors.items()}

    def downlink(self, state, client_id, tasks) -> dict[str, TaskVector]:
        return {MATU_WIRE: encode_wire(self._sent(state, tasks), self.config.rescaler, self.config.wire_dtype,
                                       heads=self._heads(state, tasks), per_task=self.config.downlink != "unified",
                                       bits=self._bits)}

    def _downlink_errors(self, state: GlobalState, tasks: list[str]) -> dict[str, TaskVector]:
        """e^t ← τ^t + e^t − decode(round(τ^t + e^t)) for the tasks trained this round (server-side error feedback,
        as in error-feedback SGD, on the downlink): what rounding left out of the start the task's holders got
        is added to its next downlink, so over rounds the starts average to τ^t instead of staying off by a
        fixed rounding error (the step is measured there, so τ^t would settle where its rounding is optimal)."""
        sent = self._sent(state, tasks)
        wire = encode_wire(sent, self.config.rescaler, per_task=True, bits=self._bits)
        origin = state.vectors[SHARED]
        return {downlink_error_name(t): v - decode_task(wire, t, origin) for t, v in sent.items()}

    def update_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        numel = sum(t.numel() for t in state.vectors[SHARED].values())
        return {MATU_WIRE: wire_template(numel, tasks, self.config.wire_dtype, heads=self._heads(state, tasks))}

    # -- client ------------------------------------------------------------------------------------
    def client_update(self, downlink: dict[str, TaskVector], job: ClientJob, trainer: LocalTrainer) -> ClientUpdate:
        origin, wire = job.origin, downlink[MATU_WIRE]
        heads = decode_heads(wire, {t: job.initial_heads[t] for t in job.tasks})
        trained_vectors, head_deltas, metrics = {}, {}, {}
        for task in job.tasks:
            start_shared = origin + decode_task(wire, task, origin)
            trained, m = trainer.train(TaskVector({**start_shared, **heads[task]}), job.data[task],
                                       seed=job.seed_for(task))
            measured_from = start_shared if self.config.vectors == "delta" else origin
            trained_vectors[task] = trained.filter(lambda k: k in origin) - measured_from
            head_deltas[task] = trained.filter(lambda k: k not in origin) - heads[task]
            metrics[f"{task}/train_loss"] = m["train_loss"]
        update = encode_wire(trained_vectors, self.config.rescaler, self.config.wire_dtype, heads=head_deltas)
        return ClientUpdate(job.client_id, job.round, {MATU_WIRE: update}, job.num_samples(), metrics)

    # -- server ------------------------------------------------------------------------------------
    def server_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        origin = state.vectors[SHARED]
        same_task, soft_masks = {}, {}
        for u in updates:  # slots are matched by name: an upload must carry exactly the tasks it reports
            if sorted(wire_tasks(u.vectors[MATU_WIRE])) != sorted(u.num_samples):
                raise TaskVectorError(f"client {u.client_id} (round {u.round}): its MaTU upload carries tasks "
                                      f"{wire_tasks(u.vectors[MATU_WIRE])}, but reports samples for "
                                      f"{sorted(u.num_samples)}")
        # the heads' changes, unpacked (into copies: the updates are not ours to change), are averaged as in FedAvg
        updates = [dataclasses.replace(u, vectors={**u.vectors, **{
            head_name(t): h
            for t, h in decode_heads(u.vectors[MATU_WIRE], self._heads(state, sorted(u.num_samples))).items()}})
            for u in updates]
        for task, holders in updates_by_task(updates).items():
            total = sum(u.num_samples[task] for u in holders)
            # x_n^t ≈ λ_n^t·(m_n^t ⊙ τ_n), weighted by γ_n^t (Eq. 4); the sign vote of Eq. 3 ignores λ > 0
            reconstructed = [decode_task(u.vectors[MATU_WIRE], task, origin) for u in holders]
            soft_masks[task] = agreement_mask(reconstructed, self.config.rho)
            weighted = reconstructed[0].zeros_like()
            for u, r in zip(holders, reconstructed):
                weighted = weighted + (u.num_samples[task] / total) * r
            same_task[task] = soft_masks[task] * weighted
        return self._combined(state, same_task, soft_masks, updates)

    def _combined(self, state: GlobalState, same_task: dict[str, TaskVector], soft_masks: dict[str, TaskVector],
                  updates: list[ClientUpdate]) -> GlobalState:
        """Eqs. 5-7 from this round's τ̂ and masks, the new task vectors, the heads' FedAvg step, the export."""
        combined = self._cross_task(state, same_task, soft_masks)
        if self.config.vectors == "delta":
            combined = {t: state.vectors[matu_task_vector_name(t)] + v for t, v in combined.items()}
        vectors = {matu_task_vector_name(t): v for t, v in combined.items()}
        if self._feedback:  # the tasks whose holders trained from a downlink this round
            vectors.update(self._downlink_errors(state, sorted(updates_by_task(updates))))
        new = state.next({**vectors, **average_heads(state, updates)})
        new.vectors.update(self._exported(new))
        return new

    # -- client-level DP (`hf_fedtask.privacy`) ------------------------------------------------------
    def check_private(self, config) -> None:
        """ρ thresholds Eq. 3's vote over each holder's signs, which DP does not release: under DP the mask is 1,
        what ρ = 0 gives (α ≥ 0 everywhere). A ρ given other than 0 would be accepted and ignored: refused."""
        rho = config.strategy_options.get("rho")
        if rho is not None and rho != 0:
            raise ConfigError(f"rho: {rho} has no effect under client-level DP (Eq. 3's agreement mask is a vote over "
                              "each holder's signs, which DP does not release; the mask is 1, as rho 0 gives): "
                              "drop rho or set it to 0")

    def private_upload(self, update: ClientUpdate, job: ClientJob) -> ClientUpdate:
        """Under DP a client sends each task's vector as its own unification decodes it, x_n^t = λ_n^t·(m_n^t ⊙ τ_n)
        (what the server would reconstruct), and each head's change, as plain float vectors: the bit masks and
        rescalers depend on the data and cannot be clipped or noised, so they never leave the client."""
        wire = update.vectors[MATU_WIRE]
        heads = decode_heads(wire, {t: job.initial_heads[t] for t in job.tasks})
        vectors = {}
        for t in job.tasks:
            vectors[matu_task_vector_name(t)] = decode_task(wire, t, job.origin)
            vectors[head_name(t)] = heads[t]
        return dataclasses.replace(update, vectors=vectors)

    def private_templates(self, state, client_id, tasks) -> dict[str, TaskVector]:
        out = {}
        for t in tasks:
            out[matu_task_vector_name(t)] = state.vectors[SHARED]
            out[head_name(t)] = state.vectors[head_name(t)]
        return out

    def private_aggregate(self, state: GlobalState, updates: list[ClientUpdate]) -> GlobalState:
        """Eq. 4 as a plain mean of the holders' (clipped, noised) x_n^t, i.e. a noisy per-task sum over its count,
        then Eqs. 5-7 as post-processing. Eq. 3's agreement mask needs each holder's signs, which DP does not
        release: m̂^t = 1, as ρ = 0 gives (another ρ is refused, `check_private`)."""
        same_task, soft_masks = {}, {}
        for task, holders in updates_by_task(updates).items():
            name = matu_task_vector_name(task)
            same_task[task] = weighted_average([u.vectors[name] for u in holders], [1.0] * len(holders))
            soft_masks[task] = same_task[task].apply(torch.ones_like)
        return self._combined(state, same_task, soft_masks, updates)

    def neighbours(self, similarity: torch.Tensor, index: int) -> list[int]:
        """Z^t: the top-κ tasks by S(t, ·) among those with S > ε (t itself only if include_self)."""
        order = torch.argsort(similarity[index], descending=True, stable=True).tolist()
        eligible = [j for j in order
                    if similarity[index, j] > self.config.epsilon and (self.config.include_self or j != index)]
        return eligible[: self.config.kappa]

    def _candidates(self, state: GlobalState, same_task: dict[str, TaskVector]
                    ) -> tuple[list[str], list[TaskVector], list[TaskVector | None]]:
        """Eq. 5's candidate tasks, the vector each is compared by (v) and the one it adds in Eq. 6 (a;
        None: nothing), per `neighbours` and `vectors` (see the module docstring)."""
        if self.config.neighbours == "round":
            tasks = list(same_task)
            return tasks, [same_task[t] for t in tasks], [same_task[t] for t in tasks]
        tasks = state.tasks
        stored = self._task_vectors(state, tasks)
        if self.config.vectors == "delta":  # τ̂ is an increment: carried-forward tasks have none to add
            compared = [stored[t] + same_task[t] if t in same_task else stored[t] for t in tasks]
            added = [same_task.get(t) for t in tasks]
        else:  # τ̂ replaces τ: a carried-forward task is its stored τ in both roles
            compared = added = [same_task.get(t, stored[t]) for t in tasks]
        return tasks, compared, added

    def _cross_task(self, state: GlobalState, same_task: dict[str, TaskVector],
                    soft_masks: dict[str, TaskVector]) -> dict[str, TaskVector]:
        """Eqs. 5-7 for each task with participants this round: combine(τ̂^t, τ̃^t)."""
        tasks, compared, added = self._candidates(state, same_task)
        similarity = sign_similarity(compared)
        eligible = similarity.clone()  # a task with nothing to add (delta, carried forward) is no candidate
        eligible[:, [j for j, a in enumerate(added) if a is None]] = -1.0
        out = {}
        for task in same_task:
            i = tasks.index(task)
            zs = self.neighbours(eligible, i)
            cross = same_task[task].zeros_like()
            for j in zs:
                cross = cross + float(similarity[i, j]) * (soft_masks[task] * added[j])
            if self.config.combine == "sum" or not zs:
                out[task] = same_task[task] + cross
            elif self.config.combine == "mean":
                out[task] = 0.5 * (same_task[task] + cross)
            elif self.config.combine == "s_normalized_cross":  # t's own step whole
                out[task] = same_task[task] + (1.0 / (1.0 + sum(float(similarity[i, j]) for j in zs))) * cross
            else:  # s_normalized: a similarity-weighted mean in which t weighs S(t, t) = 1
                out[task] = (1.0 / (1.0 + sum(float(similarity[i, j]) for j in zs))) * (same_task[task] + cross)
        return out
