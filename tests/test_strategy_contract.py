"""The contract every registered strategy keeps (a common tester over `STRATEGIES`, like peft's over its
TEST_CASES): uploads match `update_templates`, `server_aggregate` leaves its inputs alone and steps the
round by one, checkpoints round-trip, unknown options are refused, a killed run resumes to the
uninterrupted result, and the declared `capabilities` are what the run folder holds; on the tiny BERT
classifier and, for the module-sharing strategies, on a tiny causal LM answering instructions.

A new strategy gets these tests by registering; one finished 2-round run (and one killed-and-resumed
twin) per variant is shared by the variant's tests. Tiny BERT, tiny tasks, 2 of 4 clients per round."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import Crash, crash_after
from safetensors import safe_open
from safetensors.torch import load_file

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from hf_fedtask.core.fields import field_type
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import restore
from hf_fedtask.errors import ConfigError
from hf_fedtask.strategies import (
    QUERY,
    STRATEGIES,
    Capabilities,
    ClientJob,
    GlobalState,
    Strategy,
    build_strategy,
    build_strategy_config,
    hooks_declared,
)

EXPORT_DIRS = {"adapters": "adapters", "compact": "compact", "multi_adapter": "multi_adapter",
               "linearized": "linearized", "tct": "tct"}

# (id, strategy, strategy options, RunConfig overrides): every registered strategy with its defaults,
# plus variants whose code paths differ (several tasks per client, shared half + secure sums,
# linearized at the pretrained point, a causal LM)
# (options, run settings) a strategy requires (it refuses the defaults): SCAFFOLD corrects SGD steps;
# TCT needs every client every round, and here goes straight to its query and stage-2 rounds
# F²L² trains one task with every client every round: round 1 pretrains and trains, round 2 collects gradients
# (a callable override maps the default setting)
REQUIRED = {"scaffold": ({}, {"optimizer": "sgd"}),
            "tct": ({"stage1_rounds": 0, "num_features": 64, "stage2_steps": 5}, {"participation": 1.0}),
            "f2l2": ({"pretrain_epochs": 1.0, "server_fraction": 0.2},
                     {"participation": 1.0, "tasks": lambda tasks: tasks[:1]})}
LLM = {"base_model": "hf-fedtask/tiny-llama", "base_model_id": None, "max_length": 128}
VARIANTS = [(name, name, *REQUIRED.get(name, ({}, {}))) for name in sorted(STRATEGIES)] + [
    ("matu-zeta", "matu", {}, {"zeta": 0.5}),
    ("fedyolo-half", "fedyolo", {"share": "half"}, {}),
    ("fedyolo-half-secure", "fedyolo", {"share": "half", "secure_aggregation": True}, {}),
    ("ntkfedavg-pretrained", "ntkfedavg", {"linearize_at": "pretrained"}, {}),
    # F²L²'s federated CG: query rounds only (its first, the clients' gradients at w⁰ and curvature factors, which
    # precondition the later rounds and stay in the state, then the gradient round)
    ("f2l2-cg", "f2l2", {**REQUIRED["f2l2"][0], "linear_solver": "cg", "l2": 0.01, "curvature_rank": 4},
     {**REQUIRED["f2l2"][1], "local_steps": -1, "learning_rate": 5e-3}),
    # on a causal LM answering instructions (no heads: every trainable parameter is a shared module)
    *[(f"{name}-llm", strategy, options, {**overrides, **LLM}) for name, strategy, options, overrides in [
        ("fedavg-product", "fedavg", {"lora_aggregation": "product"}, {}),
        ("matu-zeta", "matu", {}, {"zeta": 0.5}),
        ("fedyolo", "fedyolo", {}, {}),
        ("scaffold", "scaffold", {}, {"optimizer": "sgd"}),
        ("ntkfedavg", "ntkfedavg", {}, {}),
    ]],
]


def _config(tiny_bert_dir, tiny_tasks_dir, output_dir, strategy, options, overrides) -> RunConfig:
    settings = dict(suite=None, tasks=list(tiny_tasks_dir), base_model=tiny_bert_dir,
                    base_model_id="hf-fedtask-tests/tiny-bert", num_clients=4, rounds=2, participation=0.5,
                    batch_size=8, local_steps=1, learning_rate=1e-2, max_length=16, min_samples=4,
                    output_dir=str(output_dir))
    overrides = {k: v(settings[k]) if callable(v) else v for k, v in overrides.items()}
    return RunConfig(strategy=strategy, strategy_options=dict(options), **{**settings, **overrides})


@dataclasses.dataclass
class Runs:
    config: RunConfig
    straight: Path  # 2 rounds uninterrupted
    resumed: Path  # killed after round 1, then resumed
    round1: Path  # a copy of the killed run's checkpoint after round 1


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def runs(request, tiny_bert_dir, tiny_tasks_dir, tmp_path_factory) -> Runs:
    variant, strategy, options, overrides = request.param
    base = tmp_path_factory.mktemp(f"contract-{variant}")
    config = _config(tiny_bert_dir, tiny_tasks_dir, base / "straight", strategy, options, overrides)
    run(config)
    killed = dataclasses.replace(config, output_dir=str(base / "resumed"))
    with pytest.raises(Crash):
        run(killed, callbacks=[crash_after(1)])
    (base / "round1").mkdir()
    shutil.copy(base / "resumed" / CHECKPOINT_FILE, base / "round1" / CHECKPOINT_FILE)
    run(killed, resume=True)
    return Runs(config, base / "straight", base / "resumed", base / "round1")


@dataclasses.dataclass
class HandRound:
    fed: Federation
    initial: GlobalState
    state: GlobalState  # after round 1 (from the killed run's checkpoint)
    stores: dict
    clients: list[int]
    templates: dict[int, dict]
    updates: dict[int, ClientUpdate]  # as client_update returned them
    parsed: dict[int, ClientUpdate]  # through the wire, validated against the templates

    @property
    def secure(self) -> bool:
        return self.fed.strategy.capabilities.secure_aggregation

    def aggregate_inputs(self) -> list[ClientUpdate]:
        """What the engine hands `server_aggregate`: the uploads, or with secure aggregation their sum."""
        ups = [self.parsed[c] for c in self.clients]
        if not self.secure:
            return ups
        total = {name: sum((u.vectors[name] for u in ups[1:]), ups[0].vectors[name]) for name in ups[0].vectors}
        return [ClientUpdate(-1, ups[0].round, total, {})]


@pytest.fixture(scope="module")
def hand_round(runs) -> HandRound:
    """Round 2 by hand from the round-1 checkpoint: the server's step, then each sampled client's
    `client_update`, sent over the wire."""
    fed = Federation(runs.config)
    strategy, header = fed.strategy, fed.header()
    initial = fed.initial_state()
    state, _, stores = restore(fed.env, runs.round1, runs.config.fingerprint())
    state = strategy.server_step(state, fed.env)  # as the engine's round begins (F²L²'s gradient round factors H_s)
    allocation = state.allocation
    clients = fed.server.sample_clients(2)
    templates, updates, parsed = {}, {}, {}
    for c in clients:
        sent = pack_vectors(strategy.downlink(state, c, allocation[c])).to_bytes()
        downlink = unpack_vectors(TaskVector.from_bytes(sent, source=f"downlink to client {c}"))
        query = strategy.query_name(state) if strategy.message_kind(state) == QUERY else ""
        job = ClientJob(client_id=c, round=2, data=fed.client_data(c), seed=runs.config.seed, origin=fed.origin,
                        initial_heads=fed.initial_heads, store=stores.setdefault(c, {}), query=query)
        answer = strategy.client_query if query else strategy.client_update
        updates[c] = answer(downlink, job, fed.trainer)
        templates[c] = strategy.update_templates(state, c, allocation[c])
        parsed[c] = ClientUpdate.from_bytes(updates[c].to_bytes(**header), templates=templates[c], expect=header,
                                            source=f"client {c} (round 2)")
    return HandRound(fed, initial, state, stores, clients, templates, updates, parsed)


def _final_state(runs: Runs, fed: Federation):
    return restore(fed.env, runs.straight, runs.config.fingerprint())


def _snapshot_vectors(vectors: dict) -> dict:
    return {name: {k: t.clone() for k, t in tv.items()} for name, tv in vectors.items()}


def _assert_vectors_equal(got: dict, expected: dict, exact: bool = True, ordered: bool = True):
    order = list if ordered else sorted
    assert order(got) == order(expected)
    for name, tv in expected.items():
        assert order(got[name]) == order(tv), name
        for k, t in tv.items():
            if exact:
                assert got[name][k].dtype == t.dtype and torch.equal(got[name][k], t), f"{name}::{k}"
            else:
                torch.testing.assert_close(got[name][k], t, rtol=1e-4, atol=1e-6, msg=f"{name}::{k}")


def _layout(vectors: dict) -> dict:
    return {name: [(k, tuple(t.shape), t.dtype) for k, t in tv.items()] for name, tv in vectors.items()}


# -- 1. uploads ------------------------------------------------------------------------------------

def test_every_upload_matches_update_templates(runs, hand_round):
    """Each sampled client's `client_update` has the names, keys, shapes and dtypes of its
    `update_templates`, survives the wire validated against them, and reports its own tasks."""
    h = hand_round
    allocation = h.state.allocation
    if runs.config.participation < 1:
        assert len(h.clients) == 2 < len(allocation)  # partial participation
    if runs.config.zeta > 0:
        assert any(len(allocation[c]) > 1 for c in h.clients), allocation  # several tasks per client
    for c in h.clients:
        update, parsed = h.updates[c], h.parsed[c]
        assert _layout(update.vectors) == _layout(h.templates[c]), f"client {c}"
        assert (parsed.client_id, parsed.round) == (c, 2)
        assert parsed.num_samples == update.num_samples and sorted(parsed.num_samples) == sorted(allocation[c])
        _assert_vectors_equal(parsed.vectors, update.vectors)
    if h.secure:  # what gets masked: one slot layout for every client, whatever tasks it holds
        layouts = [_layout(h.templates[c]) for c in h.clients]
        assert all(layout == layouts[0] for layout in layouts)
        record = json.loads((runs.straight / "metrics.jsonl").read_text().splitlines()[1])  # round 2
        numel = sum(tv.numel() for tv in h.templates[h.clients[0]].values())
        assert record["params_uplink"] == numel * len(record["clients"])


# -- 2. / 3. the server step -----------------------------------------------------------------------

def test_server_aggregate_leaves_its_inputs_unchanged_and_equals_the_engine_round(runs, hand_round):
    """`server_aggregate` mutates neither the state nor the updates (dict keys, tensors, scalars), and
    the hand-driven round gives the engine's round-2 state."""
    h = hand_round
    inputs = h.aggregate_inputs()
    state_vectors, scalars = _snapshot_vectors(h.state.vectors), copy.deepcopy(h.state.scalars)
    before = [(u.client_id, u.round, _snapshot_vectors(u.vectors), dict(u.num_samples), dict(u.metrics))
              for u in inputs]
    new = h.fed.strategy.server_aggregate(h.state, inputs)
    _assert_vectors_equal(h.state.vectors, state_vectors)
    assert h.state.scalars == scalars and h.state.round == 1
    for u, (cid, round_, vectors, samples, metrics) in zip(inputs, before):
        assert (u.client_id, u.round, u.num_samples, u.metrics) == (cid, round_, samples, metrics)
        _assert_vectors_equal(u.vectors, vectors)
    final, _, _ = _final_state(runs, h.fed)
    # the secure engine sums fixed-point encoded uploads: equal up to the encoding's resolution
    _assert_vectors_equal(new.vectors, final.vectors, exact=not h.secure)


