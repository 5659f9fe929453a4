"""What the DP noise's secure generator costs: `hf_fedtask.privacy.noise` (ChaCha20 keystream of `cryptography`,
53-bit uniforms, Box–Muller in float64, scaled and cast to float32) against `torch.randn` from a seeded
`torch.Generator` (MT19937, float32), the generator it replaced, for the Gaussian noise of one vector of N floats.

Both draw N(0, std²) into a float32 tensor of N entries, as `privacy.noise.gaussian_like` does for one tensor
of an upload; time = the best of `--repeat` wall times, one torch thread (`torch.set_num_threads(1)`, as on a
shared box; numpy's and OpenSSL's parts are single-threaded anyway).

    python benchmarks/dp_noise_bench.py            # N = 1M and 10M, best of 5
    python benchmarks/dp_noise_bench.py --quick    # N = 100k and 1M, best of 2

Prints, per N, `RATIO chacha20/torch_randn time (N floats) = r` and the two times. The noise is drawn once per
upload entry per round (the server's, or each client's share), so at LoRA sizes (10^5-10^7 parameters) it
stays well below a round's local training.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.privacy.noise import gaussian_like, noise_generator


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 100k and 1M, best of 2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    sizes, repeat = ([100_000, 1_000_000], 2) if args.quick else (args.sizes, args.repeat)
    torch.set_num_threads(1)
    std = 0.37
    for n in sizes:
        tv = TaskVector({"w": torch.zeros(n)})
        mt = torch.Generator(device="cpu").manual_seed(0)
        torch_time = best_time(lambda: torch.randn(n, generator=mt, dtype=torch.float32) * std, repeat)
        chacha = noise_generator(0, 0, 1)
        ours_time = best_time(lambda: gaussian_like(tv, std, chacha), repeat)
        sample = gaussian_like(tv, std, noise_generator(None))["w"]
        assert sample.dtype == torch.float32 and abs(sample.std().item() / std - 1) < 0.05, sample.std()
        print(f"N = {n:,}: torch.randn {torch_time * 1e3:.1f} ms, ChaCha20 + Box–Muller {ours_time * 1e3:.1f} ms")
        print(f"RATIO chacha20/torch_randn time ({n} floats) = {ours_time / torch_time:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
