"""The Flower engine: the real ServerApp and ClientApp, driven through the in-process Grid of
`hf_fedtask.engine.flower.local` (default suite, no Ray, no sockets) and through real SuperLink and
SuperNode processes (`-m slow`), must give the in-process engine's run: the same final checkpoint
tensor for tensor and the same bytes on the wire every round."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import tomllib
import torch

pytest.importorskip("flwr")

from conftest import TINY_MODEL_ID

from hf_fedtask.config import RunConfig
from hf_fedtask.core.checkpoint import CHECKPOINT_FILE, CLIENT_PREFIX
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.flower import app as flower_app
from hf_fedtask.engine.flower import handler as flower_handler
from hf_fedtask.engine.flower.launch import launch
from hf_fedtask.engine.flower.local import InProcessGrid, local_grid_engine, run_server_app
from hf_fedtask.engine.flower.manifest import manifest
from hf_fedtask.engine.flower.node import SECAGG_SECRET, SECRETS
from hf_fedtask.engine.flower.settings import AppSettings
from hf_fedtask.engine.run import run
from hf_fedtask.engine.run_folder import METRICS_FILE, PAYLOADS_DIR
from hf_fedtask.errors import ConfigError, FedTaskError

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "flower-app"


# -- the in-process Grid (hf_fedtask.engine.flower.local) ---------------------------------------------
def drive(config: RunConfig, num_nodes: int | None = None, **grid_options) -> InProcessGrid:
    """Run `config` with the real ServerApp and ClientApp over an InProcessGrid; the grid afterwards."""
    run_config = AppSettings.for_run(config, wait=0.0).to_run_config()
    grid = InProcessGrid(flower_app.client_app, run_config, num_nodes or config.num_clients, **grid_options)
    run_server_app(grid, flower_app.server_app)
    return grid


# -- comparing runs -----------------------------------------------------------------------------------
def tiny(bert: str, tasks: list[str], out: Path, strategy: str = "fedavg", options: dict | None = None,
         **overrides) -> RunConfig:
    settings = {"suite": None, "tasks": tasks, "base_model": bert, "base_model_id": TINY_MODEL_ID, "num_clients": 4,
                "rounds": 2, "batch_size": 8, "local_steps": 3, "learning_rate": 1e-2, "max_length": 16,
                "min_samples": 4, "output_dir": str(out), "save_payloads": True, "export": False}
    return RunConfig(strategy=strategy, strategy_options=options or {}, **{**settings, **overrides})


def canonical_digest(data: bytes) -> str:
    """sha256 of a safetensors blob with its header JSON re-dumped with sorted keys (the writer's
    `__metadata__` order varies from process to process) followed by its data section."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + length :]).hexdigest()


def payload_digests(run_dir: Path) -> dict[str, str]:
    folder = run_dir / PAYLOADS_DIR
    return {str(p.relative_to(folder)): canonical_digest(p.read_bytes()) for p in sorted(folder.rglob("*.safetensors"))}


def checkpoint(run_dir: Path) -> TaskVector:
    return TaskVector.load(run_dir / CHECKPOINT_FILE)


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the timings."""
    lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in lines]


def assert_same_run(reference: Path, flower: Path, stores: dict[int, dict] | None = None, *,
                    same_uplinks: bool = True) -> None:
    """Same server tensors, same metrics and bytes per round, same payloads; the in-process
    checkpoint's client stores equal to those the Flower nodes kept (`stores`)."""
    ref, got = checkpoint(reference), checkpoint(flower)
    server = [k for k in ref if not k.startswith(CLIENT_PREFIX)]
    assert server and sorted(server) == sorted(got)
    for key in server:
        assert ref[key].dtype == got[key].dtype and torch.equal(ref[key], got[key]), key
    if stores is not None:
        kept = {f"{CLIENT_PREFIX}{c}/{name}::{k}": t for c, store in stores.items() for name, tv in store.items()
                for k, t in tv.items()}
        assert sorted(kept) == sorted(k for k in ref if k.startswith(CLIENT_PREFIX))
        for key, tensor in kept.items():
            assert torch.equal(ref[key], tensor), key
    assert records(reference) == records(flower)
    ref_payloads, got_payloads = payload_digests(reference), payload_digests(flower)
    assert ref_payloads and sorted(ref_payloads) == sorted(got_payloads)
    differ = [name for name in ref_payloads if ref_payloads[name] != got_payloads[name]]
    if same_uplinks:
        assert differ == []
    else:  # masked uploads: each Flower node draws its own secret
        assert differ and all(name.endswith(".uplink.safetensors") for name in differ)


