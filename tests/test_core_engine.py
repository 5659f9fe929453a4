"""The engine-neutral core: pluggable local objectives, query rounds and state phases through the real
engine, clients as the unit of removal, evaluation on the clients (FedPer), export without data, and
the package's import layering. Tiny BERT and tiny tasks; no network."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import Crash, crash_after
from safetensors.torch import load_file

import hf_fedtask
from hf_fedtask.cli import main
from hf_fedtask.client.evaluation import evaluate
from hf_fedtask.client.objectives import LinearCorrection, OneHotMSE
from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import open_finished_run
from hf_fedtask.errors import ConfigError, TaskVectorError
from hf_fedtask.strategies import (
    QUERY,
    STRATEGIES,
    TRAIN,
    Capabilities,
    ClientJob,
    FedAvg,
    FedAvgConfig,
    GlobalState,
    build_strategy,
    head_name,
    register_strategy,
)
from hf_fedtask.strategies.base import SHARED
from hf_fedtask.workflows.unlearn import unlearn

PACKAGE = Path(hf_fedtask.__file__).parent


def _config(tiny_bert_dir, tiny_tasks_dir, output_dir, **overrides) -> RunConfig:
    values = dict(strategy="fedavg", suite=None, tasks=list(tiny_tasks_dir), base_model=tiny_bert_dir,
                  base_model_id="hf-fedtask-tests/tiny-bert", num_clients=4, rounds=1, batch_size=8, local_steps=1,
                  learning_rate=1e-2, max_length=16, min_samples=4, output_dir=str(output_dir))
    return RunConfig(**{**values, **overrides})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensors_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- a. objectives ---------------------------------------------------------------------------------

def _tiny_module():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = {f"m.{k}": p for k, p in module.named_parameters()}
    return module, params


def test_linear_correction_adds_c_to_every_gradient():
    """After `start(params)`, ∇(loss) = ∇(model loss) + c for each corrected parameter, and exactly the
    model gradient for the others; a correction for an unknown parameter is a KeyError."""
    module, params = _tiny_module()
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    corrected = ["m.0.weight", "m.2.bias"]
    c = {k: torch.randn_like(params[k]) for k in corrected}
    objective = LinearCorrection(c)
    objective.start(params)
    model_loss = F.cross_entropy(module(x), y)
    plain = torch.autograd.grad(model_loss, list(params.values()), retain_graph=True)
    loss = objective.loss(model_loss, None, {"labels": y})
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, _), g, g0 in zip(params.items(), grads, plain):
        expected = g0 + c[name] if name in c else g0
        torch.testing.assert_close(g, expected, rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(grads[0], plain[0])  # the correction is not vanishingly small
    unknown = LinearCorrection({"m.9.weight": torch.zeros(1)})
    unknown.start(params)
    with pytest.raises(KeyError, match="m.9.weight"):
        unknown.loss(model_loss, None, {})


@pytest.mark.parametrize("as_mapping", [True, False], ids=["dict-outputs", "logits-attribute"])
def test_one_hot_mse_replaces_the_loss_by_the_hand_formula(as_mapping):
    """OneHotMSE: Σ_classes (logits − (onehot + offset))², batch mean, + (λ/2)·‖θ‖²; the model's loss is
    ignored; outputs may be a mapping or an object with `.logits`."""
    _, params = _tiny_module()
    logits = torch.tensor([[0.2, -1.0, 0.5], [1.5, 0.0, -0.3]])
    labels = torch.tensor([2, 0])
    outputs = {"logits": logits} if as_mapping else SimpleNamespace(logits=logits)
    l2, offset = 0.3, -1 / 3
    objective = OneHotMSE(l2=l2, offset=offset)
    objective.start(params)
    targets = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]) + offset
    mse = sum(float(((logits[i] - targets[i]) ** 2).sum()) for i in range(2)) / 2
    norm = sum(float((p.detach() ** 2).sum()) for p in params.values())
    for model_loss in (torch.tensor(0.0), torch.tensor(123.0)):
        got = objective.loss(model_loss, outputs, {"labels": labels})
        assert float(got.detach()) == pytest.approx(mse + l2 / 2 * norm, rel=1e-6)
    no_l2 = OneHotMSE(offset=offset)
    no_l2.start(params)
    assert float(no_l2.loss(torch.tensor(5.0), outputs, {"labels": labels})) == pytest.approx(mse, rel=1e-6)


# -- b. query rounds and state phases ---------------------------------------------------------------

STATS = "label_stats"


@dataclass
class QueryThenTrainConfig(FedAvgConfig):
    pass


class QueryThenTrain(FedAvg):
    """Round 1 asks every client for its sample count and label sum (no training); the server stores
    their sum under a new state vector `label_stats` and switches the phase to train (FedAvg)."""

    name = "test-query-then-train"
    config_class = QueryThenTrainConfig
    capabilities = Capabilities()

    @staticmethod
    def _stats_layout() -> TaskVector:
        return TaskVector({"count": torch.zeros(1, dtype=torch.int64), "label_sum": torch.zeros(1, dtype=torch.int64)})

    @staticmethod
    def _querying(state: GlobalState) -> bool:
        return state.scalars.get("phase") == "stats"

    def init_state(self, host, tasks, seed, allocation) -> GlobalState:
        state = super().init_state(host, tasks, seed, allocation)
        state.scalars["phase"] = "stats"
        return state

    def state_template(self, initial, scalars) -> GlobalState:
        if scalars.get("phase") == "stats":
            return initial
        return GlobalState(initial.round, {**initial.vectors, STATS: self._stats_layout()}, dict(scalars))

    def message_kind(self, state):
        return QUERY if self._querying(state) else TRAIN

    def query_name(self, state):
        return STATS if self._querying(state) else ""

    def downlink(self, state, client_id, tasks):
        return {} if self._querying(state) else super().downlink(state, client_id, tasks)

    def update_templates(self, state, client_id, tasks):
        return ({STATS: self._stats_layout()} if self._querying(state)
                else super().update_templates(state, client_id, tasks))

    def client_query(self, downlink, job, trainer) -> ClientUpdate:
        if job.query != STATS or downlink:
            raise ConfigError(f"unexpected query {job.query!r} with downlink {sorted(downlink)}")
        count = sum(len(d) for d in job.data.values())
        label_sum = sum(int(sum(d["labels"])) for d in job.data.values())
        stats = TaskVector({"count": torch.tensor([count]), "label_sum": torch.tensor([label_sum])})
        return ClientUpdate(job.client_id, job.round, {STATS: stats}, job.num_samples(), {})

    def server_aggregate(self, state, updates) -> GlobalState:
        if self._querying(state):
            return state.next({STATS: sum(u.vectors[STATS] for u in updates)}, phase="train")
        return super().server_aggregate(state, updates)


@pytest.fixture
def query_strategy():
    register_strategy(QueryThenTrain)
    yield QueryThenTrain
    STRATEGIES.pop(QueryThenTrain.name, None)


def test_query_round_then_training_changes_the_layout_and_resumes_exactly(query_strategy, tiny_bert_dir,
                                                                           tiny_tasks_dir, tmp_path):
    """Round 1 is a QUERY (logged `kind: query`, no training); its aggregate is stored under a new vector
    equal to the true sums over the clients' data; rounds 2-3 train; killed after round 2 and resumed
    (validated against the phase's layout) equals the uninterrupted run."""
    straight = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "straight", strategy=query_strategy.name, rounds=3)
    run(straight)
    killed = dataclasses.replace(straight, output_dir=str(tmp_path / "killed"))
    with pytest.raises(Crash):
        run(killed, callbacks=[crash_after(2)])
    run(killed, resume=True)

    a, b = (load_file(Path(c.output_dir) / CHECKPOINT_FILE) for c in (straight, killed))
    assert _tensors_equal(a, b)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    records = _records(Path(straight.output_dir))
    assert strip(records) == strip(_records(Path(killed.output_dir)))
    assert [r.get("kind") for r in records] == ["query", None, None]
    assert records[0]["train_loss"] is None and records[1]["train_loss"] is not None
    assert records[0]["clients"] == [0, 1, 2, 3] and records[0]["params_downlink"] == 0  # a query sends nothing

    finished = open_finished_run(straight.output_dir)  # restored with the train phase's layout
    state, env = finished.state, finished.env
    assert state.round == 3 and state.scalars["phase"] == "train"
    data = [(env.partition[c][t], env.task_by_name[t].label_column) for c in range(env.num_clients)
            for t in env.allocation[c]]
    assert int(state.vectors[STATS]["count"]) == sum(len(d) for d, _ in data) == 96
    assert int(state.vectors[STATS]["label_sum"]) == sum(sum(d[col]) for d, col in data)
    assert torch.equal(a[f"{STATS}::label_sum"], state.vectors[STATS]["label_sum"])
    with pytest.raises(TaskVectorError, match=STATS):  # the layout did change: the phase-0 template refuses it
        load_checkpoint(Path(straight.output_dir), fingerprint=straight.fingerprint(), template=env.initial)