def test_a_round_steps_the_round_by_one_and_keeps_the_allocation(hand_round):
    """The new state is round + 1, keeps the allocation scalar, and has the layout `state_template` gives
    for its scalars (the layout checkpoints are validated against)."""
    h = hand_round
    new = h.fed.strategy.server_aggregate(h.state, h.aggregate_inputs())
    assert new.round == h.state.round + 1 == 2
    assert new.scalars["allocation"] == h.state.scalars["allocation"]
    assert new.allocation == h.fed.allocation
    assert _layout(new.vectors) == _layout(h.fed.strategy.state_template(h.initial, new.scalars).vectors)


# -- 4. checkpoints --------------------------------------------------------------------------------

def test_checkpoint_round_trips_mid_run(runs, hand_round, tmp_path):
    """save_checkpoint then load_checkpoint with the strategy's `state_template` gives back the state
    (vectors in order, scalars, round), the history (timings included) and the clients' stores."""
    h = hand_round
    fed, strategy = h.fed, h.fed.strategy
    new = strategy.server_aggregate(h.state, h.aggregate_inputs())
    logged = [json.loads(line) for line in (runs.straight / "metrics.jsonl").read_text().splitlines()]
    assert all("seconds" in r for r in logged)
    for i, (state, history) in enumerate(((h.state, logged[:1]), (new, logged))):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        stores = {c: s for c, s in h.stores.items() if s}
        save_checkpoint(folder, state, history=history, fingerprint=runs.config.fingerprint(), stores=stores,
                        **fed.header())
        got, got_history, got_stores = load_checkpoint(
            folder, fingerprint=runs.config.fingerprint(), template=lambda s: strategy.state_template(h.initial, s))
        assert got.round == state.round and got.scalars == state.scalars
        _assert_vectors_equal(got.vectors, state.vectors)
        assert got_history == history and len(history) == state.round
        assert sorted(got_stores) == sorted(stores)
        for c, store in stores.items():  # stores have no template: they come back in sorted key order
            _assert_vectors_equal(got_stores[c], store, ordered=False)


