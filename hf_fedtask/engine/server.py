"""The server half of every engine: one round of the shared loop.

    sample clients -> downlink bytes -> transport -> replies validated as untrusted uploads
    -> aggregation -> evaluate every task -> a metrics record

What samples and aggregates is chosen once per run (`hf_fedtask.engine.aggregation`): the strategy itself (a
seeded sample, `server_aggregate`) or the strategy wrapped in client-level DP (`hf_fedtask.privacy.server`: a
secret sample, re-clip and noise, `private_aggregate`, the accountant). How a round's uploads arrive is chosen
per round: parsed one by one (`_Uploads`), or masked into one sum (`hf_fedtask.engine.secure.SecureRound`).

Only `transport.exchange` differs between engines, so byte accounting, validation and the records
written to metrics.jsonl are the same whether clients ran in this process or in Flower SuperNodes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from hf_fedtask.client.evaluation import generation_exact_match, generation_rouge_l, predict, score
from hf_fedtask.client.trainer import LocalTrainingArgs
from hf_fedtask.core.files import write_atomic
from hf_fedtask.core.progress import progress_bar
from hf_fedtask.core.state import GlobalState
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import pack_vectors
from hf_fedtask.data.backdoor import METRIC as BACKDOOR_METRIC
from hf_fedtask.data.backdoor import success_rate
from hf_fedtask.engine.aggregation import choose
from hf_fedtask.engine.budget import CommBudget, round_estimate, wire_size
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.engine.secure import SecureRound
from hf_fedtask.engine.transport import Transport
from hf_fedtask.engine.trust import STOP, accept_evaluation, accept_update
from hf_fedtask.errors import ConfigError, FedTaskError, SecAggError, UntrustedUpload
from hf_fedtask.privacy.settings import PrivacySettings, resolve_privacy
from hf_fedtask.strategies import EVALUATE, QUERY, TRAIN
from hf_fedtask.strategies.base import aggregation_diagnostics

logger = logging.getLogger(__name__)


class Server:
    """The per-run server side: sampling, the round, evaluation. `payload_dir`: keep every round's
    wire bytes there (audits)."""

    def __init__(self, env: Environment, payload_dir: Path | None = None):
        self.env = env
        self.strategy = env.strategy
        self.config = env.config
        self.payload_dir = payload_dir
        self._privacy: tuple[PrivacySettings | None] | None = None  # resolved once (σ may be calibrated)
        self._aggregation = None
        budget = self.config.comm_budget_mb  # `hf_fedtask.engine.budget`: FlowerTune's count, as a limit
        self.budget = CommBudget(budget) if budget is not None else None

    @property
    def num_clients(self) -> int:
        return self.env.num_clients

    @property
    def clients_per_round(self) -> int:
        return max(1, int(np.ceil(self.config.participation * self.num_clients - 1e-9)))

    def sample_clients(self, round_: int) -> list[int]:
        """Participation ξ: ⌈ξ·N⌉ of the eligible clients, without replacement: a seeded sample, a function of
        (seed, round) only, or under client-level DP a secret one (`hf_fedtask.privacy.sampling`)."""
        excluded = set(self.config.exclude_clients)
        eligible = [c for c in range(self.num_clients) if c not in excluded]
        return self.aggregation.sample(eligible, min(self.clients_per_round, len(eligible)), round_)

    @property
    def aggregation(self):
        """What samples and aggregates the rounds (`hf_fedtask.engine.aggregation`): the strategy itself, or
        wrapped in client-level DP (`hf_fedtask.privacy.server.PrivateAggregation`) when the run asks for it."""
        if self._aggregation is None:
            self._aggregation = choose(self.strategy, self.config.seed, self.privacy)
        return self._aggregation

    def start(self, state: GlobalState, history: list[dict] = ()) -> None:
        """What the state a run continues from (and the rounds it ran, `history`) decides before anything is
        written: under DP the σ of the remaining rounds, or a refusal when their privacy cannot be accounted;
        with a communication budget, a refusal when the remaining rounds would pass it."""
        self.aggregation.start(state)
        if self.budget is not None:
            excluded = set(self.config.exclude_clients)
            eligible = [c for c in range(self.num_clients) if c not in excluded]
            self.budget.start(list(history), self.config.rounds - state.round,
                              round_estimate(self.strategy, state, eligible, min(self.clients_per_round,
                                                                                 len(eligible))))

    @property
    def privacy(self) -> PrivacySettings | None:
        """The run's client-level DP (`dp_*` options) resolved, σ calibrated where a target ε is given; None
        when off. The accountant's population and sample are `sample_clients`' (the eligible clients, and
        how many of them each round draws)."""
        if self._privacy is None:
            excluded = set(self.config.exclude_clients)
            population = len([c for c in range(self.num_clients) if c not in excluded])
            self._privacy = (resolve_privacy(self.config, self.strategy, population,
                                             min(self.clients_per_round, population)),)
        return self._privacy[0]

    def check(self) -> None:
        """What can be refused before anything is written: names, the model and its PEFT config, the
        tasks' inputs against the model's, the partition, the initial state, unsupported settings."""
        env = self.env
        if self.strategy.capabilities.classifier_only:
            env.host  # noqa: B018  (a strategy that needs a classifier refuses a causal LM before its settings)
        self.strategy.check_run(self.config)
        self.privacy  # noqa: B018  (DP options a strategy cannot honour, or bad ones, fail here)
        for t in env.tasks:
            if t.modality != env.host.inputs.modality:
                raise ConfigError(f"task {t.name!r} has {t.modality} inputs but base model {env.host.base.model_id} "
                                  f"takes {env.host.inputs.modality}")
            if t.free_text and not env.host.causal_lm:
                raise ConfigError(f"task {t.name!r} answers in free text, which a causal LM writes; base model "
                                  f"{env.host.base.model_id} is a classifier")
            if env.host.causal_lm:
                env.host.inputs.check_room(t)
        if self.config.generation_eval and not env.host.causal_lm:
            raise ConfigError(f"generation_eval: base model {env.host.base.model_id} is a classifier; greedy answers "
                              "are scored for a causal LM only")
        if self.config.mixed_precision != "no" and self.strategy.capabilities.linearized:
            raise ConfigError(f"mixed_precision {self.config.mixed_precision}: strategy {self.strategy.name!r} "
                              "trains a linearized model through forward-mode AD (torch.func.jvp), which autocast "
                              "does not run; use --mixed-precision no")
        env.partition  # noqa: B018  (too few samples per client fails here)
        env.initial  # noqa: B018  (a strategy that cannot lay out its state fails here)
        if self.strategy.capabilities.secure_aggregation and self.clients_per_round < 2:
            raise ConfigError(f"secure_aggregation needs at least 2 clients per round, this run samples "
                              f"{self.clients_per_round}: raise participation or num_clients")
        if self.config.backdoor_client >= 0 and self.strategy.capabilities.client_evaluation:
            raise ConfigError(f"backdoor_client: strategy {self.strategy.name!r} evaluates on its clients, where the "
                              "backdoor success rate is not measured; use a strategy evaluated on the server")
        names = {t.name for t in self.env.tasks}
        unknown = [t for t in self.forgotten_tasks if t not in names]
        if unknown:
            raise ConfigError(f"forget_tasks: unknown task {unknown[0]!r}; the run's tasks are {', '.join(names)}")
        outside = [c for c in self.forgotten_clients if c >= self.num_clients]
        if outside:
            raise ConfigError(f"forget_clients: client {outside[0]} is outside this run's {self.num_clients} clients")

    @property
    def forgotten_tasks(self) -> list[str]:
        return (self.strategy.config.forget_tasks or []) if self.strategy.capabilities.federated_unlearning else []

    @property
    def forgotten_clients(self) -> list[int]:
        return (self.strategy.config.forget_clients or []) if self.strategy.capabilities.federated_unlearning else []

    # -- one round ------------------------------------------------------------------------------------
    def round(self, state: GlobalState, round_: int, transport: Transport,
              evaluate: bool = True) -> tuple[GlobalState, dict]:
        """One round; `evaluate=False` skips the test splits (the record then has no `eval`)."""
        start = time.perf_counter()
        strategy, header, allocation = self.strategy, self.env.header(), state.allocation
        state = strategy.server_step(state, self.env)
        clients = self.sample_clients(round_)
        kind = strategy.message_kind(state)
        config = {"query": strategy.query_name(state)} if kind == QUERY else {}
        # the round's aggregation (the strategy's, or wrapped in client-level DP) and how its uploads arrive
        # (parsed one by one, or masked into a secure-aggregation sum)
        aggregation = self.aggregation.open(state, round_, trains=kind == TRAIN)
        receipt = (SecureRound(lambda c: aggregation.templates(c, allocation[c]), round_, header, transport,
                               self._admit)
                   if kind == TRAIN and strategy.capabilities.secure_aggregation
                   else _Uploads(self, aggregation, round_, allocation))
        clients = receipt.admit(clients)
        config.update(receipt.config)
        config.update(aggregation.configure(clients))
        sent = {c: pack_vectors(strategy.downlink(state, c, allocation[c])).to_bytes() for c in clients}
        if self.budget is not None:  # a round that would pass the budget is not started
            secure = kind == TRAIN and strategy.capabilities.secure_aggregation
            estimate = self.budget.before_round(round_, sent, {
                c: wire_size(aggregation.templates(c, allocation[c]), integer=secure, tasks=len(allocation[c]))
                for c in clients})
        replies = transport.exchange([Instruction(kind, round_, c, sent[c], config) for c in clients])
        # this exchange's failures, before later exchanges of the round (evaluation) overwrite them
        failed = {c: transport.failures.get(c, "no reply") for c in clients if c not in replies}
        traffic = {}
        for c in [c for c in clients if c in replies]:
            # the paper's communication cost T x M x P counts parameters: P = numel of what is sent (a refused
            # reply's bytes count, its parameters do not)
            traffic[c] = {"uplink": len(replies[c]), "downlink": len(sent[c]), "params_uplink": 0,
                          "params_downlink": TaskVector.from_bytes(sent[c], source="").numel()}
            self._keep_payloads(round_, c, replies[c], sent[c])
            numel = self._admit(failed, c, lambda c=c: receipt.receive(c, replies[c]))
            if numel is not None:
                traffic[c]["params_uplink"] = numel
        received = [c for c in clients if c in replies and c not in failed]
        if not received:
            raise FedTaskError(f"round {round_}: no client replied ({_failures(failed)})")
        updates, summed_from = receipt.finish()
        state = aggregation.aggregate(updates, summed_from)
        evals = self.evaluate(state, transport) if evaluate else None
        record = self._record(round_, kind, received, failed, updates, evals, traffic, start, state)
        if self.budget is not None:
            record["comm_budget"] = self.budget.spend(record, estimate)
        return state, aggregation.publish(record)

    def sample_counts(self, client: int, tasks: list[str], private: bool = False) -> dict[str, int]:
        """The sample count per task `client`'s replies must report: its partition's sizes, which the server
        knows (the seeded partitioner runs on both sides), or 1 per task under DP (uniform weights)."""
        return {t: 1 if private else len(self.env.partition[client][t]) for t in tasks}

    def _admit(self, refused: dict[int, str], client: int, accept):
        """`accept()`'s value, or None where the reply fails the trust boundary: the client is then left out
        of the round (`refused` records why) under `bad_uploads: drop`, or the run stops under `stop`."""
        try:
            return accept()
        except (UntrustedUpload, SecAggError) as e:
            if self.config.bad_uploads == STOP:
                raise
            logger.warning("%s; client %d is left out of this round (bad_uploads: drop)", e, client)
            refused[client] = f"refused: {e}"
            return None

    def _keep_payloads(self, round_: int, client: int, uplink: bytes, downlink: bytes) -> None:
        if self.payload_dir is None:
            return
        folder = self.payload_dir / f"round_{round_}"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / f"client_{client}.uplink.safetensors", uplink)
        write_atomic(folder / f"client_{client}.downlink.safetensors", downlink)

    def _record(self, round_, kind, received, failed, updates, evals, traffic, start, state=None) -> dict:
        """The round's metrics record; `aggregation`: what the strategy's aggregation measured (its returned
        `AggregatedState`'s diagnostics, e.g. FedAvg's `lora_factor_error`), where it measured anything."""
        losses = [v for u in updates for k, v in u.metrics.items() if k.endswith("train_loss")]
        forget = self.forgotten_tasks
        aggregation = aggregation_diagnostics(state) if state is not None else {}
        record = {
            "round": round_,
            **({"kind": kind} if kind != TRAIN else {}),
            "clients": received,
            **({"failed_clients": {str(c): why for c, why in failed.items()}} if failed else {}),
            "train_loss": float(np.mean(losses)) if losses else None,
            # the rate the clients' local training started the round at (`lr_round_schedule`), as they compute it
            **({"learning_rate": self.learning_rate(round_)} if kind == TRAIN else {}),
            **(self._scores(evals) if evals is not None else {}),
            **({"forgotten_tasks": forget} if forget else {}),
            **({"forgotten_clients": self.forgotten_clients} if self.forgotten_clients else {}),
            **({"aggregation": aggregation} if aggregation else {}),
            "bytes_uplink": sum(t["uplink"] for t in traffic.values()),
            "bytes_downlink": sum(t["downlink"] for t in traffic.values()),
            "bytes_per_client": {str(c): t for c, t in traffic.items()},
            "params_uplink": sum(t["params_uplink"] for t in traffic.values()),
            "params_downlink": sum(t["params_downlink"] for t in traffic.values()),
            "seconds": round(time.perf_counter() - start, 3),
        }
        return record

    def learning_rate(self, round_: int) -> float:
        """The clients' learning rate in round `round_` (`LocalTrainingArgs.for_round`, as they train)."""
        return LocalTrainingArgs.from_run(self.config).for_round(round_, self.config.rounds).learning_rate

    def _scores(self, evals: dict[str, dict]) -> dict:
        """The evaluation part of a round record."""
        tasks = self.env.tasks
        return {"eval": evals, "mean_metric": float(np.mean([evals[t.name][t.metric] for t in tasks])),
                **nonlinear_mean(evals, tasks), **forgetting_metrics(evals, tasks, self.forgotten_tasks)}

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, state: GlobalState, transport: Transport | None = None,
                 stores: dict | None = None) -> dict[str, dict]:
        """Each task's metric. For linearized strategies it is the linearized model's, and the
        ordinary model at the same parameters is reported as `<metric>_nonlinear`. Strategies with
        client evaluation (personal layers) are evaluated by the task's holders through `transport`."""
        if self.strategy.capabilities.client_evaluation:
            if transport is None:
                raise ConfigError(f"strategy {self.strategy.name!r} evaluates on its clients: give a transport")
            return self._evaluate_on_clients(state, transport)
        names = [t.name for t in self.env.tasks]
        if transport is not None and stores is None:  # e.g. the tasks shared over a launch's ranks
            return transport.evaluate(self, state, names)
        return self.evaluate_tasks(state, names, stores)

    def evaluate_tasks(self, state: GlobalState, names: list[str], stores: dict | None = None) -> dict[str, dict]:
        """`evaluate` of the server-evaluated tasks `names` (in that order), with one delayed progress bar over
        every example it scores (`hf_fedtask.core.progress`: shown once it lasts, gone when done)."""
        env, linearized = self.env, self.strategy.capabilities.linearized
        backdoor = [t for t in env.backdoor_tasks if t in names]
        total = (self._test_examples(names) * (2 if linearized else 1)
                 + sum(len(env.backdoor_test_data(t)) for t in backdoor))
        out = {}
        with progress_bar(desc=f"round {state.round} evaluate", total=total, unit="ex", leave=False) as bar:
            for name in names:
                t = env.task_by_name[name]
                bar.set_postfix_str(t.name, refresh=False)
                out[t.name] = score(self.predict(state, t.name, env.test_data(t.name), stores, progress=bar),
                                    env.test_data(t.name), t.metric)
                if linearized:
                    preds = self.predict(state, t.name, env.test_data(t.name), stores, nonlinear=True, progress=bar)
                    out[t.name][f"{t.metric}_nonlinear"] = score(preds, env.test_data(t.name), t.metric)[t.metric]
            for task in backdoor:
                bar.set_postfix_str(f"{task} (backdoor)", refresh=False)
                preds = self.predict(state, task, env.backdoor_test_data(task), stores, progress=bar)
                out[task][BACKDOOR_METRIC] = success_rate(preds, self.config.backdoor_target)
        return out

    def evaluate_compact(self, state: GlobalState) -> dict[str, float]:
        """Each task's metric as the strategy's compact export gives it (`compact_task_parameters`:
        e.g. MaTU's all-task unification), for strategies that export one; {} otherwise."""
        if "compact" not in self.strategy.capabilities.exports:
            return {}
        host, batch, view, tasks = self.env.host, self.config.eval_batch_size, self.env.task_view, self.env.tasks
        with progress_bar(desc="evaluate the compact export", total=self._test_examples([t.name for t in tasks]),
                          unit="ex", leave=False) as bar:
            return {t.name: score(predict(host, view(self.strategy.compact_task_parameters(state, t.name), t.name),
                                          self.env.test_data(t.name), batch, progress=bar),
                                  self.env.test_data(t.name), t.metric)[t.metric]
                    for t in tasks}

    def evaluate_generation(self, state: GlobalState, stores: dict | None = None) -> dict[str, dict[str, float]]:
        """Each task's score of greedy generation (`generation_eval`, a causal LM only): what a stock
        text-generation pipeline answers, where the task's metric scores choices or teacher-forced tokens.
        `{task: {"exact_match": v}}` against a task's label words, `{task: {"rougeL": v}}` against a free-text
        task's reference responses."""
        host, tasks, batch = self.env.host, self.env.tasks, self.config.eval_batch_size
        out = {}
        with progress_bar(desc="generation eval", total=self._test_examples([t.name for t in tasks]), unit="ex",
                          leave=False) as bar:
            for t in tasks:
                params = self.env.task_view(self.strategy.task_parameters(state, t.name, stores), t.name)
                data = self.env.test_data(t.name)
                if t.free_text:
                    references = t.dataset["test"][t.label_column]  # the prepared split's rows, in its order
                    out[t.name] = {"rougeL": generation_rouge_l(host, params, data, references, batch, progress=bar)}
                else:
                    out[t.name] = {"exact_match": generation_exact_match(host, params, data, t.label_names, batch,
                                                                         progress=bar)}
        return out

    def _test_examples(self, names: list[str]) -> int:
        """How many test examples tasks `names` have: a progress bar's total, counted on the raw splits so that
        preparing them (tokenizing) happens under the bar."""
        return sum(len(self.env.task_by_name[n].dataset["test"]) for n in names)

    def predict(self, state: GlobalState, task: str, data, stores: dict | None = None, *,
                nonlinear: bool = False, progress=None) -> np.ndarray:
        """The federated model's predictions for `task` on prepared `data`: the strategy's own model
        (e.g. TCT's stage 2), the linearized model of linearized strategies (or, `nonlinear`, the
        ordinary model at the same parameters), or the host model carrying the task's parameters
        (its own rows of a shared head, `Environment.task_view`). `progress`: a bar advanced by the
        examples scored."""
        strategy, host, batch = self.strategy, self.env.host, self.config.eval_batch_size
        preds = None if nonlinear else strategy.predict(state, task, host, data, batch)
        if preds is not None:
            if progress is not None:  # the strategy's own model scored them, without a bar
                progress.update(len(data))
            return preds
        params = self.env.task_view(strategy.task_parameters(state, task, stores), task)
        if nonlinear or not strategy.capabilities.linearized:
            return predict(host, params, data, batch, progress=progress)
        point = strategy.linearization_point(state, task)  # None: a phase without one (the ordinary model)
        return predict(host, params, data, batch,
                       linearize_at=None if point is None else self.env.task_view(point, task),
                       linearization=strategy.linearization, progress=progress)

    def _evaluate_on_clients(self, state: GlobalState, transport: Transport) -> dict[str, dict]:
        """Every holder evaluates its own model of each of its tasks on the task's test split; a task's
        metric is the mean over its holders (`clients`: how many)."""
        allocation, header = state.allocation, self.env.header()
        instructions = [Instruction(EVALUATE, state.round, c,
                                    pack_vectors(self.strategy.downlink(state, c, tasks)).to_bytes(),
                                    {"tasks": tasks}) for c, tasks in sorted(allocation.items())]
        replies = transport.exchange(instructions)
        per_task: dict[str, list[dict]] = {t.name: [] for t in self.env.tasks}
        refused: dict[int, str] = {}
        for c, reply in sorted(replies.items()):
            metrics = self._admit(refused, c, lambda c=c, reply=reply: accept_evaluation(
                reply, sender=c, round_=state.round, header=header, counts=self.sample_counts(c, allocation[c]),
                metrics={task: self.env.task_by_name[task].metric for task in allocation[c]}))
            for task in allocation[c] if metrics is not None else ():
                per_task[task].append(metrics[task])
        out = {}
        for t in self.env.tasks:
            values = [m[t.metric] for m in per_task[t.name]]
            if not values:
                holders = {c: refused.get(c) or transport.failures.get(c, "no reply")
                           for c, tasks in sorted(allocation.items()) if t.name in tasks}
                raise FedTaskError(f"evaluation of {t.name!r}: none of its holders replied ({_failures(holders)})")
            out[t.name] = {t.metric: float(np.mean(values)), "num_examples": per_task[t.name][0]["num_examples"],
                           "clients": len(values)}
            if t.free_text and all("answer_loss" in m for m in per_task[t.name]):  # reported beside the metric
                out[t.name]["answer_loss"] = float(np.mean([m["answer_loss"] for m in per_task[t.name]]))
        return out


