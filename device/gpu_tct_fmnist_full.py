"""TCT's Fashion-MNIST #C=1 and α=0.5 columns (Yu et al., NeurIPS 2022, Table 2: TCT 86.3 / 91.1, FedAvg 35.1 /
90.1) with all 60,000 training and 10,000 test images on one GPU, FedAvg and TCT, through
`recipes/tct_fmnist.py` (one setting at a time, so a run cut short still leaves the finished columns).

    bash device/gpu_paper_prepare.sh                      # here: wheels + the idx files to carry
    python device/gpu_tct_fmnist_full.py                  # on the GPU box (device/gpu_paper_run.sh: all jobs)
    python device/gpu_tct_fmnist_full.py --quick          # CPU smoke test: 600 images, 4 rounds, p = 500

Measured on an H100 (device/gpu_paper_run.sh, 5 processes of 3 threads, before image splits were held in
memory): 15.5–20.8 s a round, about 9 minutes per column and method side by side with the F²L² job (about
12), so with start-up more than one 15-minute lease held then. The sizes: 10 clients, 30
rounds of 1 local epoch (batch 64, SGD lr 0.05), TCT 20 FedAvg rounds + the normalization round + 9
stage-2 rounds of M = 100 full-batch steps, p = 10,000. The paper's protocol (200 rounds of 5 local
epochs for FedAvg, T₁ = 100 + 100 stage-2 rounds of M = 500, p = 100,000) is 30-fold that: `--paper`
sets it, for a longer lease. Writes `<out>/tct_fmnist_full.json` (each column's table, the sizes, wall
times) and `<out>/<setting>/tct_fmnist.md`; `<out>` is $OUT on the device machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
               "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

FULL = {"max_train_samples": 60000, "max_test_samples": 10000, "rounds": 30, "local_epochs": 1.0,
        "batch_size": 64, "eval_batch_size": 1024, "tct_stage1": 20, "tct_features": 10000, "tct_steps": 100}
PAPER = {**FULL, "rounds": 200, "local_epochs": 5.0, "tct_stage1": 100, "tct_features": 100000, "tct_steps": 500}
QUICK = {"max_train_samples": 600, "max_test_samples": 200, "rounds": 4, "local_epochs": 1.0, "batch_size": 32,
         "eval_batch_size": 256, "tct_stage1": 2, "tct_features": 500, "tct_steps": 10}
PAPER_TABLE = {"c1": {"fedavg": 35.1, "tct": 86.3}, "a05": {"fedavg": 90.1, "tct": 91.1}}


def data_task() -> str:
    """fashion_mnist where its idx files are here (the Debian package, or carried: $HF_FEDTASK_FASHION_MNIST)."""
    from hf_fedtask.data.images import fashion_mnist_available

    return "fashion_mnist" if fashion_mnist_available() else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny sizes (digits if no Fashion-MNIST)")
    parser.add_argument("--paper", action="store_true", help="the paper's rounds, local epochs, T₁, M and p")
    parser.add_argument("--settings", nargs="+", choices=("c1", "a05"), default=["c1", "a05"])
    parser.add_argument("--methods", nargs="+", choices=("fedavg", "tct"), default=["fedavg", "tct"],
                        help="one method per process lets device/gpu_paper_run.sh run them side by side")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_tct_fmnist_full")
    args = parser.parse_args(argv)
    import tct_fmnist

    sizes = QUICK if args.quick else PAPER if args.paper else FULL
    task = data_task() or ("digits" if args.quick else "")
    if not task:
        print("error: no Fashion-MNIST idx files (apt-get install dataset-fashion-mnist, or carry them and set "
              "HF_FEDTASK_FASHION_MNIST; device/gpu_paper_prepare.sh does)", file=sys.stderr)
        return 2
    out = Path(args.out)
    report = {"task": task, "sizes": sizes, "paper": PAPER_TABLE, "columns": {}}
    start = time.perf_counter()
    for setting in args.settings:
        begun = time.perf_counter()
        argv = ["--settings", setting, "--methods", *args.methods, "--tasks", task,
                "--output-dir", str(out / setting), "--tct-stage1", str(sizes["tct_stage1"]),
                "--tct-features", str(sizes["tct_features"]), "--tct-steps", str(sizes["tct_steps"])]
        for key in ("max_train_samples", "max_test_samples", "rounds", "local_epochs", "batch_size",
                    "eval_batch_size"):
            argv += [f"--{key.replace('_', '-')}", str(sizes[key])]
        code = tct_fmnist.main(argv)
        table = json.loads((out / setting / "tct_fmnist.json").read_text())["final"] if code == 0 else None
        report["columns"][setting] = {"exit": code, "seconds": time.perf_counter() - begun,
                                      "accuracy": {m: v[setting] for m, v in table.items()} if table else None}
        report["seconds"] = time.perf_counter() - start
        (out / "tct_fmnist_full.json").write_text(json.dumps(report, indent=1) + "\n")
        if code:
            return code
    print(json.dumps(report["columns"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
