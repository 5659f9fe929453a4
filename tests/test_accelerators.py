"""Where a run computes: the device setting, mixed precision, quantized bases, and the in-process engine
over the ranks of a multi-process launch (torchrun, gloo-free: the launcher's store)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from hf_fedtask.config import RunConfig
from hf_fedtask.core.secagg import SecAggClient
from hf_fedtask.engine.messages import SECAGG_PUBLIC_KEY, SECAGG_REVEAL, Instruction
from hf_fedtask.engine.ranks import ClientSecrets, RankTransport, balance
from hf_fedtask.engine.run import run
from hf_fedtask.errors import ConfigError
from hf_fedtask.model.device import autocast, check_mixed_precision, resolve_device
from hf_fedtask.strategies import QUERY, TRAIN

REPO = Path(__file__).resolve().parents[1]


def _config(tiny_bert_dir, tiny_tasks_dir, out, **overrides) -> RunConfig:
    settings = dict(suite=None, tasks=list(tiny_tasks_dir), base_model=tiny_bert_dir,
                    base_model_id="hf-fedtask-tests/tiny-bert", num_clients=4, rounds=2, participation=0.5,
                    batch_size=8, local_steps=2, learning_rate=1e-2, max_length=16, min_samples=4,
                    output_dir=str(out), export=False)
    return RunConfig(**{**settings, **overrides})


def _tensors(run_dir) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(run_dir) / "checkpoint.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _digest(run_dir) -> str:
    h = hashlib.sha256()
    for k, t in sorted(_tensors(run_dir).items()):
        h.update(k.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- the device -----------------------------------------------------------------------------------
# The checkpoints of these runs as the release before `--device` existed (fb5bac1) wrote them (same tiny
# model, tasks and settings, torch 2.13 CPU), by the CPU kernels torch dispatches to: float results differ
# between an AVX512 and an AVX2 machine, and between vendors with the same ISA (oneDNN/MKL take other paths
# on AMD than on Intel), so each is compared with that release run on the same kind, keyed by (capability,
# vendor): an AVX512 Intel Xeon, an AVX2 AMD EPYC and an AVX512 AMD EPYC, where fb5bac1 gave these. A CPU
# run stays bit for bit what it was.
BEFORE_DEVICES = {("AVX512", "GenuineIntel"): {"fedavg": "b30bda2ac972e60b", "scaffold": "97050fcdea5ad90c"},
                  ("AVX2", "AuthenticAMD"): {"fedavg": "77ad98296ab757b1", "scaffold": "e99817377371af9b"},
                  ("AVX512", "AuthenticAMD"): {"fedavg": "57b8958703f15b24", "scaffold": "7597ee9071a44faa"}}


def _cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_a_cpu_run_is_bit_for_bit_the_release_before_devices(strategy, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    kind = (torch.backends.cpu.get_cpu_capability(), _cpu_vendor())
    if kind not in BEFORE_DEVICES:
        pytest.skip(f"no checkpoint of the release before devices recorded for {kind[0]} CPU kernels on a "
                    f"{kind[1]} CPU (recorded: {', '.join(f'{c} {v}' for c, v in BEFORE_DEVICES)})")
    extra = {"optimizer": "sgd"} if strategy == "scaffold" else {}
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", strategy=strategy, device="cpu", **extra)
    run(config)
    assert _digest(tmp_path / "run") == BEFORE_DEVICES[kind][strategy]


def test_device_values_are_checked_in_one_line(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    with pytest.raises(ConfigError, match="device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        _config(tiny_bert_dir, tiny_tasks_dir, tmp_path, device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")  # Accelerate's choice on a machine without a GPU
        for spec in ("cuda", "cuda:1"):
            with pytest.raises(ConfigError, match="torch sees no CUDA device"):
                resolve_device(spec)


def test_cli_refuses_a_missing_gpu_with_exit_2_and_nothing_written(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hf_fedtask.cli", "run", "--suite", "", "--tasks", *tiny_tasks_dir,
                           "--base-model", tiny_bert_dir, "--device", "cuda:0", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("use --device cpu or auto")
    assert not out.exists() or not any(p.name != ".hf_fedtask.lock" for p in out.iterdir())


# -- mixed precision ------------------------------------------------------------------------------
def test_bf16_trains_in_autocast_and_keeps_fp32_state(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    fp32 = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "fp32")
    run(fp32)
    run(dataclasses.replace(fp32, output_dir=str(tmp_path / "bf16"), mixed_precision="bf16"))
    a, b = _tensors(tmp_path / "fp32"), _tensors(tmp_path / "bf16")
    assert a.keys() == b.keys()
    assert all(t.dtype == torch.float32 for t in b.values() if t.is_floating_point())
    trained = [k for k in a if a[k].is_floating_point() and a[k].numel() > 1]
    assert any(not torch.equal(a[k], b[k]) for k in trained)  # the forward really ran in bf16
    # ... and trained the same model to within bf16's precision (Adam's normalized steps amplify the
    # rounding of tiny gradients in single entries, so the whole state is compared)
    diff = torch.cat([(a[k] - b[k]).flatten() for k in trained]).norm()
    assert diff <= 0.05 * torch.cat([a[k].flatten() for k in trained]).norm()


def test_the_runs_setting_wins_over_accelerate_launch_environment(tiny_bert_dir, tiny_tasks_dir, tmp_path, monkeypatch):
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "plain", rounds=1)
    run(config)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision bf16` sets
    run(dataclasses.replace(config, output_dir=str(tmp_path / "env")))
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "env")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_takes_the_launchers_precision_as_its_default(monkeypatch):
    import argparse

    from hf_fedtask.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert config_from_args(parser.parse_args([])).mixed_precision == "bf16"
    assert config_from_args(parser.parse_args(["--mixed-precision", "no"])).mixed_precision == "no"


def test_precisions_the_device_cannot_run_are_refused(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        check_mixed_precision("fp16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="mixed_precision: must be one of no, bf16, fp16"):
        _config(tiny_bert_dir, tiny_tasks_dir, tmp_path, mixed_precision="fp8")
    with pytest.raises(ConfigError, match="strategy 'ntkfedavg' trains a linearized model"):
        run(_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "ntk", strategy="ntkfedavg", mixed_precision="bf16"))
    assert not (tmp_path / "ntk" / "run_config.yaml").exists()
    with autocast(torch.device("cpu"), "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "no"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


# -- quantized bases ------------------------------------------------------------------------------
def test_quantized_bases_are_refused_where_they_cannot_run(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    import importlib.util

    with pytest.raises(ConfigError, match="exclude each other"):
        _config(tiny_bert_dir, tiny_tasks_dir, tmp_path, load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ConfigError, match="load_in_8bit: a quantized base trains LoRA modules only"):
        run(_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "ia3", peft_method="ia3", load_in_8bit=True))
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "q", load_in_4bit=True, device="cpu")
    missing = ("needs the bitsandbytes package" if importlib.util.find_spec("bitsandbytes") is None
               else "runs on a CUDA device")
    with pytest.raises(ConfigError, match=f"load_in_4bit: .*{missing}"):
        run(config)
    assert not (tmp_path / "q" / "run_config.yaml").exists()
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type: 'fp4' has no effect without load_in_4bit"):
        _config(tiny_bert_dir, tiny_tasks_dir, tmp_path, bnb_4bit_quant_type="fp4")
    with pytest.raises(ConfigError, match="bnb_4bit_use_double_quant: False has no effect without load_in_4bit"):
        _config(tiny_bert_dir, tiny_tasks_dir, tmp_path, bnb_4bit_use_double_quant=False)


def test_the_4bit_data_type_reaches_bitsandbytes_config(monkeypatch):
    """QLoRA's NF4 with double quantization by default; FP4 without it (BitsAndBytesConfig's own defaults) on
    request. Built, not loaded: on a machine with bitsandbytes and a CUDA device the config is what transformers
    receives (device/gpu_check.py loads a 4-bit base there)."""
    import importlib.util

    from transformers import BitsAndBytesConfig

    from hf_fedtask.model import quantization

    monkeypatch.setattr(quantization.importlib.util, "find_spec",
                        lambda name: object() if name == "bitsandbytes" else importlib.util.find_spec(name))
    cuda = torch.device("cuda")
    qlora = quantization.quantization_config(True, False, peft_method="lora", device=cuda)
    assert (qlora.bnb_4bit_quant_type, qlora.bnb_4bit_use_double_quant) == ("nf4", True)
    plain = quantization.quantization_config(True, False, peft_method="lora", device=cuda, quant_type="fp4",
                                             double_quant=False)
    default = BitsAndBytesConfig(load_in_4bit=True)  # FlowerTune's templates
    assert (plain.bnb_4bit_quant_type, plain.bnb_4bit_use_double_quant) == (
        default.bnb_4bit_quant_type, default.bnb_4bit_use_double_quant) == ("fp4", False)


# -- clients over the ranks of a launch -------------------------------------------------------------
def test_balance_shares_items_by_size_and_keeps_their_order():
    assert balance({"a": 5, "b": 1, "c": 4, "d": 1}, 2) == [["a", "d"], ["b", "c"]]
    assert balance({0: 3}, 3) == [[0], [], []]
    shares = balance({i: (i * 7) % 5 + 1 for i in range(11)}, 3)
    assert sorted(i for s in shares for i in s) == list(range(11)) and all(s == sorted(s) for s in shares)


_LAUNCHED = """
import json, os, sys
import torch
torch.set_num_threads(1)
from hf_fedtask.config import RunConfig
from hf_fedtask.engine.run import run
from hf_fedtask.errors import FedTaskError
config = RunConfig.from_dict(json.loads(sys.argv[1]))


