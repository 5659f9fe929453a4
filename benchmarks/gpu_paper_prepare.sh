#!/usr/bin/env bash
# Prepare benchmarks/gpu_tct_fmnist_full.py and benchmarks/gpu_f2l2_mnist.py for a GPU box without network
# (run HERE, in the repo, where the project's dependencies are installed and pip can download): the Python
# packages the box lacks go as wheels into .whl/ (as benchmarks/gpu_check_prepare.sh, without bitsandbytes),
# Fashion-MNIST's four idx files (30 MB, from Debian's dataset-fashion-mnist) into .gpu_data/fashion-mnist,
# and MNIST's into .gpu_data/mnist where $HF_FEDTASK_MNIST names a folder holding them (no package ships
# them). Both folders are ignored through .git/info/exclude. Prints what travels (limit 64 MiB) and the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. benchmarks/gpu_carry.sh
carry_wheels .gpu_data  # no bitsandbytes: these scripts train no quantized model

rm -rf .gpu_data && mkdir -p .gpu_data/fashion-mnist
fmnist="${HF_FEDTASK_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}"
cp "$fmnist"/*-idx?-ubyte.gz .gpu_data/fashion-mnist/ || { echo "no Fashion-MNIST idx files in $fmnist (apt-get install dataset-fashion-mnist)"; exit 1; }
if [ -n "${HF_FEDTASK_MNIST:-}" ]; then
  mkdir -p .gpu_data/mnist && cp "$HF_FEDTASK_MNIST"/*-idx?-ubyte.gz .gpu_data/mnist/
else
  echo "no MNIST: set HF_FEDTASK_MNIST to a folder with its four idx files; gpu_f2l2_mnist.py then runs Fashion-MNIST"
fi
du -sh .whl .gpu_data
cat <<'CALL'

device calls (run tool), each: carry [".whl", ".gpu_data"], timeout_s 600, command:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site HF_FEDTASK_FASHION_MNIST=$PWD/.gpu_data/fashion-mnist && { [ -d .gpu_data/mnist ] && export HF_FEDTASK_MNIST=$PWD/.gpu_data/mnist; true; } && nvidia-smi -L && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_tct_fmnist_full.py 2>&1 | tail -40
(and the same with benchmarks/gpu_f2l2_mnist.py in a second call)
CALL