@pytest.fixture
def reference_run(tmp_path):
    """Run a config in process (the default engine) into tmp_path/reference; that folder."""

    def _run(config: RunConfig) -> Path:
        out = tmp_path / "reference"
        run(RunConfig.from_dict({**config.to_dict(), "output_dir": str(out)}))
        return out

    return _run


# -- default suite: the real apps over an in-process Grid ----------------------------------------------
@pytest.mark.parametrize("strategy,options,overrides", [
    ("fedavg", {}, {}),
    ("fedper", {}, {}),  # client evaluation, and a private store kept in each node's state
    ("matu", {"kappa": 1}, {"zeta": 0.5, "num_clients": 5}),
    ("fedyolo", {}, {"rounds": 1}),
    # the server's own pretraining, a linearized model, the ridge's λ_r sent down, and the clients' gradients and
    # curvature factors in a query round
    ("f2l2", {"pretrain_epochs": 1.0, "server_fraction": 0.2, "ridge": 0.1, "curvature_rank": 4}, {"one_task": True}),
    # federated conjugate gradient: its direction sent down and the clients' Hessian-vector products up (their
    # curvature factors with the first round's gradients)
    ("f2l2", {"pretrain_epochs": 1.0, "server_fraction": 0.2, "l2": 0.01, "linear_solver": "cg", "curvature_rank": 4},
     {"one_task": True, "rounds": 3, "local_steps": -1, "learning_rate": 5e-3}),
])
def test_flower_run_equals_the_in_process_run(strategy, options, overrides, tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                              reference_run):
    tasks = tiny_tasks_dir[:1] if overrides.pop("one_task", False) else tiny_tasks_dir
    config = tiny(tiny_bert_dir, tasks, tmp_path / "flower", strategy, options, **overrides)
    grid = drive(config)
    assert_same_run(reference_run(config), tmp_path / "flower", grid.stores())
    kinds = set(grid.message_types)
    assert "query.discover" in kinds and ("train" in kinds) == (options.get("linear_solver") != "cg")
    assert ("evaluate" in kinds) == (strategy == "fedper")


@pytest.mark.parametrize("strategy,options,overrides", [
    ("fedavg", {}, {}),
    ("matu", {"kappa": 1}, {"zeta": 0.5, "num_clients": 5}),
    ("fedyolo", {}, {"rounds": 1}),
])
def test_a_causal_lm_run_over_flower_equals_the_in_process_run(strategy, options, overrides, tiny_tasks_dir, tmp_path,
                                                               reference_run):
    config = tiny("hf-fedtask/tiny-llama", tiny_tasks_dir, tmp_path / "flower", strategy, options,
                  base_model_id=None, max_length=128, **overrides)
    drive(config)
    assert_same_run(reference_run(config), tmp_path / "flower")


def test_a_flower_runs_exports_equal_the_in_process_runs_by_value(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                    reference_run):
    """Every exported adapter folder: the same tensors and the same JSON (classifier/config.json, tokenizer.json,
    adapter_config.json, hf_fedtask.json) whichever engine ran (the exported configs are the base's as loaded)."""
    from safetensors.torch import load_file

    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1, export=True)
    drive(config)
    reference = reference_run(config)
    folders = sorted(p.parent.relative_to(reference) for p in reference.rglob("adapter_model.safetensors"))
    assert folders
    for folder in folders:
        ref, got = reference / folder, tmp_path / "flower" / folder
        a, b = load_file(ref / "adapter_model.safetensors"), load_file(got / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
        files = sorted(p.relative_to(ref) for p in ref.rglob("*.json"))
        assert files == sorted(p.relative_to(got) for p in got.rglob("*.json")), folder
        for name in files:
            assert json.loads((ref / name).read_text()) == json.loads((got / name).read_text()), (folder, name)


def test_run_through_the_local_grid_engine_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                     reference_run):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedper", rounds=1)
    engine = local_grid_engine()
    run(config, engine=engine)
    assert_same_run(reference_run(config), tmp_path / "flower", engine.grid.stores())
    assert engine.grid.message_types.count("query.discover") == 4


