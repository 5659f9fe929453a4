"""Mixed precision against fp32: the same federated job run with `--mixed-precision no` and `bf16`
(or `fp16` on a GPU), in one process, alternating, on the device `--device` picks.

The job: `--strategy` (default fedavg) on `builtin-8` with the embedded MiniLM, `--rounds` rounds (3),
every other setting at its default, export off. Under bf16 the local Trainer runs its forward and
loss in autocast (Accelerate's mixed precision) and evaluation runs in the same autocast; task
vectors, server state and aggregation stay fp32 (checked: every checkpoint tensor is float32).

Printed: each run's mean accuracy and wall time, then per precision the best wall time, the mean
accuracy's difference from fp32 (goal: within 0.02) and the wall-time ratio fp32 / mixed (above 1:
mixed precision is faster), also as a `RATIO` line. Runs alternate in order from one repetition to the
next; each builds its environment afresh (tokenization included), so a ratio is of whole runs. On a
CPU without native bf16 arithmetic (no AVX512-BF16/AMX), bf16 is emulated through fp32 conversions,
so a ratio below 1 is what to expect there.

    python benchmarks/mixed_precision.py                       # fp32 vs bf16, 3 rounds, once each
    python benchmarks/mixed_precision.py --repeat 2 --threads 2
    python benchmarks/mixed_precision.py --device cuda --precisions bf16 fp16
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def one_run(args, precision: str, out: str) -> dict:
    from safetensors import safe_open

    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.run import run

    config = RunConfig(strategy=args.strategy, suite=args.suite, rounds=args.rounds, device=args.device,
                       mixed_precision=precision, export=False, output_dir=out,
                       **({"max_train_samples": args.max_train_samples} if args.max_train_samples else {}),
                       **({"max_test_samples": args.max_test_samples} if args.max_test_samples else {}))
    start = time.perf_counter()
    results = run(config, overwrite=True)
    seconds = time.perf_counter() - start
    with safe_open(os.path.join(out, "checkpoint.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return {"precision": precision, "mean_metric": results["mean_metric"], "seconds": seconds,
            "state_dtypes": sorted(dtypes)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--suite", default="builtin-8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precisions", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each precision, alternating")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    parser.add_argument("--max-train-samples", type=int)
    parser.add_argument("--max-test-samples", type=int)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="1 round on 32 training / 16 test samples per task")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_train_samples, args.max_test_samples = 1, 32, 16

    import torch

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    print(f"torch threads: {torch.get_num_threads()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_fedtask_mp_") as tmp:
        for i in range(args.repeat):  # the order alternates, so neither precision always runs first
            order = ["no", *args.precisions]
            for precision in order if i % 2 == 0 else order[::-1]:
                row = one_run(args, precision, os.path.join(tmp, f"{precision}_{i}"))
                rows.append(row)
                print(f"run {i + 1}: {precision:>4}  mean accuracy {row['mean_metric']:.4f}  {row['seconds']:.1f} s  "
                      f"state dtypes {', '.join(row['state_dtypes'])}", flush=True)
    fp32 = [r for r in rows if r["precision"] == "no"]
    base_acc = sum(r["mean_metric"] for r in fp32) / len(fp32)
    base_time = min(r["seconds"] for r in fp32)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("| precision | mean accuracy | Δ vs fp32 (goal ≤ 0.02) | best wall time | fp32 time / this |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {base_acc:.4f} | – | {base_time:.1f} s | 1.00 |")
    for precision in args.precisions:
        mine = [r for r in rows if r["precision"] == precision]
        acc = sum(r["mean_metric"] for r in mine) / len(mine)
        best = min(r["seconds"] for r in mine)
        print(f"| {precision} | {acc:.4f} | {acc - base_acc:+.4f} | {best:.1f} s | {base_time / best:.2f} |")
        print(f"RATIO {precision} fp32_time/{precision}_time = {base_time / best:.3f}  accuracy {precision} - fp32 = "
              f"{acc - base_acc:+.4f} (goal within 0.02)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
