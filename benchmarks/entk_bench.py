"""eNTK features per second: hf_fedtask's batched computation (`hf_fedtask.model.entk.entk_features`:
one forward and one backward pass per batch) against TCT's official per-sample backward loop
(`per_sample_loop`), on the same model, samples and coordinates, in one process; the two must agree.

    python benchmarks/entk_bench.py            # small CNN on Fashion-MNIST (or digits) and MiniLM + LoRA
    python benchmarks/entk_bench.py --quick    # fewer samples and repeats

Prints, per model: samples/s of each, the ratio (goal ≥ 10×), the largest difference, the peak
memory added per 1000 samples and the features' own size for p coordinates, and the speed of the
batched forward and backward passes alone (no features), which bounds what batching can gain here. Timings alternate the
two methods and take medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.state import SHARED  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.data.images import fashion_mnist_available  # noqa: E402
from hf_fedtask.engine.environment import Environment  # noqa: E402
from hf_fedtask.model.entk import coordinate_subset, entk_features, input_batches, per_sample_loop  # noqa: E402


def forward_backward(env: Environment, state: TaskVector, data, batch_size: int) -> float:
    """Seconds of the batched forward and backward passes alone, no features formed: what batching
    gains on the passes themselves, against which the cost of forming the features shows."""
    with env.host.loaded(state) as model:
        model.eval()
        start = time.perf_counter()
        for batch in input_batches(env.host, data, batch_size):
            model(**batch).logits[:, 0].sum().backward()
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        model.train()
    return seconds


def measure(name: str, config: RunConfig, n: int, p: int, repeats: int, batch_size: int) -> None:
    env = Environment(config)
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task)
    n = min(n, len(data))  # the task's test split may be smaller
    data = data.select(range(n))
    index = coordinate_subset(state.numel(), p, seed=123)
    entk_features(env.host, state, data.select(range(min(n, 8))), index, batch_size=batch_size)  # warm both up:
    per_sample_loop(env.host, state, data.select(range(min(n, 8))), index)  # one-time costs are not throughput
    fast_times, loop_times, floor_times = [], [], []
    for _ in range(repeats):
        floor_times.append(forward_backward(env, state, data, batch_size))
        start = time.perf_counter()
        fast = entk_features(env.host, state, data, index, batch_size=batch_size)
        fast_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        slow = per_sample_loop(env.host, state, data, index)
        loop_times.append(time.perf_counter() - start)
    diff = float((fast - slow).abs().max())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    entk_features(env.host, state, data, index, batch_size=batch_size)
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    f, s, floor = statistics.median(fast_times), statistics.median(loop_times), statistics.median(floor_times)
    print(f"{name}: P={state.numel()} trainable parameters, p={len(index)}, n={n}, batch {batch_size}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"  batched {n / f:8.1f} samples/s   per-sample loop {n / s:8.1f} samples/s   max |diff| {diff:.2e}")
    print(f"  peak RSS growth of a batched pass {peak_mib:.1f} MiB; features {4 * 1000 * len(index) / 2**20:.1f} MiB "
          f"per 1000 samples (float32)")
    print(f"  batched forward + backward alone (no features formed) {n / floor:8.1f} samples/s = {s / floor:.2f}x "
          f"the loop: what batching gains on the passes themselves")
    print(f"RATIO {name} batched/loop samples per second = {s / f:.2f} (goal >= 10)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 samples, 1 repeat")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--features", type=int, default=10000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    n, repeats = (64, 1) if args.quick else (args.samples, args.repeats)
    images = "fashion_mnist" if fashion_mnist_available() and not args.quick else "digits"
    measure(f"small-cnn-full/{images}",
            RunConfig(tasks=[images], suite=None, base_model="hf-fedtask/small-cnn", peft_method="full", num_clients=1),
            n, args.features, repeats, batch_size=128)
    measure("minilm-lora/vader_polarity", RunConfig(tasks=["vader_polarity"], suite=None, num_clients=1),
            n, args.features, repeats, batch_size=64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
