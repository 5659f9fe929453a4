"""Streaming merges versus peft's stacked ones: time and peak extra memory on N task vectors of d floats.

Inputs: N task vectors, float32, `torch.randn` from a seeded generator, in one of two layouts:
  tensors8  (default) the d entries split over 8 parameter tensors `layers.{0..7}.weight` holding 30,
            20, 15, 10, 10, 8 and 5% of d (each size made odd, so chunks straddle tensors at
            unaligned offsets) and the rest
  lora      a real LoRA adapter's many small tensors: r=16 on q, k, v, o, gate, up and down of a
            Llama-7B-shaped model (hidden 4096, MLP 11008), lora_A (16×in) and lora_B (out×16) per
            module, as many layers as fit in d (14 tensors of 65,536 or 176,128 entries per layer)
Every method works elementwise on flattened tensors (peft's `ties` included). Weights w_t = 0.5 + t/N (not all
1, as FedAvg-style weights would not be), density 0.2, majority sign "total", per-tensor trimming.

Methods, each called on the same inputs:
  floor          Σ_t τ_t as a running sum in cache-sized chunks: one read of the N·d floats, the
                 least any merge of N vectors must do
  ties           hf_fedtask.merge.ties: the fused numba kernels (threshold selection without a sort,
                 then trim + elect + disjoint mean in one pass)
  ties_select    the threshold selection alone (where ties' time goes: the rest is the merge pass)
  ties_model     ties with scope="model": one top-k over each whole task vector (TIES as its paper
                 states it), so the selection runs on populations of d entries
  model_select   that selection alone (sampled bracket, radix fallback)
  model_select_radix   the radix selection on the same populations, in parallel the same way; its
                 values are checked equal to model_select's
  ties_torch     hf_fedtask.merge.ties(backend="torch"): the streaming torch reference, checked
                 equal to ties bit for bit before any ratio is printed
  peft_ties      peft.utils.merge_utils.ties once per parameter, as peft's add_weighted_adapter
                 applies it (it torch.stack-s the N tensors of the parameter, and copies the stack
                 several times)
  unify          hf_fedtask.merge.unify (one fused numba pass; global-sum rescalers; bit-packed masks)
  unify_torch    hf_fedtask.merge.unify(backend="torch"): the streaming torch reference
  stacked_unify  unify's math written plainly on stacked tensors (`stacked_unify` below: stack the
                 N flattened vectors, elect the sign, take the largest agreeing magnitude, one bool
                 mask per task, the rescalers). It is what unify is timed against: peft has no
                 unify, and peft's ties does other work, so it is no yardstick for unify. Its output
                 is checked equal to unify's (the unified vector and every mask bit for bit, the
                 rescalers to 1e-6 relative) before any ratio is printed.

  ties_batched   ties(backend="batched"): the path taken on an accelerator (`hf_fedtask/merge/batched.py`:
                 all tasks stacked per chunk, one topk per group of populations, a few ops per chunk), here
                 on the CPU; checked equal to ties bit for bit
  unify_batched  unify(backend="batched"), the same; checked equal to unify (vector and masks bit for bit,
                 rescalers to 1e-6 relative)
  task_arithmetic          hf_fedtask.merge.task_arithmetic(backend="torch"): one add_ per task and key
  task_arithmetic_batched  task_arithmetic(backend="batched"): one multi-tensor add per task over all keys;
                 checked equal to task_arithmetic bit for bit
  peft_task_arithmetic     peft.utils.merge_utils.task_arithmetic once per parameter (it stacks the N tensors)

  mean           hf_fedtask.merge.weighted_average on the list of N vectors (FedAvg's aggregate): one
                 fused pass, float64 sums per cache-sized chunk, each input read once
  mean_stream    weighted_average on a generator of the N vectors (as from files): a fused running
                 float64 sum, O(d) memory however many vectors come
  mean_torch     weighted_average(backend="torch") on the generator: the reference (a float64 copy
                 of each input, then add_); mean and mean_stream are checked equal to it bit for bit
  agreement      hf_fedtask.merge.agreement_mask (MaTU's soft sign-agreement mask, rho 0.4), fused
  agreement_torch  the same with backend="torch" (one sign tensor per task); checked equal bit for bit

Ratios, each named by what is divided by what (time = best wall time, mem = peak extra memory):
  ties_time/floor_time                          cost over the floor (goal ≤ 4)
  unify_time/floor_time                         cost over the floor (goal ≤ 2)
  ties_select_time/floor_time                   the selection's share of ties, in floors
  ties_model_time/floor_time                    ties with whole-vector trimming, in floors
  model_select_radix_time/model_select_time     the sampled-bracket selection's speed-up over radix
  ties_torch_time/ties_time, unify_torch_time/unify_time   the fused kernels over the torch path
  peft_ties_time/ties_time                      speed-up of our ties over peft's ties (goal ≥ 10)
  ties_mem/peft_ties_mem                        our ties' peak extra memory over peft's (goal ≤ 0.2)
  output_mem/peft_ties_mem                      the merged vector's own bytes (d float32) over peft's peak:
                                                the least ties_mem/peft_ties_mem any merge that returns
                                                its result in memory can reach (a large share on the
                                                lora layout, where peft stacks one small parameter at a
                                                time and its peak moves from run to run)
  ties_work_mem/peft_ties_work_mem              the same ratio beyond the output: peak extra memory less
                                                the d float32 of the result, ours over peft's
  peft_ties_time/ties_batched_time              the batched path (the accelerator's) against peft, on the CPU
  ties_batched_time/ties_time                   the batched path over the fused kernels on the CPU (why the
                                                CPU keeps the kernels)
  stacked_unify_time/unify_batched_time         the batched unify against the plain stacked unify
  peft_task_arithmetic_time/task_arithmetic_batched_time   batched task arithmetic against peft's
  stacked_unify_time/unify_time                 speed-up of streaming unify over stacked unify
  unify_mem/stacked_unify_mem                   streaming unify's peak extra memory over stacked's
  mean_time/floor_time, mean_stream_time/floor_time, agreement_time/floor_time   the other fused
                                                passes, in floors
  mean_torch_time/mean_time, mean_torch_time/mean_stream_time, agreement_torch_time/agreement_time
                                                the fused passes' speed-up over their torch paths
(the issue set no goal for unify against a stacked unify: those two rows are reported without one).

Time: wall clock, the best of --repeat calls. A method timed against the floor (ties, ties_select,
ties_model, unify, mean, mean_stream, agreement) is called --paired-repeat times instead, each call
right after a call of the floor, and its ratio divides its best time by the best of those floor
calls: the box's memory speed drifts from minute to minute, and a floor timed a minute before would
measure the drift, not the method. Peak extra memory: the peak resident set size during
the call minus the resident set size just before it. tracemalloc does not see torch's allocations,
so both come from the kernel: the peak (VmHWM) is reset by writing 5 to /proc/self/clear_refs before
the call and read from /proc/self/status after it, which misses no short-lived peak; where that file
cannot be written, a thread samples the RSS every millisecond (psutil) instead. Before each call
freed heap memory is handed back to the OS (gc, then glibc's malloc_trim), so calls start from the
same baseline. Peaks are floored at one page, so that ratios stay finite at tiny sizes.

Goals: ties ≤ 4× and unify ≤ 2× the floor, ties ≥ 10× faster than peft at ≤ 1/5 of its peak extra
memory, at 1 and at 2 threads.

Tuning record: the measurements behind the constants and loop shapes of hf_fedtask/merge (made with
this benchmark and variants of it on the development box, 32 MiB L3, N=30, d=10M, unless said; the
code keeps only what it chose and why):
  streaming.CACHE_BYTES = 4 MiB       best: 8 MiB was 10-25% slower, 2 MiB 5% slower
  fused_passes.SUB = 4096 entries     5-20% faster than 2048 or 8192 (longer runs per input stream,
                                      still cache-resident)
  ties' vote and disjoint mean sweep 2 tasks at once: the merge pass took 0.138 s against 0.164 s
                                      with one task per sweep (1 thread)
  unify's sum sweeps 4 tasks, its agreement 2: 15-20% off unify's time against one task per sweep
  threshold_select._SAMPLE_RUN = 8    runs of 8 consecutive entries read 2.5x faster than single
                                      entries at the same sample density (each single entry costs
                                      a cache line)
  threshold_select._SAMPLED_FROM = 2^16   from this size the sampled selection runs at 2x the radix
                                      selection's speed
  threshold_select._COUNTED_BELOW = 2^20  narrowing the bracket by counting at 8 edges first took
                                      0.62x the one-pass time at 2^16 entries, 0.81x at 2^18, 0.94x
                                      at 2^19 and 1.03x at 2^20 (N(0,1) entries, density 0.2)
  threshold_select._flag_entries      counting in float32 lanes: an integer count, widened to int64
                                      lanes, ran at half the speed
  streaming.Layout                    a tensor's `.device` costs about 1 µs a read, so devices are
                                      read once per key and once per vector

    python benchmarks/merge_bench.py --threads 1      # N=30, d=10M (≈1.2 GB of inputs)
    python benchmarks/merge_bench.py --threads 1 --layout lora
    python benchmarks/merge_bench.py --quick          # N=4, d=200k, best of 2 calls each: a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import threading
import time

import numba
import numpy as np
import torch
from peft.utils import merge_utils as peft_merge

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import agreement_mask, kernels, task_arithmetic, threshold_select, ties, unify, weighted_average
from hf_fedtask.merge.streaming import Layout, chunk_len
from hf_fedtask.merge.ties import _select_all

FRACTIONS = (0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05)
LORA_R = 16
LORA_MODULES = (("q_proj", 4096, 4096), ("k_proj", 4096, 4096), ("v_proj", 4096, 4096), ("o_proj", 4096, 4096),
                ("gate_proj", 4096, 11008), ("up_proj", 4096, 11008), ("down_proj", 11008, 4096))
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# timed against the floor
FLOOR_PAIRED = ("ties", "ties_select", "ties_model", "unify", "mean", "mean_stream", "agreement")
# ratio name -> (goal, True when the ratio must be at least the goal); None: reported without a goal
GOALS = {
    "ties_time/floor_time": (4.0, False),
    "unify_time/floor_time": (2.0, False),
    "ties_select_time/floor_time": None,
    "ties_model_time/floor_time": None,
    "model_select_radix_time/model_select_time": None,
    "ties_torch_time/ties_time": None,
    "unify_torch_time/unify_time": None,
    "peft_ties_time/ties_time": (10.0, True),
    "ties_mem/peft_ties_mem": (0.2, False),
    "output_mem/peft_ties_mem": None,
    "ties_work_mem/peft_ties_work_mem": None,
    "stacked_unify_time/unify_time": None,
    "unify_mem/stacked_unify_mem": None,
    "peft_ties_time/ties_batched_time": None,
    "ties_batched_time/ties_time": None,
    "stacked_unify_time/unify_batched_time": None,
    "peft_task_arithmetic_time/task_arithmetic_batched_time": None,
    "mean_time/floor_time": None,
    "mean_stream_time/floor_time": None,
    "agreement_time/floor_time": None,
    "mean_torch_time/mean_time": None,
    "mean_torch_time/mean_stream_time": None,
    "agreement_torch_time/agreement_time": None,
}


def layout_sizes(layout: str, d: int) -> dict[str, int]:
    """Parameter name -> entries for a layout (see the module docstring)."""
    if layout == "tensors8":
        sizes = [max(1, int(f * d)) | 1 for f in FRACTIONS]
        sizes.append(d - sum(sizes))
        if sizes[-1] < 0:
            raise ValueError(f"--d {d} is too small for the 8-tensor layout")
        return {f"layers.{i}.weight": s for i, s in enumerate(sizes)}
    per_layer = {name: (in_, out) for name, in_, out in LORA_MODULES}
    layer = sum(LORA_R * (i + o) for i, o in per_layer.values())
    if d < layer:
        raise ValueError(f"--d {d} is too small for one LoRA layer ({layer:,} entries)")
    return {f"layers.{n}.{name}.lora_{ab}.weight": LORA_R * (in_ if ab == "A" else out)
            for n in range(d // layer) for name, (in_, out) in per_layer.items() for ab in "AB"}


def make_inputs(n: int, d: int, seed: int, layout: str = "tensors8") -> list[TaskVector]:
    """N seeded float32 task vectors of (about, for lora) d entries in `layout`."""
    sizes = layout_sizes(layout, d)
    g = torch.Generator().manual_seed(seed)
    return [TaskVector({key: torch.randn(s, generator=g) for key, s in sizes.items()}) for _ in range(n)]


def floor(vectors: list[TaskVector]) -> dict[str, torch.Tensor]:
    """Σ_t τ_t, chunk by chunk so the accumulator stays in cache: N·d floats read once."""
    size = chunk_len(1, 4, sum(t.numel() for t in vectors[0].values()))
    out = {}
    for key in vectors[0]:
        acc = torch.zeros(vectors[0][key].numel())
        for start in range(0, acc.numel(), size):
            part = acc[start : start + size]
            for tv in vectors:
                part.add_(tv[key][start : start + size])
        out[key] = acc
    return out


def peft_ties(vectors: list[TaskVector], weights: list[float], density: float) -> dict[str, torch.Tensor]:
    w = torch.tensor(weights)
    return {key: peft_merge.ties([tv[key] for tv in vectors], w, density, "total") for key in vectors[0]}


def peft_task_arithmetic(vectors: list[TaskVector], weights: list[float]) -> dict[str, torch.Tensor]:
    w = torch.tensor(weights, device=next(iter(vectors[0].values())).device)
    return {key: peft_merge.task_arithmetic([tv[key] for tv in vectors], w) for key in vectors[0]}


@torch.no_grad()
def stacked_unify(vectors: list[TaskVector]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unify's math (global-sum rescalers) written plainly on an N×d stack: (flat unified vector,
    N×d bool masks, N rescalers). The sign sums the tasks in task order, as unify defines Σ_t τ_t,
    so both elect the same sign bit for bit."""
    x = torch.stack([tv.flatten() for tv in vectors])  # N×d
    total = x[0].clone()
    for row in x[1:]:
        total += row
    sign = total.sign()                                  # σ = sgn(Σ_t τ_t)
    agree = x * sign                                     # τ_t[j]·σ[j] > 0 where task t agrees
    magnitude = agree.amax(0).clamp(min=0)               # μ = largest agreeing magnitude
    unified = sign * magnitude                           # τ = σ ⊙ μ
    masks = agree > 0                                    # m_t = 1[τ_t ⊙ τ > 0]
    num = x.abs().sum(1, dtype=torch.float64)            # Σ|τ_t|
    den = (masks * magnitude).sum(1, dtype=torch.float64)  # Σ|m_t ⊙ τ|
    rescalers = torch.where(den > 0, num / den, torch.zeros_like(num))
    return unified, masks, rescalers