def test_secure_aggregation_over_flower_gives_the_same_sum(tiny_bert_dir, tiny_tasks_dir, tmp_path, reference_run):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedyolo", {"secure_aggregation": True},
                  rounds=1)
    grid = drive(config)
    assert_same_run(reference_run(config), tmp_path / "flower", grid.stores(), same_uplinks=False)
    secrets = [c.state.config_records[SECRETS][SECAGG_SECRET] for c in map(grid.context, grid.contexts)]
    assert len(set(secrets)) == 4 and all(len(s) == 32 for s in secrets)


class _Failing(ClientRuntime):
    failing: ClassVar[set[int]] = set()

    def handle(self, ins, store):
        if ins.kind == "train" and self.client_id in self.failing:
            raise RuntimeError(f"disk full on client {self.client_id}")
        return super().handle(ins, store)


def test_a_client_that_raises_is_reported_with_its_reason(tiny_bert_dir, tiny_tasks_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(flower_handler, "ClientRuntime", _Failing)
    monkeypatch.setattr(_Failing, "failing", {1})
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1)
    drive(config)
    (record,) = records(tmp_path / "flower")
    assert record["clients"] == [0, 2, 3]
    assert set(record["failed_clients"]) == {"1"}
    assert record["failed_clients"]["1"].startswith("Flower error 2: ")
    assert "disk full on client 1" in record["failed_clients"]["1"]


def test_a_round_no_client_answers_fails_the_run_with_the_reasons(tiny_bert_dir, tiny_tasks_dir, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr(flower_handler, "ClientRuntime", _Failing)
    monkeypatch.setattr(_Failing, "failing", {0, 1, 2, 3})
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1)
    reason = r"round 1: no client replied \(client 0: Flower error 2: .*disk full on client 0"
    with pytest.raises(FedTaskError, match=reason):
        drive(config)


def test_a_lost_reply_is_a_failure_and_the_round_goes_on(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1)
    drive(config, silent={2})
    (record,) = records(tmp_path / "flower")
    assert record["clients"] == [0, 1, 3] and record["failed_clients"] == {"2": "no reply"}


@pytest.mark.parametrize("nodes,partition_ids,message", [
    (3, None, "the federation has 3 nodes after waiting 0 s but this run has 4 clients"),
    (5, None, "the federation has 5 nodes but this run has 4 clients"),
    (4, [0, 1, 1, 3], "both hold partition-id 1"),
    (4, [0, 1, 2, 4], "holds partition-id 4, outside this run's clients 0..3"),
    (4, [0, 1, 2, "x"], "has no integer partition-id in its node config"),
])
def test_a_federation_that_does_not_hold_each_client_once_is_refused_before_anything_is_written(
        nodes, partition_ids, message, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", rounds=1)
    with pytest.raises(FedTaskError, match=message):
        drive(config, nodes, partition_ids=partition_ids)
    assert not (tmp_path / "flower").exists()


def test_the_run_config_carries_one_json_config_and_is_checked(tiny_bert_dir, tiny_tasks_dir, tmp_path, monkeypatch):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, "relative/run")
    settings = AppSettings.for_run(config, resume=True, timeout=30.0)
    back = AppSettings.from_run_config(settings.to_run_config())
    assert back == settings and back.exchange_timeout == 30.0 and AppSettings().exchange_timeout is None
    monkeypatch.chdir(tmp_path)
    assert back.run_config().output_dir == str(tmp_path / "relative" / "run")
    assert back.run_config().fingerprint() == config.fingerprint()
    assert AppSettings.from_run_config({"timeout": 5}).timeout == 5.0
    with pytest.raises(ConfigError, match="config holds no RunConfig"):
        AppSettings().run_config()
    with pytest.raises(ConfigError, match="unknown key 'rounds'"):
        AppSettings.from_run_config({"rounds": 3})
    with pytest.raises(ConfigError, match="resume must be a bool"):
        AppSettings.from_run_config({"resume": "yes"})