# -- c. clients as the unit of removal -------------------------------------------------------------

def _tv(*values):
    return TaskVector({"w": torch.tensor(values, dtype=torch.float32)})


def test_forget_clients_negates_exactly_that_clients_update():
    """fedavg with forget_clients=[1] aggregates as if client 1's update (shared and head) were negated,
    and only client 1's: client 0 holds the same task and is kept; the inputs are left as they were."""
    state = GlobalState(0, {SHARED: _tv(0.0, 0.0), head_name("x"): _tv(0.0), head_name("y"): _tv(0.0)},
                        {"allocation": {"0": ["x"], "1": ["x"], "2": ["y"]}})
    updates = [ClientUpdate(0, 1, {SHARED: _tv(1.0, 2.0), head_name("x"): _tv(1.0)}, {"x": 1}),
               ClientUpdate(1, 1, {SHARED: _tv(3.0, -1.0), head_name("x"): _tv(2.0)}, {"x": 2}),
               ClientUpdate(2, 1, {SHARED: _tv(0.5, 0.5), head_name("y"): _tv(4.0)}, {"y": 1})]
    forget = build_strategy("fedavg", {"forget_clients": [1]}).server_aggregate(state, updates)
    plain = build_strategy("fedavg")
    by_hand = [updates[0], ClientUpdate(1, 1, {k: -v for k, v in updates[1].vectors.items()}, {"x": 2}), updates[2]]
    expected = plain.server_aggregate(state, by_hand)
    for name in (SHARED, head_name("x"), head_name("y")):
        assert torch.equal(forget.vectors[name]["w"], expected.vectors[name]["w"]), name
    # (1·[1, 2] − 2·[3, −1] + 1·[0.5, 0.5]) / 4 and (1·1 − 2·2) / 3
    assert torch.allclose(forget.vectors[SHARED]["w"], torch.tensor([-4.5, 4.5]) / 4)
    assert torch.allclose(forget.vectors[head_name("x")]["w"], torch.tensor([-1.0]))
    assert not torch.equal(forget.vectors[SHARED]["w"], plain.server_aggregate(state, updates).vectors[SHARED]["w"])
    assert torch.equal(updates[1].vectors[SHARED]["w"], torch.tensor([3.0, -1.0]))
    with pytest.raises(ConfigError, match="forget_clients"):
        build_strategy("fedavg", {"forget_clients": [-1]})


