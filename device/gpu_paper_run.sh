#!/usr/bin/env bash
# The papers' full-scale tables in one device call (after `bash device/gpu_paper_prepare.sh` here): installs
# the carried wheels, then runs five jobs side by side on the one GPU, each a process of its own (the runs are
# bound by per-step Python work, so parallel processes use the box's 16 cores and leave the GPU mostly idle):
# TCT and FedAvg for Fashion-MNIST's #C=1 and α=0.5 columns (device/gpu_tct_fmnist_full.py, one method and
# column per job) and F²L²'s MNIST backdoor table (device/gpu_f2l2_mnist.py). Each job stops at
# $GPU_PAPER_DEADLINE seconds (default 500) so the call ends inside its 10-minute limit; what finished is
# summarized in $OUT/gpu_paper.json, the F²L² table in $OUT/f2l2_backdoor.md, and logs + per-round metrics in
# $OUT/details.tar.gz.
#   run tool: carry [".whl", ".gpu_data"], timeout_s 600, command: bash device/gpu_paper_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_paper}"
work="${GPU_PAPER_WORK:-/tmp/gpu_paper}"
deadline="${GPU_PAPER_DEADLINE:-500}"
mkdir -p "$out" "$work"
if [ "${GPU_PAPER_INSTALL:-1}" = 1 ]; then  # 0: where the project is installed already (a CPU smoke test)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: the carried wheels (.whl) did not install"; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export HF_FEDTASK_FASHION_MNIST="$PWD/.gpu_data/fashion-mnist" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# five processes share the cores: each taking all of them (torch's default) made every one ~10× slower
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / 5 > 0 ? $(nproc) / 5 : 1 ))}"
[ -d .gpu_data/mnist ] && export HF_FEDTASK_MNIST="$PWD/.gpu_data/mnist"
nvidia-smi -L
# the Arrow caches once, before the jobs that read them start side by side
python3 -c "from hf_fedtask.data.images import load_fashion_mnist, load_mnist, mnist_files; import os, pathlib
load_fashion_mnist()
if os.environ.get('HF_FEDTASK_MNIST') and mnist_files(pathlib.Path(os.environ['HF_FEDTASK_MNIST'])): load_mnist()"

job() {  # job NAME SCRIPT ARGS...: one process, its log and exit status under $work
  local name="$1"; shift
  local begun=$SECONDS
  timeout "$deadline" python3 "$@" --out "$work/$name" > "$work/$name.log" 2>&1
  echo "{\"job\": \"$name\", \"exit\": $?, \"seconds\": $((SECONDS - begun))}" >> "$work/jobs.jsonl"
}
rm -f "$work/jobs.jsonl"
pids=()
for setting in c1 a05; do
  for method in fedavg tct; do
    # shellcheck disable=SC2086  # GPU_PAPER_ARGS: extra flags for every job (--quick: a CPU smoke test)
    job "tct_${setting}_${method}" device/gpu_tct_fmnist_full.py --settings "$setting" --methods "$method" \
      ${GPU_PAPER_ARGS:-} &
    pids+=($!)
  done
done
# shellcheck disable=SC2086
job f2l2 device/gpu_f2l2_mnist.py ${GPU_PAPER_ARGS:-} &
pids+=($!)
( while sleep 30; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; done ) \
  > "$work/gpu_use.log" 2>&1 &
monitor=$!
wait "${pids[@]}"
kill "$monitor" 2>/dev/null

python3 - "$work" "$out" <<'PY'
import json, shutil, sys, tarfile
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
summary = {"jobs": [json.loads(line) for line in (work / "jobs.jsonl").read_text().splitlines() if line.strip()]}
for job in summary["jobs"]:
    folder = work / job["job"]
    for name in ("tct_fmnist_full.json", "f2l2_mnist.json"):
        if (folder / name).exists():
            job["report"] = json.loads((folder / name).read_text())
    if (folder / "f2l2_backdoor.md").exists():
        shutil.copy(folder / "f2l2_backdoor.md", out / "f2l2_backdoor.md")
(out / "gpu_paper.json").write_text(json.dumps(summary, indent=1) + "\n")
with tarfile.open(out / "details.tar.gz", "w:gz") as tar:
    for path in sorted(work.rglob("*")):
        if path.suffix in (".log", ".jsonl", ".md") or path.name in ("results.json", "tct_fmnist.json"):
            tar.add(path, arcname=str(path.relative_to(work)))
print(json.dumps([{k: j.get(k) for k in ("job", "exit", "seconds")} for j in summary["jobs"]]))
PY