# -- 5. options ------------------------------------------------------------------------------------

COMPANIONS = {"lora_ranks": {"lora_aggregation": "product"}, "downlink_feedback": {"downlink": "per_task_int8"}}
"""Options valid only beside another option's non-default value (mixed LoRA ranks need the product step; error
feedback needs a quantized downlink)."""


def _valid_value(config_class, name: str):
    """A value of option `name` that `config_class` accepts (beside its COMPANIONS) and that differs from its
    default."""
    f = next(f for f in dataclasses.fields(config_class) if f.name == name)
    kind, is_list, _ = field_type(config_class, name)
    default = getattr(config_class(), name)
    if f.metadata.get("choices"):
        candidates = [c for c in f.metadata["choices"] if c != default]
    elif kind is bool:
        candidates = [not default]
    elif is_list:
        candidates = [[1] if kind is int else ["colors"] if kind is str else [0.5]]
    elif kind is int:
        candidates = [(default or 0) + 1, (default or 0) + 2]
    elif kind is float:
        candidates = [0.5 * default if default else 0.5, (default or 0.0) + 0.5]
    else:
        candidates = ["x"]
    for value in candidates:
        try:
            config_class(**{name: value, **COMPANIONS.get(name, {})})
        except ConfigError:
            continue
        return value
    raise AssertionError(f"no valid non-default value found for {config_class.__name__}.{name}")