@pytest.fixture(scope="module")
def finished_fedavg(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory) -> Path:
    """A finished 1-round FedAvg run on all 4 clients, with its payloads kept (shared by read-only tests)."""
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory.mktemp("finished") / "run", save_payloads=True)
    run(config)
    return Path(config.output_dir)


def test_unlearn_a_client_negates_its_update_in_the_continued_run(finished_fedavg, tmp_path):
    """`unlearn(run, None, 1, client=1)` continues the run one round with client 1's update negated: the
    results say so, and the new shared modules are the old plus the sample-weighted mean of the
    uploads with client 1's flipped. The finished run is left as it was."""
    before = (finished_fedavg / CHECKPOINT_FILE).read_bytes()
    out = tmp_path / "forget-1"
    results = unlearn(finished_fedavg, None, 1, client=1, output_dir=out)
    u = results["unlearning"]
    assert u["forgotten_clients"] == [1] and u["clients"] == [1] and u["tasks"] == []
    assert (u["from_round"], u["rounds"], results["rounds"]) == (2, 1, 2)
    assert _records(out)[-1]["forgotten_clients"] == [1]
    assert (finished_fedavg / CHECKPOINT_FILE).read_bytes() == before

    parent, child = open_finished_run(finished_fedavg), open_finished_run(out)
    strategy, allocation = parent.env.strategy, parent.state.allocation
    uploads = {}
    for c in allocation:
        data = (out / "payloads" / "round_2" / f"client_{c}.uplink.safetensors").read_bytes()
        uploads[c] = ClientUpdate.from_bytes(data, templates=strategy.update_templates(parent.state, c, allocation[c]),
                                             expect=parent.env.header(), source=f"client {c}")
    assert sorted(uploads) == [0, 1, 2, 3]
    total = sum(u.total_samples for u in uploads.values())
    step = sum((u.vectors[SHARED] * ((-1.0 if c == 1 else 1.0) * u.total_samples / total) for c, u in uploads.items()))
    expected = parent.state.vectors[SHARED] + step
    for k, t in expected.items():
        torch.testing.assert_close(child.state.vectors[SHARED][k], t, rtol=1e-5, atol=1e-7)


