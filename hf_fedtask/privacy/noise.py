"""The Gaussian noise of client-level DP and where it comes from.

The noise must not be derivable from the public run seed (it is published in config.yaml and the model
card), so it is drawn from a `torch.Generator` seeded by `os.urandom` unless the run names a
`dp_noise_seed` (reproducible tests: whoever knows that seed can subtract the noise). Central noise
N(0, σ²C²) on a sum equals the sum of h independent shares N(0, σ²C²/h), one per contributor to that
sum (`share_std`): the server may add the shares itself or the contributors may each add theirs, which
composes with secure aggregation (the server then never sees a sum without the noise).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np
import torch

from hf_fedtask.core.taskvector import TaskVector

SERVER, CLIENTS = "server", "clients"
NOISE_MODES = (SERVER, CLIENTS)
SERVER_STREAM, CLIENT_STREAM = 0, 1  # keep the server's and the clients' noise streams apart


def noise_generator(seed: int | None, *ids: int) -> torch.Generator:
    """A CPU generator for the noise of (`ids`: stream, round, client ...): seeded from `seed` and `ids` when
    a seed is given, else from 8 bytes of `os.urandom` (a secret no run setting reveals)."""
    if seed is None:
        state = int.from_bytes(os.urandom(8), "little")
    else:
        state = int(np.random.SeedSequence([seed, *ids]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device="cpu").manual_seed(state)


def share_std(noise_multiplier: float, clip: float, contributors: int) -> float:
    """The std of one of `contributors` shares that together make the central N(0, (σC)²)."""
    return noise_multiplier * clip / math.sqrt(max(contributors, 1))


def gaussian_like(tv: TaskVector, std: float, generator: torch.Generator) -> TaskVector:
    """N(0, std²) in the keys, shapes and (floating) dtypes of `tv`, drawn in its key order in float32."""
    return TaskVector({k: (torch.randn(t.shape, generator=generator, dtype=torch.float32) * std).to(t.dtype)
                       for k, t in tv.items() if t.is_floating_point()})


def add_noise(vectors: Mapping[str, TaskVector], stds: Mapping[str, float],
              generator: torch.Generator) -> dict[str, TaskVector]:
    """`vectors` with N(0, stds[name]²) added to each entry named in `stds` (in name order, so a seeded
    generator gives the same noise whatever order the entries came in); other entries untouched."""
    out = dict(vectors)
    for name in sorted(stds):
        if name in out and stds[name] > 0:
            noise = gaussian_like(out[name], stds[name], generator)
            out[name] = TaskVector({k: t + noise[k] if k in noise else t for k, t in out[name].items()})
    return out