def check_unify_matches_stacked(ours, reference, n: int) -> float:
    """Raise unless unify's output equals the stacked reference's (vector and masks exactly);
    return the largest relative rescaler difference."""
    from hf_fedtask.merge.bitmask import unpack_bits

    unified, masks, rescalers = reference
    if not torch.equal(ours.vector.flatten(), unified):
        raise SystemExit("unify and stacked_unify disagree on the unified vector: the comparison is void")
    for t in range(n):
        if not torch.equal(unpack_bits(ours.masks[t], unified.numel()).bool(), masks[t]):
            raise SystemExit(f"unify and stacked_unify disagree on task {t}'s mask: the comparison is void")
    got = torch.tensor(ours.rescalers, dtype=torch.float64)
    rel = float(((got - rescalers).abs() / rescalers.abs().clamp(min=1e-300)).max())
    if rel > 1e-6:
        raise SystemExit(f"unify and stacked_unify rescalers differ by {rel:.3g} (relative): the comparison is void")
    return rel


def check_batched(outputs: dict, keys) -> float:
    """Raise unless the batched path's outputs equal the reference ones (ties, task arithmetic, unify's
    vector and masks bit for bit); return unify's largest relative rescaler difference."""
    for name, reference in (("ties_batched", "ties"), ("task_arithmetic_batched", "task_arithmetic")):
        if not all(torch.equal(outputs[name][k], outputs[reference][k]) for k in keys):
            raise SystemExit(f"{name} and {reference} disagree: the comparison is void")
    ours, reference = outputs["unify_batched"], outputs["unify"]
    if not (all(torch.equal(ours.vector[k], reference.vector[k]) for k in keys)
            and all(torch.equal(a, b) for a, b in zip(ours.masks, reference.masks, strict=True))):
        raise SystemExit("unify_batched and unify disagree: the comparison is void")
    rel = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(ours.rescalers, reference.rescalers))
    if rel > 1e-6:
        raise SystemExit(f"unify_batched and unify rescalers differ by {rel:.3g} (relative): the comparison is void")
    return rel