def test_unlearn_client_errors_are_one_line(finished_fedavg, tmp_path, capsys):
    """Unknown client, task and client together, and --scale without --one-shot are refused (API:
    ConfigError; CLI: exit 2 with one line on stderr) and write nothing."""
    with pytest.raises(ConfigError, match="unknown client 7"):
        unlearn(finished_fedavg, None, 1, client=7, output_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="a task or a client"):
        unlearn(finished_fedavg, "colors", 1, client=1, output_dir=tmp_path / "b")
    cases = [(["--client", "7", "--rounds", "1"], "7"),
             (["--task", "colors", "--client", "1", "--rounds", "1"], "not both"),
             (["--client", "1", "--rounds", "1", "--scale", "2"], "--scale")]
    for i, (flags, expected) in enumerate(cases):
        assert main(["unlearn", str(finished_fedavg), *flags, "--output-dir", str(tmp_path / f"cli{i}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()  # (model-loading progress bars may come first)
        errors = [line for line in err if line.startswith("hf-fedtask:")]
        assert len(errors) == 1 and errors[0] == err[-1] and expected in errors[0], err
        assert not any("Traceback" in line for line in err)
    assert not any((tmp_path / name).exists() for name in ("a", "b", "cli0", "cli1", "cli2"))


# -- d. evaluation on the clients ------------------------------------------------------------------

def test_fedper_metric_is_the_mean_over_the_holders_own_models(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                               monkeypatch):
    """Each task's logged metric is the mean over its holders of evaluating their own model
    (`client_task_parameters`: global modules, personal layers, own head) as computed by hand; the
    engine evaluated exactly those models, on each holder; `clients` counts the holders."""
    from hf_fedtask.engine.client import ClientRuntime

    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", strategy="fedper", zeta=0.5, local_steps=2)
    fed = Federation(config)
    strategy = fed.strategy
    evaluated = {}  # (client, task) -> the parameters the engine's client evaluated
    original = ClientRuntime._evaluate

    def spy(self, params, task):
        evaluated[(self.client_id, task)] = params
        return original(self, params, task)

    monkeypatch.setattr(ClientRuntime, "_evaluate", spy)
    state, record = fed.run_round(fed.initial_state(), 1)
    assert sorted(evaluated) == sorted((c, t) for c, tasks in state.allocation.items() for t in tasks)
    for task in fed.env.task_by_name.values():
        holders = state.holders(task.name)
        values, params = [], []
        for c in holders:
            job = ClientJob(client_id=c, round=state.round, data=fed.client_data(c), seed=config.seed,
                            origin=fed.origin, initial_heads=fed.initial_heads, store=fed.client_stores[c])
            params.append(strategy.client_task_parameters(strategy.downlink(state, c, state.allocation[c]), job,
                                                          task.name))
            values.append(evaluate(fed.host, params[-1], fed.test_data(task.name), task.metric,
                                   config.eval_batch_size)[task.metric])
            assert _tensors_equal(dict(evaluated[(c, task.name)]), dict(params[-1])), (c, task.name)
        entry = record["eval"][task.name]
        assert entry["clients"] == len(holders) >= 2
        assert entry[task.metric] == pytest.approx(float(np.mean(values)), abs=1e-12)
        assert (params[0] - params[1]).norm() > 0  # the holders' models are their own


# -- e. export reads no data -----------------------------------------------------------------------

def test_export_rewrites_the_adapters_without_tokenizing_or_partitioning(finished_fedavg, tmp_path, monkeypatch):
    """`export_run` on a finished run rebuilds every adapter equal to the run's own, with tokenizing and
    partitioning made to fail."""
    from hf_fedtask.workflows.export_run import export_run

    run_dir = tmp_path / "copy"
    shutil.copytree(finished_fedavg, run_dir)
    adapters = sorted((run_dir / "adapters").glob("*/adapter_model.safetensors"))
    before = {p.parent.name: load_file(p) for p in adapters}
    assert sorted(before) == ["colors", "moods"]
    shutil.rmtree(run_dir / "adapters")

    def forbidden(*args, **kwargs):
        raise AssertionError("export must not touch client data")

    monkeypatch.setattr("hf_fedtask.model.host.PeftHost.tokenize", forbidden)
    for target in ("hf_fedtask.data.build_federation", "hf_fedtask.data.partition.build_federation",
                   "hf_fedtask.engine.environment.build_federation"):
        monkeypatch.setattr(target, forbidden)
    paths = export_run(run_dir)
    assert sorted(p.name for p in paths) == ["colors", "moods"]
    for task, tensors in before.items():
        assert _tensors_equal(load_file(run_dir / "adapters" / task / "adapter_model.safetensors"), tensors), task


# -- f. import layering ----------------------------------------------------------------------------

def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every module of hf_fedtask."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _import_graph() -> dict[str, set[tuple[str, int, str]]]:
    """Module -> {(imported hf_fedtask module, line, source line)}: absolute and relative imports, at any
    depth (inside functions and `if TYPE_CHECKING:` too); `from pkg import name` counts as `pkg.name`
    when that is a module, and as the lazily loaded module for `hf_fedtask`'s lazy names."""
    modules = _modules()
    lazy = {name: f"hf_fedtask.{target}" for name, target in hf_fedtask._LAZY.items()}
    graph = {}
    for name, (path, is_package) in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = []
                for a in node.names:
                    if f"{module}.{a.name}" in modules:
                        targets.append(f"{module}.{a.name}")
                    elif module == "hf_fedtask" and a.name in lazy:
                        targets.append(lazy[a.name])
                    else:
                        targets.append(module)
            else:
                continue
            for target in targets:
                if target == "hf_fedtask" or target.startswith("hf_fedtask."):
                    edges.add((target, node.lineno, lines[node.lineno - 1].strip()))
        graph[name] = edges
    return graph


def _layer(module: str) -> str:
    return ".".join(module.split(".")[:2])


LAYERING = {  # layer -> the layers it must never import
    "hf_fedtask.model": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.client": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.data": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.merge": ("engine", "strategies", "workflows", "cli", "config"),
    "hf_fedtask.strategies": ("engine", "workflows", "cli", "config"),
    "hf_fedtask.engine": ("workflows", "cli"),
}


def test_import_graph_is_layered_and_acyclic():
    """core imports only core and errors; lower layers never import the layers above them (LAYERING);
    the graph of subpackage-level layers has no cycle."""
    graph = _import_graph()
    assert {"hf_fedtask.core.state", "hf_fedtask.engine.server", "hf_fedtask.strategies.base"} <= set(graph)
    assert any(t == "hf_fedtask.strategies" for t, _, _ in graph["hf_fedtask.engine.client"])  # the parser sees imports
    violations = []
    for module, edges in sorted(graph.items()):
        layer = _layer(module)
        for target, line, text in sorted(edges):
            if layer == "hf_fedtask.core" and _layer(target) not in ("hf_fedtask.core", "hf_fedtask.errors"):
                violations.append(f"{module}:{line}: {text}")
            if any(_layer(target) == f"hf_fedtask.{banned}" for banned in LAYERING.get(layer, ())):
                violations.append(f"{module}:{line}: {text}")
    assert not violations, "\n".join(violations)

    layers: dict[str, set[str]] = {}
    for module, edges in graph.items():
        layers.setdefault(_layer(module), set()).update(_layer(t) for t, _, _ in edges if _layer(t) != _layer(module))
    assert {"hf_fedtask.core", "hf_fedtask.engine", "hf_fedtask.strategies", "hf_fedtask.cli"} <= set(layers)
    done, stack = set(), []

    def visit(layer):
        if layer in stack:
            raise AssertionError("import cycle between layers: " + " -> ".join([*stack[stack.index(layer):], layer]))
        if layer in done:
            return
        stack.append(layer)
        for target in sorted(layers.get(layer, ())):
            visit(target)
        stack.pop()
        done.add(layer)

    for layer in sorted(layers):
        visit(layer)