class _Uploads:
    """A round's uploads received one by one: each parsed at the trust boundary (`hf_fedtask.engine.trust`) into a
    `ClientUpdate` of the layout `aggregation` expects from its client, with the sample counts the server knows
    (1 per task held where the aggregation weighs every upload the same)."""

    config: dict = {}

    def __init__(self, server: Server, aggregation, round_: int, allocation: dict[int, list[str]]):
        self.server, self.aggregation, self.round, self.allocation = server, aggregation, round_, allocation
        self.updates = []

    def admit(self, clients: list[int]) -> list[int]:
        return clients

    def receive(self, c: int, reply: bytes) -> int:
        """The upload of client `c`, checked and kept; its number of elements."""
        tasks = self.allocation[c]
        update = accept_update(reply, sender=c, round_=self.round, templates=self.aggregation.templates(c, tasks),
                               header=self.server.env.header(),
                               counts=self.server.sample_counts(c, tasks, self.aggregation.uniform_counts))
        self.updates.append(update)
        return sum(tv.numel() for tv in update.vectors.values())

    def finish(self) -> tuple[list, None]:
        return self.updates, None


def _failures(failed: dict[int, str]) -> str:
    return "; ".join(f"client {c}: {why}" for c, why in sorted(failed.items())) or "no reason given"


def forgetting_metrics(evals: dict[str, dict], tasks, forget: list[str]) -> dict:
    """While unlearning: each forgotten task's metric and the mean over the retained tasks."""
    if not forget:
        return {}
    retained = [evals[t.name][t.metric] for t in tasks if t.name not in forget]
    return {"forgotten": {t.name: evals[t.name][t.metric] for t in tasks if t.name in forget},
            "retained_mean": float(np.mean(retained)) if retained else None}


def nonlinear_mean(evals: dict[str, dict], tasks) -> dict:
    """`mean_metric_nonlinear` when the evaluation reports the ordinary model beside a linearized one."""
    values = [evals[t.name].get(f"{t.metric}_nonlinear") for t in tasks]
    return {"mean_metric_nonlinear": float(np.mean(values))} if values and None not in values else {}