def _release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed memory may stay resident, peaks are then upper bounds
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def radix_select_all(vectors: list[TaskVector], density: float) -> np.ndarray:
    """The radix selection on every whole task vector (the populations of `ties_model`), run in
    parallel like the kernels run theirs: what the sampled-bracket selection is measured against."""
    tensors = [t.reshape(-1).contiguous() for tv in vectors for t in tv.values()]
    lens = np.array([t.numel() for t in tensors], dtype=np.int64)
    population = np.arange(0, len(tensors) + 1, len(vectors[0]), dtype=np.int64)
    ks = np.array([int(density * lens[a:b].sum()) for a, b in zip(population[:-1], population[1:])], dtype=np.int64)
    values = np.empty(len(vectors), dtype=np.uint32)
    with kernels.torch_threads():
        _radix_all(kernels.Plan.pointers(tensors), lens, population, ks, values)
    return values


@numba.njit(parallel=True, nogil=True)
def _radix_all(ptrs, lens, population, ks, values):
    for p in numba.prange(population.size - 1):
        values[p] = threshold_select._radix_select(ptrs, lens, population[p], population[p + 1], ks[p])[0]


def measure(fn, repeat: int, paired=None) -> tuple[float, int, object, float]:
    """(best seconds, smallest peak extra bytes, last result, best seconds of `paired`) over `repeat`
    calls of fn(), each right after a timed call of `paired()` where one is given (else inf)."""
    best_s, best_mem, result, best_paired = math.inf, None, None, math.inf
    for _ in range(repeat):
        result = None
        if paired is not None:
            _release_freed_memory()
            start = time.perf_counter()
            paired()
            best_paired = min(best_paired, time.perf_counter() - start)
        _release_freed_memory()
        if _reset_peak():
            base = _status_kib("VmRSS") * 1024
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
            extra = _status_kib("VmHWM") * 1024 - base
        else:
            seconds, extra, result = _sampled(fn)
        best_s = min(best_s, seconds)
        extra = max(extra, PAGE)
        best_mem = extra if best_mem is None else min(best_mem, extra)
    return best_s, best_mem, result, best_paired


