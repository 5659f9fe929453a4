"""Peak memory of simulating 100 clients versus 4 clients (ratio = peak100 / peak4, goal <= 1.2), per strategy.

What is compared: two `hf_fedtask.engine.Federation`s (in-process engine) on the real MiniLM
(`sentence-transformers/all-MiniLM-L6-v2`, offline copy) + LoRA r=8, each run for one full round
(`run_round`: sample clients, `client_update`, wire round-trip, `server_aggregate`, evaluate every
task). Config "4": 4 clients, participation 1.0. Config "100": 100 clients, participation 0.04, so
4 sampled clients train in both. Everything else is identical: the same 4 local synthetic tasks
(saved with `save_to_disk`, like tests/conftest.py) with the same total data, one task per client
(zeta=0), the same fixed number of local optimizer steps per client (`local_steps`), batch size,
sequence length and seed. Only the number of *simulated* clients (and so how the same data is
split into per-client datasets) differs, which is exactly the cost the host design claims is small.

Strategies (`--strategy`, default all three, one RATIO line each):
  fedavg  no per-client state: the growth is only the host's bookkeeping per simulated client.
  matfl   MaT-FL keeps one model (the shared PEFT modules) per client on the server (`model/<id>`).
  fedper  FedPer keeps the personal layers (the last block's PEFT modules) and the task heads in
          each client's store.
Per-client state only costs memory once it is a copy of its own: MaT-FL's `model/<id>` entries all
alias the initial modules until the client trains, and a FedPer store is filled by the client's
first round. After one round only the 4 trained clients would hold one, in both configs, and the
ratio could not see the per-client copies at all. So by default (`--per-client-copies all`) every
client is given its own copy before the measured round, as after a run long enough for each client
to have trained once (the steady state): MaT-FL's `model/<id>` are cloned, FedPer stores receive the
personal layers and heads their first round would leave (the same tensors' values, so the round
computes the same thing). `--per-client-copies trained` measures round 1 as it comes instead.
For each strategy the script reports the expected size of one client's per-client state (MiB, from
the tensors' sizes), how many clients hold a copy of their own after the round and the MiB those
copies occupy, in each config, and so the growth they explain next to the measured peak growth.

Each configuration runs in a fresh subprocess, so peaks do not mix; the child reports
`resource.getrusage(RUSAGE_SELF).ru_maxrss` (the high-water RSS). A throwaway child runs first to warm
the file cache; each configuration is repeated and the median peak is used. `--quick` is a smoke run
of the same measurement (1 local step, 8 test rows per task, 1 repeat, no warm-up). FedPer evaluates
on every holder (client-side evaluation), so its 100-client round costs 100 evaluations of a
task's test split: the longest child by far.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

GOAL = 1.2
STRATEGIES = ("fedavg", "matfl", "fedper")
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue yellow").split()


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make_tasks(out: str, num_tasks: int, train_rows: int, test_rows: int, seed: int) -> list[str]:
    """`num_tasks` synthetic classification tasks saved with save_to_disk; returns their folders."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    rng = random.Random(seed)
    paths = []
    for t in range(num_tasks):
        k = 2 + t % 3  # 2..4 classes, so heads differ in shape as in a real many-task suite
        labels = [f"c{t}_{c}" for c in range(k)]
        feats = Features({"text": Value("string"), "label": ClassLabel(names=labels)})

        def make(n):
            rows = {"text": [], "label": []}
            for i in range(n):
                c = i % k
                words = [rng.choice(WORDS) for _ in range(rng.randrange(8, 40))]
                words.insert(rng.randrange(len(words)), labels[c])
                rows["text"].append(" ".join(words))
                rows["label"].append(c)
            return Dataset.from_dict(rows, features=feats)

        path = os.path.join(out, f"task{t}")
        DatasetDict({"train": make(train_rows), "test": make(test_rows)}).save_to_disk(path)
        paths.append(path)
    return paths


def fill_per_client_state(sim, state) -> None:
    """Give every client its own copy of its per-client state, as after a run in which each has
    trained once (see the module docstring); a no-op for strategies that keep none."""
    if sim.strategy.name == "matfl":
        from hf_fedtask.strategies.matfl import model_name

        for c in state.allocation:
            state.vectors[model_name(c)] = state.vectors[model_name(c)].clone()
    elif sim.strategy.name == "fedper":
        from hf_fedtask.core.state import head_name
        from hf_fedtask.strategies.fedper import PERSONAL

        personal = set(state.scalars["personal_keys"])
        for c, tasks in state.allocation.items():
            store = sim.client_stores.setdefault(c, {})
            store[PERSONAL] = sim.origin.filter(lambda k: k in personal).clone()
            store.update({head_name(t): sim.initial_heads[t].clone() for t in tasks})


