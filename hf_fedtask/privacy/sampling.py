"""The client sample of a DP run, drawn from secret randomness.

The accountant's amplification by subsampling (Wang, Balle and Kasiviswanathan 2019) holds against an adversary
who cannot tell which clients a round sampled. The run seed is public (run_config.yaml, every model card), so a
DP run never draws its sample from it: each round's m of the N eligible clients come from ChaCha20 keyed by
`os.urandom` (`noise.noise_generator`), or, when the run names `dp_noise_seed` (reproducible tests; anyone who
knows that seed also knows the noise and the samples, as the card says), from a stream derived from that seed.
The sampled ids are kept out of every published file (`report.private_record`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_fedtask.privacy.noise import SAMPLING_STREAM, noise_generator


def secret_sample(eligible: Sequence[int], size: int, round_: int, seed: int | None = None) -> list[int]:
    """`size` of `eligible` drawn uniformly without replacement (a partial Fisher–Yates shuffle on the
    `SAMPLING_STREAM` of round `round_`), sorted; all of them when `size` covers them."""
    pool = list(eligible)
    if size >= len(pool):
        return sorted(pool)
    generator = noise_generator(seed, SAMPLING_STREAM, round_)
    for i in range(size):
        j = i + generator.randbelow(len(pool) - i)
        pool[i], pool[j] = pool[j], pool[i]
    return sorted(pool[:size])