def _foreign_options(name: str) -> list[tuple[str, str]]:
    """(owner, option) for every option of another strategy's config that `name`'s config lacks."""
    own = {f.name for f in dataclasses.fields(STRATEGIES[name].config_class)}
    out = {}
    for owner in sorted(STRATEGIES):
        for f in dataclasses.fields(STRATEGIES[owner].config_class):
            if f.name not in own:
                out.setdefault(f.name, owner)
    return sorted((owner, opt) for opt, owner in out.items())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_options_of_other_strategies_are_refused_and_own_options_accepted(name, tiny_tasks_dir):
    """Every option any other registered strategy has and this one lacks is a ConfigError naming the
    option (nested or flat); each own option is accepted at a non-default valid value."""
    foreign = _foreign_options(name)
    assert foreign, f"{name} has every option of every strategy: nothing is probed"
    for owner, opt in foreign:
        value = _valid_value(STRATEGIES[owner].config_class, opt)
        assert getattr(build_strategy_config(owner, {opt: value, **COMPANIONS.get(opt, {})}), opt) == value
        with pytest.raises(ConfigError, match=re.escape(repr(opt))):
            RunConfig(strategy=name, strategy_options={opt: value}, suite=None, tasks=list(tiny_tasks_dir))
        with pytest.raises(ConfigError, match=re.escape(repr(opt))):
            RunConfig.from_dict({"strategy": name, "suite": None, "tasks": list(tiny_tasks_dir), opt: value})
    for f in dataclasses.fields(STRATEGIES[name].config_class):
        value = _valid_value(STRATEGIES[name].config_class, f.name)
        config = RunConfig(strategy=name, strategy_options={f.name: value, **COMPANIONS.get(f.name, {})},
                           suite=None, tasks=list(tiny_tasks_dir))
        assert getattr(config.strategy_config, f.name) == value