def test_the_app_folder_is_the_manifest_and_builds_a_fab_without_code():
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import validate_config

    on_disk = tomllib.loads((APP_DIR / "pyproject.toml").read_text())
    assert on_disk == manifest()
    assert "federations" not in on_disk["tool"]["flwr"]
    assert validate_config(on_disk, check_module=True) == (True, [], [])
    import io
    import zipfile

    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(APP_DIR))).namelist()
    assert sorted(names) == [".info/CONTENT", "pyproject.toml"]


# -- slow: real SuperLink and SuperNode processes ------------------------------------------------------
# process management (own process groups, stopped by PID) is the package's, as the benchmarks use it
from hf_fedtask.engine.flower.loopback import LoopbackFederation  # noqa: E402
from hf_fedtask.engine.flower.loopback import free_port as _free_port  # noqa: E402


@pytest.fixture
def flower_home(tmp_path, monkeypatch):
    """A temporary FLWR_HOME and the environment for Flower processes."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    monkeypatch.setenv("FLWR_HOME", str(home))
    return home, env


def _connection(home: Path, port: int) -> str:
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    return "loopback"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["bert", "llm"])
def test_loopback_deployment_equals_the_in_process_run(model, tiny_bert_dir, tiny_tasks_dir, tmp_path, reference_run):
    if model == "llm":  # a causal LM answering instructions, MaTU's masks and rescalers on the wire
        config = tiny("hf-fedtask/tiny-llama", tiny_tasks_dir, tmp_path / "flower", "matu", num_clients=3,
                      base_model_id=None, max_length=128)
    else:
        config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedper", num_clients=3)
    with LoopbackFederation(tmp_path / "federation", 3) as federation:  # SuperLink + 3 SuperNode processes
        start = time.monotonic()
        federation.launch(config, app_dir=APP_DIR, wait=120.0)
        print(f"loopback deployment run: {time.monotonic() - start:.1f} s")
    assert_same_run(reference_run(config), tmp_path / "flower")


@pytest.mark.slow
def test_ray_simulation_equals_the_in_process_run(tiny_bert_dir, tiny_tasks_dir, tmp_path, reference_run):
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", "fedavg", num_clients=3)
    with LoopbackFederation(tmp_path / "federation", 3, simulation=True) as federation:
        start = time.monotonic()
        federation.launch(config, wait=120.0)
        print(f"Ray simulation run: {time.monotonic() - start:.1f} s")
    assert_same_run(reference_run(config), tmp_path / "flower")


@pytest.mark.slow
def test_a_failed_flower_run_is_a_fedtask_error(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """`flwr run --stream` exits 0 when the ServerApp raised; the launcher reads the status instead."""
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower", num_clients=3)
    with LoopbackFederation(tmp_path / "federation", 2, num_partitions=3) as federation:  # one SuperNode short
        with pytest.raises(FedTaskError, match=r"Flower run \d+ on 'loopback' ended finished:failed \(ServerApp "
                                                r"failed with exception: the federation has 2 nodes .* 3 clients"):
            federation.launch(config, app_dir=APP_DIR, wait=5.0)
    assert not (tmp_path / "flower").exists()


@pytest.mark.slow
def test_launch_without_a_superlink_is_a_one_line_error(tiny_bert_dir, tiny_tasks_dir, tmp_path, flower_home):
    home, _ = flower_home
    config = tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "flower")
    with pytest.raises(FedTaskError, match=r"^flwr run exited with status 1: .*SuperLink is unavailable[^\n]*$"):
        launch(config, _connection(home, _free_port()), flwr_home=home, echo=None)
