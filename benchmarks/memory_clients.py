"""Peak memory of simulating 100 clients versus 4 clients (ratio = peak100 / peak4, goal <= 1.2).

What is compared: two `hf_fedtask.engine.Federation`s (in-process engine) on the real MiniLM
(`sentence-transformers/all-MiniLM-L6-v2`, offline copy) + LoRA r=8, each run for one full round
(`run_round`: sample clients, `client_update`, wire round-trip, `server_aggregate`, evaluate every
task). Config "4": 4 clients, participation 1.0. Config "100": 100 clients, participation 0.04, so
4 sampled clients train in both. Everything else is identical: the same 4 local synthetic tasks
(saved with `save_to_disk`, like tests/conftest.py) with the same total data, one task per client
(zeta=0), the same fixed number of local optimizer steps per client (`local_steps`), batch size,
sequence length and seed. Only the number of *simulated* clients (and so how the same data is
split into per-client datasets) differs, which is exactly the cost the host design claims is small.

Each configuration runs in a fresh subprocess, so peaks do not mix; the child reports
`resource.getrusage(RUSAGE_SELF).ru_maxrss` (the high-water RSS). A throwaway child runs first to warm
the file cache; each configuration is repeated and the median peak is used.
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
        strategy="fedavg",
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
    t0 = time.perf_counter()
    state, record = sim.run_round(state, 1)
    t_round = time.perf_counter() - t0
    print(json.dumps({
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
    }))


def run_child(paths, num_clients, participation, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--num-clients", str(num_clients),
           "--participation", str(participation), "--local-steps", str(args.local_steps),
           "--threads", str(args.threads), "--seed", str(args.seed), "--task-paths", *paths]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"child {num_clients} clients failed (rc {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--quick", action="store_true", help="smoke run: 1 local step, 1 repeat, no warm-up")
    # internal: child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--participation", type=float, help=argparse.SUPPRESS)
    p.add_argument("--task-paths", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.local_steps, args.repeats, args.warmup = 1, 1, 0

    import datasets
    import torch

    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    per_client = args.train_rows * args.tasks // args.many
    assert per_client >= 8, f"{args.many} clients would get {per_client} < min_samples=8 rows each"
    with tempfile.TemporaryDirectory(prefix="hf_fedtask_membench_") as tmp:
        paths = make_tasks(tmp, args.tasks, args.train_rows, args.test_rows, args.seed)
        configs = {args.few: 1.0, args.many: args.few / args.many}
        for _ in range(args.warmup):
            run_child(paths, args.few, 1.0, args)
        results = {n: [] for n in configs}
        for _ in range(args.repeats):
            for n, part in configs.items():
                results[n].append(run_child(paths, n, part, args))

    print(f"config: MiniLM-L6 + LoRA r=8, {args.tasks} tasks x {args.train_rows} train rows, 1 round, "
          f"{args.few} clients trained per round ({args.local_steps} local steps each), {args.threads} threads, "
          f"median of {args.repeats} fresh processes")
    peak = {}
    for n, rs in results.items():
        r = rs[0]
        peak[n] = statistics.median(x["maxrss_mib"] for x in rs)
        assert r["num_clients"] == n and r["trained_clients"] == args.few, r
        print(f"{n:4d} simulated clients: peak RSS {peak[n]:7.1f} MiB  (runs {[round(x['maxrss_mib'], 1) for x in rs]}; "
              f"after imports {r['maxrss_after_imports_mib']:.0f}, after Federation() {r['maxrss_after_build_mib']:.0f}; "
              f"trained {r['trained_clients']} clients with {r['samples_per_trained_client']} rows; "
              f"gc-tracked objects {r['gc_tracked_objects']}, one gc.collect() {r['gc_collect_ms']:.0f} ms; "
              f"build {statistics.median(x['build_s'] for x in rs):.1f} s, round {statistics.median(x['round_s'] for x in rs):.1f} s)")
    ratio = peak[args.many] / peak[args.few]
    extra = (peak[args.many] - peak[args.few]) / (args.many - args.few)
    print(f"extra memory per simulated client: {extra * 1024:.0f} KiB")
    print(f"RATIO peak({args.many})/peak({args.few}) = {ratio:.3f}  (goal <= {GOAL})  -> {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