# -- 6. resume -------------------------------------------------------------------------------------

def test_resume_after_a_kill_equals_the_uninterrupted_run(runs):
    """Killed after round 1 and resumed: every checkpoint tensor and header field (wall-clock timings
    apart), every metrics record (its `seconds` apart) and every exported adapter equal the straight run's."""
    a, b = load_file(runs.straight / CHECKPOINT_FILE), load_file(runs.resumed / CHECKPOINT_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    headers = []
    for folder in (runs.straight, runs.resumed):
        with safe_open(str(folder / CHECKPOINT_FILE), "pt") as f:
            headers.append({k: v for k, v in f.metadata().items() if k != "timings"})
    assert headers[0] == headers[1] and json.loads(headers[0]["round"]) == 2

    def records(folder):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    assert records(runs.straight) == records(runs.resumed) and [r["round"] for r in records(runs.straight)] == [1, 2]
    for adapter in sorted((runs.straight / "adapters").glob("*/adapter_model.safetensors")):
        x, y = load_file(adapter), load_file(runs.resumed / adapter.relative_to(runs.straight))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), adapter


# -- 7. capabilities -------------------------------------------------------------------------------

def test_declared_capabilities_are_what_the_run_shows(runs):
    """`capabilities` is a Capabilities; the declared exports (and only those) are in the run folder; the
    evaluation records show client evaluation and linearization exactly when they are declared."""
    strategy = STRATEGIES[runs.config.strategy](runs.config.strategy_config)
    caps = strategy.capabilities
    assert isinstance(caps, Capabilities)
    assert "adapters" in caps.exports and set(caps.exports) <= set(EXPORT_DIRS), caps.exports
    for export, folder in EXPORT_DIRS.items():
        assert (runs.straight / folder).is_dir() == (export in caps.exports), export
    tasks = [Path(p).name for p in runs.config.tasks]
    assert sorted(p.name for p in (runs.straight / "adapters").iterdir()) == sorted(tasks)
    for line in (runs.straight / "metrics.jsonl").read_text().splitlines():
        for task, entry in json.loads(line)["eval"].items():
            assert ("clients" in entry) == caps.client_evaluation, task
            assert ("accuracy_nonlinear" in entry) == caps.linearized, task


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_declared_capabilities_are_the_hooks_implemented(name):
    """A strategy derives from a hook class (`Linearized`, `CompactExport`, `Packaging`, `ClientRemoval`)
    exactly when its capabilities declare what the hook serves, so engines and exporters can read the
    declaration and call the hook; evaluation on the clients comes with `client_task_parameters`. Read
    on the class, `capabilities` are those of the default options, and equal a default instance's."""
    cls = STRATEGIES[name]
    strategy = cls(cls.config_class())
    caps = strategy.capabilities
    assert isinstance(caps, Capabilities) and cls.capabilities == caps
    for hook, declared in hooks_declared(caps).items():
        assert isinstance(strategy, hook) == declared, f"{name}: declares {hook.__name__}: {declared}"
    evaluates_on_clients = cls.client_task_parameters is not Strategy.client_task_parameters
    assert evaluates_on_clients == caps.client_evaluation
    for probed in ("uses_secure_aggregation", "linearization_point", "compact_form", "package", "remove_client"):
        assert not hasattr(Strategy, probed), probed  # optional hooks live on their hook classes only


def test_capabilities_follow_the_options_that_decide_them():
    """FedYolo's secure aggregation is an option: its instance's capabilities say whether it is on."""
    on, off = (build_strategy("fedyolo", {"secure_aggregation": flag}) for flag in (True, False))
    assert on.capabilities.secure_aggregation and not off.capabilities.secure_aggregation
    assert on.capabilities.exports == off.capabilities.exports == STRATEGIES["fedyolo"].capabilities.exports
    assert not STRATEGIES["fedyolo"].capabilities.secure_aggregation  # the class: the default options