def per_client_state(sim, state) -> dict:
    """What the clients' per-client state holds: MaT-FL's server-side `model/<id>` vectors and every
    client store. `one_client_mib`: the largest client's state from its tensors' sizes (what one
    copy is expected to cost); `own_copies`: clients none of whose tensors share storage with
    another client or the global state; `distinct_mib`: the storage those own copies occupy."""
    from hf_fedtask.strategies.matfl import model_name

    tensors: dict[int, list] = {}
    if sim.strategy.name == "matfl":
        for c in state.allocation:
            tensors[c] = list(state.vectors[model_name(c)].values())
    for c, store in sim.client_stores.items():
        tensors.setdefault(c, []).extend(t for tv in store.values() for t in tv.values())
    tensors = {c: ts for c, ts in tensors.items() if ts}
    owners: dict[int, set] = {}
    nbytes: dict[int, int] = {}
    client_vectors = {model_name(c) for c in tensors}
    for name, tv in list(state.vectors.items()) + list(sim.env.initial.vectors.items()):
        if name not in client_vectors:
            for t in tv.values():
                owners.setdefault(t.untyped_storage().data_ptr(), set()).add("global")
    for c, ts in tensors.items():
        for t in ts:
            ptr = t.untyped_storage().data_ptr()
            owners.setdefault(ptr, set()).add(c)
            nbytes[ptr] = t.untyped_storage().nbytes()
    own = [c for c, ts in tensors.items() if all(owners[t.untyped_storage().data_ptr()] == {c} for t in ts)]
    own_ptrs = {t.untyped_storage().data_ptr() for c in own for t in tensors[c]}
    return {
        "clients_with_state": len(tensors),
        "one_client_mib": max((sum(t.numel() * t.element_size() for t in ts) for ts in tensors.values()),
                              default=0) / 2**20,
        "own_copies": len(own),
        "distinct_mib": sum(nbytes[p] for p in own_ptrs) / 2**20,
    }


def child(args) -> None:
    """Build a Federation, run one round, print a JSON line with the peak RSS."""
    import torch

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.inprocess import Federation

    rss_imports = maxrss_mib()
    config = RunConfig(
        strategy=args.child_strategy,
        strategy_options={},  # each strategy's defaults (MaT-FL group_size 3, FedPer personal_blocks 1)
        suite=None,
        tasks=args.task_paths,
        num_clients=args.num_clients,
        participation=args.participation,
        rounds=1,
        zeta=0.0,
        local_steps=args.local_steps,
        batch_size=32,
        max_length=32,
        min_samples=8,
        seed=args.seed,
        export=False,
        output_dir=os.path.join(tempfile.gettempdir(), "hf_fedtask_memory_bench_unused"),
    )
    t0 = time.perf_counter()
    sim = Federation(config)
    t_build = time.perf_counter() - t0
    rss_built = maxrss_mib()
    gc_objects = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    t_gc = time.perf_counter() - t0
    state = sim.initial_state()
    if args.per_client_copies == "all":
        fill_per_client_state(sim, state)
    t0 = time.perf_counter()
    state, record = sim.run_round(state, 1)
    t_round = time.perf_counter() - t0
    print(json.dumps({
        "strategy": sim.strategy.name,
        "num_clients": sim.env.num_clients,
        "trained_clients": len(record["clients"]),
        "samples_per_trained_client": [sum(len(d) for d in sim.client_data(c).values()) for c in record["clients"]],
        "maxrss_mib": maxrss_mib(),
        "maxrss_after_imports_mib": rss_imports,
        "maxrss_after_build_mib": rss_built,
        "gc_tracked_objects": gc_objects,
        "gc_collect_ms": t_gc * 1e3,
        "build_s": t_build,
        "round_s": t_round,
        "mean_metric": record["mean_metric"],
        **per_client_state(sim, state),
    }))