def _sampled(fn) -> tuple[float, int, object]:
    """Time and peak extra RSS of fn(), the RSS sampled every millisecond by a thread."""
    import psutil

    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, proc.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return seconds, max(peak, proc.memory_info().rss) - base, result


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=30, help="task vectors")
    p.add_argument("--d", type=int, default=10_000_000, help="entries per task vector")
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--repeat", type=int, default=2, help="calls per method; the best time and smallest peak count")
    p.add_argument("--paired-repeat", type=int, default=5,
                   help="calls of each method timed against the floor, each after a call of the floor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--layout", choices=("tensors8", "lora"), default="tensors8")
    p.add_argument("--quick", action="store_true", help="smoke run: N=4, d=200,000, best of 2 calls per method")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.d, args.repeat, args.paired_repeat = 4, 200_000, 2, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.quick and args.layout == "lora":
        args.d = 1_250_000  # one layer
    vectors = make_inputs(args.n, args.d, args.seed, args.layout)
    args.d = sum(t.numel() for t in vectors[0].values())
    weights = [0.5 + t / args.n for t in range(args.n)]
    ties(vectors[:2], weights[:2], args.density)  # compile the kernels (cached on disk) outside the timings
    unify(vectors[:2])
    weighted_average(vectors[:2], weights[:2])
    weighted_average(iter(vectors[:2]), weights[:2])
    agreement_mask(vectors[:2])
    radix_select_all(vectors[:2], args.density)
    layout = Layout(vectors)
    flats = [layout.flat_views(tv) for tv in vectors]
    # what exists now (torch, transformers, peft and the inputs) lives to the end: out of the collector's sight,
    # so that each measurement's gc.collect walks only what the merges left (0.23 s a call otherwise)
    gc.freeze()
    print(f"layout {args.layout} ({len(vectors[0])} tensors), N={args.n} d={args.d:,} float32 "
          f"({args.n * args.d * 4 / 2**20:,.0f} MiB of inputs), density "
          f"{args.density}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    runs = {
        "floor": lambda: floor(vectors),
        "ties": lambda: ties(vectors, weights, args.density),
        "ties_select": lambda: _select_all(flats, args.density, "tensor"),
        "ties_model": lambda: ties(vectors, weights, args.density, scope="model"),
        "model_select": lambda: _select_all(flats, args.density, "model"),
        "model_select_radix": lambda: radix_select_all(vectors, args.density),
        "ties_torch": lambda: ties(vectors, weights, args.density, backend="torch"),
        "peft_ties": lambda: peft_ties(vectors, weights, args.density),
        "unify": lambda: unify(vectors),
        "unify_torch": lambda: unify(vectors, backend="torch"),
        "stacked_unify": lambda: stacked_unify(vectors),
        "ties_batched": lambda: ties(vectors, weights, args.density, backend="batched"),
        "unify_batched": lambda: unify(vectors, backend="batched"),
        "task_arithmetic": lambda: task_arithmetic(vectors, weights, backend="torch"),
        "task_arithmetic_batched": lambda: task_arithmetic(vectors, weights, backend="batched"),
        "peft_task_arithmetic": lambda: peft_task_arithmetic(vectors, weights),
        "mean": lambda: weighted_average(vectors, weights),
        "mean_stream": lambda: weighted_average(iter(vectors), weights),
        "mean_torch": lambda: weighted_average(iter(vectors), weights, backend="torch"),
        "agreement": lambda: agreement_mask(vectors, 0.4),
        "agreement_torch": lambda: agreement_mask(vectors, 0.4, backend="torch"),
    }
    results, outputs, floor_of = {}, {}, {}
    for name, fn in runs.items():
        paired = runs["floor"] if name in FLOOR_PAIRED else None
        seconds, mem, outputs[name], floor_of[name] = measure(
            fn, args.paired_repeat if paired else args.repeat, paired)
        results[name] = (seconds, mem)
    ties_diff = max(float((outputs["ties"][k] - outputs["peft_ties"][k]).abs().max()) for k in vectors[0])
    if not all(torch.equal(outputs["ties"][k], outputs["ties_torch"][k]) for k in vectors[0]):
        raise SystemExit("ties and ties_torch disagree: the comparison is void")
    if not (all(torch.equal(outputs["unify"].vector[k], outputs["unify_torch"].vector[k]) for k in vectors[0])
            and all(torch.equal(a, b) for a, b in zip(outputs["unify"].masks, outputs["unify_torch"].masks))):
        raise SystemExit("unify and unify_torch disagree: the comparison is void")
    sampled = [np.float32(found[0][0]) for found in outputs["model_select"]]
    if not np.array_equal(np.array(sampled, dtype=np.float32), outputs["model_select_radix"].view(np.float32)):
        raise SystemExit("the sampled and radix selections disagree: the comparison is void")
    rescaler_diff = check_unify_matches_stacked(outputs["unify"], outputs["stacked_unify"], args.n)
    batched_rescaler_diff = check_batched(outputs, vectors[0])
    ta_diff = max(float((outputs["task_arithmetic_batched"][k] - outputs["peft_task_arithmetic"][k]).abs().max())
                  for k in vectors[0])
    for fused, reference in (("mean", "mean_torch"), ("mean_stream", "mean_torch"), ("agreement", "agreement_torch")):
        if not all(torch.equal(outputs[fused][k].view(torch.int32),
                               outputs[reference][k].contiguous().view(torch.int32))
                   for k in vectors[0]):
            raise SystemExit(f"{fused} and {reference} disagree: the comparison is void")
    outputs.clear()

    print(f"\n{'method':<25}{'time s':>10}{'peak extra MiB':>16}{'paired floor s':>16}")
    for name, (seconds, mem) in results.items():
        paired = f"{floor_of[name]:>16.3f}" if name in FLOOR_PAIRED else ""
        print(f"{name:<25}{seconds:>10.3f}{mem / 2**20:>16.1f}{paired}")
    print(f"max |ties - peft_ties| = {ties_diff:.3g}; ties == ties_torch and unify == unify_torch (vector, masks)")
    print(f"unify == stacked_unify: unified vector and all {args.n} masks identical, "
          f"max relative rescaler difference {rescaler_diff:.3g}")
    print("mean, mean_stream == mean_torch; agreement == agreement_torch (bit for bit)")
    print(f"ties_batched == ties, task_arithmetic_batched == task_arithmetic (bit for bit); unify_batched == unify "
          f"(vector, masks; rescalers max relative difference {batched_rescaler_diff:.3g}); "
          f"max |task_arithmetic_batched - peft_task_arithmetic| = {ta_diff:.3g}")

    output_bytes = args.d * 4  # the merged vector: d float32
    time_of = {name: seconds for name, (seconds, _) in results.items()}
    mem_of = {name: mem for name, (_, mem) in results.items()}
    ratios = {
        "ties_time/floor_time": time_of["ties"] / floor_of["ties"],
        "unify_time/floor_time": time_of["unify"] / floor_of["unify"],
        "ties_select_time/floor_time": time_of["ties_select"] / floor_of["ties_select"],
        "ties_model_time/floor_time": time_of["ties_model"] / floor_of["ties_model"],
        "model_select_radix_time/model_select_time": time_of["model_select_radix"] / time_of["model_select"],
        "ties_torch_time/ties_time": time_of["ties_torch"] / time_of["ties"],
        "unify_torch_time/unify_time": time_of["unify_torch"] / time_of["unify"],
        "peft_ties_time/ties_time": time_of["peft_ties"] / time_of["ties"],
        "ties_mem/peft_ties_mem": mem_of["ties"] / mem_of["peft_ties"],
        "output_mem/peft_ties_mem": output_bytes / mem_of["peft_ties"],
        "ties_work_mem/peft_ties_work_mem": max(mem_of["ties"] - output_bytes, PAGE)
        / max(mem_of["peft_ties"] - output_bytes, PAGE),
        "stacked_unify_time/unify_time": time_of["stacked_unify"] / time_of["unify"],
        "peft_ties_time/ties_batched_time": time_of["peft_ties"] / time_of["ties_batched"],
        "ties_batched_time/ties_time": time_of["ties_batched"] / time_of["ties"],
        "stacked_unify_time/unify_batched_time": time_of["stacked_unify"] / time_of["unify_batched"],
        "peft_task_arithmetic_time/task_arithmetic_batched_time":
            time_of["peft_task_arithmetic"] / time_of["task_arithmetic_batched"],
        "unify_mem/stacked_unify_mem": mem_of["unify"] / mem_of["stacked_unify"],
        "mean_time/floor_time": time_of["mean"] / floor_of["mean"],
        "mean_stream_time/floor_time": time_of["mean_stream"] / floor_of["mean_stream"],
        "agreement_time/floor_time": time_of["agreement"] / floor_of["agreement"],
        "mean_torch_time/mean_time": time_of["mean_torch"] / time_of["mean"],
        "mean_torch_time/mean_stream_time": time_of["mean_torch"] / time_of["mean_stream"],
        "agreement_torch_time/agreement_time": time_of["agreement_torch"] / time_of["agreement"],
    }
    print(f"\n{'':<6}{'ratio':<56}{'value':>8}  goal")
    for name, value in ratios.items():
        if GOALS[name] is None:
            verdict = "(no goal)"
        else:
            goal, at_least = GOALS[name]
            ok = value >= goal if at_least else value <= goal
            verdict = f"{'≥' if at_least else '≤'} {goal:g} {'met' if ok else 'NOT met'}"
        print(f"{'RATIO':<6}{name:<56}{value:>8.3f}  {verdict}")
    return ratios


if __name__ == "__main__":
    main()