def say(line):  # one write per line: the ranks share the pipe, and print's pieces interleave between them
    os.write(1, (line + "\\n").encode())


try:
    results = run(config, overwrite=len(sys.argv) > 2)
except FedTaskError as e:
    from hf_fedtask.model.device import launch
    say(f"rank {launch().rank} error: {e}")
    sys.exit(2)
from accelerate import PartialState
say(f"mean {results['mean_metric']} processes {results['processes']}")
say(f"trainers {PartialState().distributed_type}")  # the state the last Trainer built
"""


def _torchrun(tmp_path, config: RunConfig, *extra: str, processes: int = 2, prelude: str = "",
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`config` run by `processes` ranks of torchrun; `prelude`: code each rank runs first."""
    import json

    script = tmp_path / "launched.py"
    script.write_text(textwrap.dedent(prelude) + textwrap.dedent(_LAUNCHED))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(processes), str(script), json.dumps(config.to_dict()), *extra],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("strategy", ["scaffold", "fedper"])  # client stores on rank 0; evaluation on the clients
def test_two_processes_equal_one_process_tensor_for_tensor(strategy, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    extra = {"optimizer": "sgd"} if strategy == "scaffold" else {}
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "one", strategy=strategy, participation=1.0, **extra)
    run(config)
    launched = dataclasses.replace(config, output_dir=str(tmp_path / "two"))
    proc = _torchrun(tmp_path, launched)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("processes 2") == 2  # every rank returns rank 0's results
    assert proc.stdout.count("trainers DistributedType.NO") == 2  # each rank's Trainers: single-process loops
    a, b = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one = [line for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [line for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda line: {k: v for k, v in __import__("json").loads(line).items() if k != "seconds"}  # noqa: E731
    assert [strip(x) for x in one] == [strip(x) for x in two]


# rank 0 (the server) writes down each public key it registers: round, client, key
_RECORD_KEYS = """
import os
from hf_fedtask.engine.secure import SecureAggregation

_register = SecureAggregation.register


def register(self, client_id, reply):
    _register(self, client_id, reply)
    with open(os.environ["KEYS_FILE"], "a") as f:
        f.write(f"{self.round} {client_id} {self.server.public_keys[client_id]}\\n")


SecureAggregation.register = register
"""


def test_secure_aggregation_over_ranks_uses_secrets_from_the_os_and_equals_one_process(tiny_bert_dir,
                                                                                       tiny_tasks_dir, tmp_path):
    """Each rank draws its clients' secure-aggregation secrets from the OS and keeps them for the run: no
    public key the server registers is the one the public run seed derives; the masks cancel in the sum,
    so the run equals the single-process run (whose secrets derive from the seed) tensor for tensor."""
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "one", strategy="fedyolo",
                     strategy_options={"secure_aggregation": True}, participation=1.0)
    run(config)
    keys = tmp_path / "keys.txt"
    proc = _torchrun(tmp_path, dataclasses.replace(config, output_dir=str(tmp_path / "two")), prelude=_RECORD_KEYS,
                     env={"KEYS_FILE": str(keys)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    a, b = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    registered = {(int(r), int(c)): int(k) for r, c, k in (line.split() for line in keys.read_text().splitlines())}
    assert sorted(registered) == [(r, c) for r in (1, 2) for c in range(4)]
    seeded = {c: SecAggClient(c, seed=config.seed).public_key for c in range(4)}
    assert all(key != seeded[c] for (_, c), key in registered.items())
    assert len({registered[1, c] for c in range(4)}) == 4  # a secret per client
    # kept for the run: all four clients sampled again, on the same ranks, with the same secrets
    assert all(registered[1, c] == registered[2, c] for c in range(4))


def test_each_client_gets_its_own_secret_kept_by_its_rank():
    hosted, other = ClientSecrets(), ClientSecrets()
    assert hosted[3] is hosted[3] and len(hosted[3]) == 32
    assert len({hosted[0], hosted[1], hosted[3], other[3]}) == 4


def test_a_clients_masked_upload_and_reveal_go_to_the_rank_that_answered_its_key_query():
    """The reveal of one survivor alone would be balanced onto rank 0; it goes where its secret is."""
    transport = RankTransport.__new__(RankTransport)  # the share logic only: no launch, no store
    transport.env = SimpleNamespace(partition={c: {"t": [0] * (10 - c)} for c in range(4)})
    transport.here, transport._secagg_homes = SimpleNamespace(world_size=2), {}
    keys = [Instruction(QUERY, 1, c, b"", {"query": SECAGG_PUBLIC_KEY}) for c in range(4)]
    shares = transport._shares(keys)
    assert shares == [[0, 3], [1, 2]]
    masked = [Instruction(TRAIN, 1, c, b"", {"secagg_peers": {}}) for c in (2, 3)]
    assert transport._shares(masked) == [[1], [0]]  # balanced, client 2 would go to rank 0
    reveal = Instruction(QUERY, 1, 1, b"", {"query": SECAGG_REVEAL, "dropped": [0], "peers": {}})
    assert transport._shares([reveal]) == [[], [0]]
    assert transport._shares([Instruction(QUERY, 2, 1, b"", {"query": SECAGG_REVEAL})]) == [[0], []]  # next round


def test_a_launch_of_one_process_is_a_plain_run(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """torchrun sets LOCAL_RANK even for one process, which makes Accelerate, and so every Trainer, enter
    a gloo DDP mode (slower, for nothing): the run hides it, its Trainers stay plain, and it equals a
    plain run."""
    config = _config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "plain")
    run(config)
    proc = _torchrun(tmp_path, dataclasses.replace(config, output_dir=str(tmp_path / "one")), processes=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "trainers DistributedType.NO" in proc.stdout
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "one")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_refused_run_ends_every_rank_with_its_line(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's")
    proc = _torchrun(tmp_path, _config(tiny_bert_dir, tiny_tasks_dir, out))
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if " error: " in line]
    # rank 0 says why; rank 1 has read the same line by then (rank 0 waits for that), though the launcher
    # may end it before it prints once rank 0 has exited with an error: no rank hangs
    assert any(line.startswith("rank 0 error: ") for line in lines), proc.stdout + proc.stderr[-2000:]
    assert lines and all("holds no hf_fedtask run" in line for line in lines), proc.stdout + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_flower_simulation_client_resources_reach_flower_as_numbers():
    """`--federation-config client-resources-num-gpus=0.25` gives each simulated client a quarter GPU:
    Flower's SimulationConfig takes it only as a number."""
    from flwr.common.config import parse_config_args
    from flwr.supercore.utils import simulation_config_from_json

    from hf_fedtask.cli import _typed
    from hf_fedtask.engine.flower.launch import _toml_value

    given = {"num-supernodes": "4", "client-resources-num-gpus": "0.25", "client-resources-num-cpus": "2"}
    args = [f"{k}={_toml_value(_typed(v))}" for k, v in given.items()]  # what `flwr run --federation-config` gets
    parsed = {k.replace("-", "_"): v for k, v in parse_config_args(args).items()}  # as flwr run parses it
    config = simulation_config_from_json(parsed)
    assert config.client_resources_num_gpus == pytest.approx(0.25)
    assert config.client_resources_num_cpus == 2 and config.num_supernodes == 4


def test_resources_are_reported_with_rounded_seconds():
    from hf_fedtask.workflows.recipe import resource_report

    assert resource_report(359.97).startswith("wall time: 6 min 00.0 s; peak RSS: ")
    assert resource_report(502.94).startswith("wall time: 8 min 22.9 s; ")
    assert ("peak GPU memory" in resource_report(1.0)) == (torch.cuda.is_available() and torch.cuda.is_initialized())