def run_child(paths, strategy, num_clients, participation, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--child-strategy", strategy,
           "--num-clients", str(num_clients), "--participation", str(participation),
           "--per-client-copies", args.per_client_copies, "--local-steps", str(args.local_steps),
           "--threads", str(args.threads), "--seed", str(args.seed), "--task-paths", *paths]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"child {strategy} {num_clients} clients failed (rc {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
                   help="strategies to measure, one RATIO line each (default: all three)")
    p.add_argument("--per-client-copies", choices=("all", "trained"), default="all",
                   help="all: every client holds its own per-client state before the measured round (the steady "
                        "state of a long run); trained: round 1 as it comes, only trained clients hold one")
    p.add_argument("--many", type=int, default=100, help="simulated clients in the large config")
    p.add_argument("--few", type=int, default=4, help="simulated clients in the small config (= clients trained)")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--train-rows", type=int, default=800, help="train rows per task (shared by all configs)")
    p.add_argument("--test-rows", type=int, default=64)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per config (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="throwaway children before timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 local step, 8 test rows per task, 1 repeat, no warm-up")
    # internal: child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    p.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--participation", type=float, help=argparse.SUPPRESS)
    p.add_argument("--task-paths", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.local_steps, args.test_rows, args.repeats, args.warmup = 1, 8, 1, 0
    strategies = list(dict.fromkeys(args.strategy))

    import datasets
    import torch

    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    per_client = args.train_rows * args.tasks // args.many
    assert per_client >= 8, f"{args.many} clients would get {per_client} < min_samples=8 rows each"
    configs = {args.few: 1.0, args.many: args.few / args.many}
    with tempfile.TemporaryDirectory(prefix="hf_fedtask_membench_") as tmp:
        paths = make_tasks(tmp, args.tasks, args.train_rows, args.test_rows, args.seed)
        for _ in range(args.warmup):
            run_child(paths, strategies[0], args.few, 1.0, args)
        results = {(s, n): [] for s in strategies for n in configs}
        for _ in range(args.repeats):
            for s in strategies:
                for n, part in configs.items():
                    results[s, n].append(run_child(paths, s, n, part, args))

    print(f"config: MiniLM-L6 + LoRA r=8, {args.tasks} tasks x {args.train_rows} train rows, 1 round, "
          f"{args.few} clients trained per round ({args.local_steps} local steps each), {args.threads} threads, "
          f"median of {args.repeats} fresh processes, per-client copies: {args.per_client_copies}")
    lines = []
    for s in strategies:
        peak = {}
        for n in configs:
            rs = results[s, n]
            r = rs[0]
            peak[n] = statistics.median(x["maxrss_mib"] for x in rs)
            assert r["strategy"] == s and r["num_clients"] == n and r["trained_clients"] == args.few, r
            print(f"{s:>6} {n:4d} simulated clients: peak RSS {peak[n]:7.1f} MiB  "
                  f"(runs {[round(x['maxrss_mib'], 1) for x in rs]}; "
                  f"after imports {r['maxrss_after_imports_mib']:.0f}, "
                  f"after Federation() {r['maxrss_after_build_mib']:.0f}; trained {r['trained_clients']} clients "
                  f"with {r['samples_per_trained_client']} rows; per-client state: {r['own_copies']} own copies "
                  f"holding {r['distinct_mib']:.2f} MiB; gc-tracked objects {r['gc_tracked_objects']}, "
                  f"one gc.collect() "
                  f"{r['gc_collect_ms']:.0f} ms; build {statistics.median(x['build_s'] for x in rs):.1f} s, "
                  f"round {statistics.median(x['round_s'] for x in rs):.1f} s)")
        few, many = results[s, args.few][0], results[s, args.many][0]
        growth = peak[args.many] - peak[args.few]
        explained = many["distinct_mib"] - few["distinct_mib"]
        ratio = peak[args.many] / peak[args.few]
        print(f"{s:>6} per-client state: one client's copy {many['one_client_mib']:.3f} MiB "
              f"(expected, from its tensors); "
              f"own copies {few['own_copies']} with {args.few} clients vs {many['own_copies']} with {args.many} "
              f"({few['distinct_mib']:.2f} vs {many['distinct_mib']:.2f} MiB): explains {explained:+.1f} MiB of the "
              f"measured peak growth {growth:+.1f} MiB "
              f"({(growth - explained) * 1024 / (args.many - args.few):+.0f} KiB "
              f"per extra simulated client left)")
        lines.append(f"RATIO {s} peak({args.many})/peak({args.few}) = {ratio:.3f}  (goal <= {GOAL})  -> "
                     f"{'PASS' if ratio <= GOAL else 'FAIL'}  [per-client state {many['one_client_mib']:.3f} MiB x "
                     f"{many['own_copies']} copies vs x {few['own_copies']}]")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
