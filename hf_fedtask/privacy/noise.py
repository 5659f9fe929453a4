"""The randomness of client-level DP, all drawn here: the Gaussian noise and the secret client sample.

Generator: the ChaCha20 keystream (RFC 8439) of `cryptography` (OpenSSL's implementation), a cryptographically
secure generator, as opacus' `secure_mode` uses one instead of torch's MT19937 (whose state can be recovered
from its outputs). Its 256-bit key is `os.urandom(32)` unless the run names a `dp_noise_seed` (reproducible
tests: whoever knows that seed can regenerate, hence subtract, the noise and knows the sample); the key is then
SHA-256 of the seed and the stream's ids (stream, round, client ...), so the streams stay apart. Each 64-bit
word of the keystream gives a uniform float64 of 53 bits, two uniforms give two Gaussians by the Box–Muller
transform. What this costs against `torch.randn`: see benchmarks/dp_noise_bench.py.

Not addressed: floating-point attacks on sampling the continuous Gaussian in finite precision (Mironov,
"On Significance of the Least Significant Bits for Differential Privacy", CCS 2012, for the Laplace
mechanism; Jin et al., "Are We There Yet? Timing and Floating-Point Attacks on Differential Privacy Systems",
S&P 2022, for the Gaussian). opacus' secure mode mitigates them by summing 2n = 4 draws (Holohan and Braghin,
"Secure Random Sampling in Differential Privacy", ESORICS 2021, §5.1); this module draws once. Exact discrete
Gaussians (Canonne, Kamath and Steinke, NeurIPS 2020) would remove them.

Central noise N(0, σ²C²) on a sum equals the sum of h independent shares N(0, σ²C²/h), one per contributor to
that sum (`share_std`): the server may add the shares itself or the contributors may each add theirs, which
composes with secure aggregation (the server then never sees a sum without the noise).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from hf_fedtask.core.taskvector import TaskVector

SERVER, CLIENTS = "server", "clients"
NOISE_MODES = (SERVER, CLIENTS)
# keep the server's noise, the clients' noise and the client sample apart
SERVER_STREAM, CLIENT_STREAM, SAMPLING_STREAM = 0, 1, 2
CHUNK = 1 << 20  # Box–Muller pairs drawn per step: bounded temporary memory for any tensor size
_SEGMENT_WORDS = (1 << 32) * 8  # 64-bit words under one nonce: ChaCha20's 32-bit block counter, 64-byte blocks
_TWO_PI = 2.0 * math.pi


class NoiseGenerator:
    """A ChaCha20 keystream under one 32-byte key, read as uniform 64-bit words, uniform floats in [0, 1) of 53
    bits, standard Gaussians (Box–Muller) and unbiased integers below a bound."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError(f"a ChaCha20 key has 32 bytes, got {len(key)}")
        self._key = key
        self._segment, self._left = -1, 0
        self._encryptor = None
        self._spare: np.ndarray = np.empty(0)  # a Box–Muller pair's unused second half

    def words(self, n: int) -> np.ndarray:
        """The next `n` keystream words as uint64."""
        parts = []
        while n > 0:
            if self._left == 0:  # a fresh nonce (counter 0) before the 32-bit block counter could wrap
                self._segment += 1
                nonce = (0).to_bytes(4, "little") + self._segment.to_bytes(12, "little")
                self._encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
                self._left = _SEGMENT_WORDS
            take = min(n, self._left)
            parts.append(np.frombuffer(self._encryptor.update(bytes(8 * take)), dtype="<u8"))
            self._left -= take
            n -= take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def uniform(self, n: int) -> np.ndarray:
        """`n` floats uniform on [0, 1), each the top 53 bits of a word (float64's whole mantissa)."""
        return (self.words(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def standard_normal(self, n: int) -> np.ndarray:
        """The next `n` N(0, 1) of the stream as float64, by Box–Muller: each pair of uniforms (u₁, u₂) gives
        √(−2 ln(1 − u₁))·(cos 2πu₂, sin 2πu₂), in that order, so the stream does not depend on how it is read."""
        out = np.empty(n)
        have = min(n, self._spare.size)
        out[:have], self._spare = self._spare[:have], self._spare[have:]
        while have < n:
            pairs = min(CHUNK, (n - have + 1) // 2)
            u = self.uniform(2 * pairs).reshape(pairs, 2)
            radius = np.sqrt(-2.0 * np.log1p(-u[:, 0]))  # 1 − u₁ in (0, 1]: the log is finite
            angle = _TWO_PI * u[:, 1]
            block = np.empty((pairs, 2))
            np.multiply(radius, np.cos(angle), out=block[:, 0])
            np.multiply(radius, np.sin(angle), out=block[:, 1])
            block = block.reshape(-1)
            take = min(block.size, n - have)
            out[have:have + take], self._spare = block[:take], block[take:].copy()
            have += take
        return out

    def randbelow(self, bound: int) -> int:
        """An integer uniform on [0, bound), by rejection (no modulo bias)."""
        if bound <= 0:
            raise ValueError(f"bound must be positive, got {bound}")
        limit = (1 << 64) - (1 << 64) % bound
        while True:
            word = int(self.words(1)[0])
            if word < limit:
                return word % bound


def noise_generator(seed: int | None, *ids: int) -> NoiseGenerator:
    """The generator of the stream (`ids`: stream, round, client ...): keyed by SHA-256 of `seed` and `ids` when a
    seed is given, else by 32 bytes of `os.urandom` (a secret no run setting reveals)."""
    if seed is None:
        return NoiseGenerator(os.urandom(32))
    material = b"hf_fedtask.privacy.noise\x00" + b"".join(int(v).to_bytes(16, "little", signed=True)
                                                          for v in (seed, *ids))
    return NoiseGenerator(hashlib.sha256(material).digest())


def share_std(noise_multiplier: float, clip: float, contributors: int) -> float:
    """The std of one of `contributors` shares that together make the central N(0, (σC)²)."""
    return noise_multiplier * clip / math.sqrt(max(contributors, 1))


def gaussian_like(tv: TaskVector, std: float, generator: NoiseGenerator) -> TaskVector:
    """N(0, std²) in the keys, shapes and (floating) dtypes of `tv`, drawn in its key order (scaled in float64)."""
    return TaskVector({k: torch.from_numpy((generator.standard_normal(t.numel()) * std).astype(np.float32))
                       .reshape(t.shape).to(t.dtype)
                       for k, t in tv.items() if t.is_floating_point()})


def add_noise(vectors: Mapping[str, TaskVector], stds: Mapping[str, float],
              generator: NoiseGenerator) -> dict[str, TaskVector]:
    """`vectors` with N(0, stds[name]²) added to each entry named in `stds` (in name order, so a seeded
    generator gives the same noise whatever order the entries came in); other entries untouched."""
    out = dict(vectors)
    for name in sorted(stds):
        if name in out and stds[name] > 0:
            noise = gaussian_like(out[name], stds[name], generator)
            out[name] = TaskVector({k: t + noise[k] if k in noise else t for k, t in out[name].items()})
    return out
