"""The client half of every engine: a client built from the run's environment and its id alone,
answering train / query / evaluate instructions with safetensors bytes.

The in-process engine calls it directly; a Flower ClientApp calls it inside a SuperNode with the
client's private store kept in the node's state. A train update passes through the upload steps
(`upload_steps`: client-level DP, then secure aggregation's masking) here, on the client, so the server only
ever holds clipped (and, under secure aggregation, masked) uploads. Whatever the engine, the instruction's round
sets the round's local-training recipe (`LocalTrainer.at_round`: `lr_round_schedule`) here.
"""

from __future__ import annotations

import json

from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.core.secagg import SecAggClient
from hf_fedtask.core.state import ClientStore
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata
from hf_fedtask.core.wire import ClientUpdate, unpack_vectors
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.messages import SECAGG_PEERS, SECAGG_PUBLIC_KEY, SECAGG_REVEAL, Instruction
from hf_fedtask.engine.secure import MaskingStep
from hf_fedtask.errors import ProtocolError
from hf_fedtask.privacy.settings import dp_requested
from hf_fedtask.privacy.upload import PrivacyStep
from hf_fedtask.strategies import EVALUATE, QUERY, TRAIN, ClientJob


class ClientRuntime:
    """Client `client_id` of the run in `env`. `secagg_secret`: the seed of its Diffie-Hellman secret
    for secure aggregation (the in-process simulator uses the run seed so runs repeat exactly; a
    Flower client keeps a random one in its node state)."""

    def __init__(self, env: Environment, client_id: int, secagg_secret: int | bytes | str | None = None):
        self.env = env
        self.client_id = client_id
        self.secagg_secret = env.config.seed if secagg_secret is None else secagg_secret

    def handle(self, ins: Instruction, store: ClientStore) -> bytes:
        """The reply to `ins`; `store` (the client's private tensors) is updated in place."""
        if ins.client_id != self.client_id:
            raise ProtocolError(f"client {self.client_id} received an instruction for client {ins.client_id}")
        query = ins.config.get("query", "")
        if ins.kind == QUERY and query == SECAGG_PUBLIC_KEY:
            return self._metadata_reply(ins, public_key=str(self._secagg().public_key))
        if ins.kind == QUERY and query == SECAGG_REVEAL:
            peers = {int(c): int(k) for c, k in ins.config["peers"].items()}
            seeds = self._secagg().reveal_pair_seeds(ins.config["dropped"], ins.round, peers=peers)
            return self._metadata_reply(ins, seeds=json.dumps({str(c): s.hex() for c, s in seeds.items()}))
        env, strategy = self.env, self.env.strategy
        downlink, job = self._job(ins, store)
        if ins.kind == TRAIN:
            with env.trainer.at_round(ins.round, env.config.rounds) as trainer:
                update = strategy.client_update(downlink, job, trainer)
            return self.upload(ins, job, update)
        if ins.kind == QUERY:
            with env.trainer.at_round(ins.round, env.config.rounds) as trainer:
                return strategy.client_query(downlink, job, trainer).to_bytes(**env.header())
        if ins.kind == EVALUATE:
            metrics = {task: self._evaluate(strategy.client_task_parameters(downlink, job, task), task)
                       for task in ins.config["tasks"]}
            return ClientUpdate(self.client_id, ins.round, {}, job.num_samples(), metrics).to_bytes(**env.header())
        raise ProtocolError(f"unknown message kind {ins.kind!r}")

    def _job(self, ins: Instruction, store: ClientStore) -> tuple[dict[str, TaskVector], ClientJob]:
        """The downlink `ins` carries and this client's job for it."""
        env = self.env
        downlink = unpack_vectors(TaskVector.from_bytes(ins.payload, source=f"downlink to client {self.client_id}"))
        return downlink, ClientJob(client_id=self.client_id, round=ins.round, data=env.client_data(self.client_id),
                                   seed=env.config.local_training_seed, origin=env.origin,
                                   initial_heads=env.initial_heads, store=store, query=ins.config.get("query", ""))

    def upload(self, ins: Instruction, job: ClientJob, update: ClientUpdate) -> bytes:
        """The reply bytes of a train update, after the upload steps."""
        for step in self.upload_steps(ins):
            update = step(update, ins, job)
        return update.to_bytes(**self.env.header())

    def _evaluate(self, params: TaskVector, task: str) -> dict:
        t = self.env.task_by_name[task]
        return evaluate(self.env.host, self.env.task_view(params, task), self.env.test_data(task), t.metric,
                        self.env.config.eval_batch_size)

    def upload_steps(self, ins: Instruction) -> list:
        """What is applied to a train update after `client_update`, in order, as Flower's client mods follow a
        ClientApp: client-level DP (clipped and, in the clients mode, noised: `PrivacyStep`) when the run asks
        for it, then masking (`MaskingStep`) when the instruction carries the secure-aggregation peers."""
        config, steps = self.env.config, []
        if dp_requested(config):
            steps.append(PrivacyStep(self.env.strategy, config.dp_clip, config.dp_noise_seed))
        if SECAGG_PEERS in ins.config:
            steps.append(MaskingStep(self._secagg()))
        return steps

    def _secagg(self) -> SecAggClient:
        return SecAggClient(self.client_id, seed=self.secagg_secret)

    def _metadata_reply(self, ins: Instruction, **fields: str) -> bytes:
        meta = make_metadata(**self.env.header(), kind="delta", task_ids=[], client_id=self.client_id,
                             round=ins.round, **fields)
        return TaskVector({}).to_bytes(metadata=meta)


def train_replies(runtimes: list[ClientRuntime], instructions: list[Instruction],
                  stores: list[ClientStore]) -> dict[int, bytes]:
    """The replies of several clients of this process to their TRAIN instructions, through the strategy's
    `client_updates` (which may train them together); each reply as `ClientRuntime.handle` would give it."""
    for runtime, ins in zip(runtimes, instructions):
        if ins.client_id != runtime.client_id or ins.kind != TRAIN:
            raise ProtocolError(f"client {runtime.client_id} received a {ins.kind} instruction for client "
                                f"{ins.client_id} among a round's train instructions")
        if ins.round != instructions[0].round:
            raise ProtocolError(f"client {ins.client_id} received an instruction of round {ins.round} among round "
                                f"{instructions[0].round}'s train instructions")
    env = runtimes[0].env
    downlinks, jobs = zip(*(rt._job(ins, store) for rt, ins, store in zip(runtimes, instructions, stores)))
    with env.trainer.at_round(instructions[0].round, env.config.rounds) as trainer:
        updates = env.strategy.client_updates(list(downlinks), list(jobs), trainer)
    return {ins.client_id: rt.upload(ins, job, update)
            for rt, ins, job, update in zip(runtimes, instructions, jobs, updates)}
