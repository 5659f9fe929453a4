"""Secure aggregation with pairwise masks (Bonawitz et al., CCS 2017), for the FedYolo privacy variant.

The server only ever holds masked uploads and their running sum; the sum of the masked uploads of a
round's participants equals the sum of their plain updates, because the pairwise masks cancel.

How: each client encodes its float update as fixed-point integers in the ring Z_{2^64}
(:func:`encode_fixed_point`; int64 tensors, wrapping arithmetic), then adds, for every other
participant j, a pseudo-random mask expanded from a seed s_ij it shares with j: ``+PRG(s_ij)`` when
j > i, ``-PRG(s_ij)`` when j < i. s_ij is SHA-256 of the Diffie-Hellman secret ``g^(a_i a_j) mod p``
(RFC 3526 group 14), the round and the pair, so the server, which only relays public keys, cannot
compute it. The masks of each pair cancel in the sum, which :meth:`SecAggServer.finish` decodes
exactly: the result equals the sum of the fixed-point encodings bit for bit, and the float sum to
about ``num_clients / scale``.

Threat model and simplifications versus Bonawitz et al. (honest-but-curious server, simulation):

* no self-masks and no Shamir secret sharing: a client that drops out after the key exchange and
  before uploading is recovered by asking every surviving client for its pairwise seeds with the
  dropped clients only (:meth:`SecAggClient.reveal_pair_seeds`, seeds of that round only) and
  removing those masks from the sum. A client declared dropped whose upload arrives later is
  refused, since with its pairwise seeds revealed its masked update would be exposed. A survivor
  that disappears during recovery leaves the round unfinishable (Bonawitz's threshold shares would
  handle it);
* no signatures, no consistency checks and no authenticated channels: the server is trusted to relay
  public keys faithfully and not to lie about who dropped (it refuses late uploads itself);
* at least 2 uploads are required to finish (a "sum" of one update is that update), not a threshold t;
* Diffie-Hellman uses Python ints and ``pow()``: fine for simulation, NOT constant-time production
  cryptography. Secrets derive from caller-provided seeds so simulations are deterministic; the
  mask PRG is numpy's PCG64, which is not a cryptographic PRG (use an AES-CTR/ChaCha20 stream in
  production).

Hand-written: no well-kept PyPI library implements pairwise-mask secure aggregation for torch
tensors (the existing ones are framework-bound research code or unmaintained).

Errors: :class:`hf_fedtask.errors.SecAggError`, a protocol error (one line naming the client and the
key at fault).
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import SecAggError

__all__ = [
    "DEFAULT_SCALE",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "decode_fixed_point",
    "encode_fixed_point",
    "secure_sum",
]

DEFAULT_SCALE = 2**24
# Fixed-point values of a whole round's sum stay below 2**62 in magnitude, far from int64 wrap-around.
OVERFLOW_LIMIT = 2**62

# RFC 3526, 2048-bit MODP group (group 14): a safe prime p = 2q + 1; g = 2 generates the order-q subgroup.
MODP_2048_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
MODP_2048_G = 2
_Q = (MODP_2048_P - 1) // 2
_P_BYTES = (MODP_2048_P.bit_length() + 7) // 8
# Private exponents of 320 bits: ~160-bit security against discrete-log attacks on the exponent,
# above the ~112 bits of the 2048-bit group, at an eighth of the cost of full-size exponents.
_EXPONENT_BITS = 320


class PairSeedRevealer(Protocol):
    """What the server needs from a surviving client at recovery: a :class:`SecAggClient` or an RPC stub."""

    def reveal_pair_seeds(self, dropped_ids: Iterable[int], round: int) -> dict[int, bytes]: ...


# Fixed-point encoding


def encode_fixed_point(
    update: Mapping[str, torch.Tensor], *, scale: float = DEFAULT_SCALE, num_clients: int = 1, source: str = "update"
) -> TaskVector:
    """``round(x * scale)`` as int64, refusing (naming the key) values that could overflow a sum of
    ``num_clients`` updates, i.e. ``|x| * scale * num_clients >= 2**62``, and NaN/Inf."""
    scale = _check_scale(scale)
    out = {}
    for key, t in update.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype).removeprefix("torch.")
            raise SecAggError(f"{source}: key {key!r} is {kind}, expected a floating-point tensor")
        x = t.detach().cpu().to(torch.float64)
        if not torch.isfinite(x).all():
            raise SecAggError(f"{source}: key {key!r} has NaN or Inf values")
        peak = x.abs().max().item() if x.numel() else 0.0
        if peak * scale * num_clients >= OVERFLOW_LIMIT:
            raise SecAggError(
                f"{source}: key {key!r} has |value| up to {peak:.4g}, which at scale {scale:g} over {num_clients} "
                f"client(s) could overflow the 2**62 fixed-point range; clip the update or lower the scale"
            )
        out[key] = torch.round(x * scale).to(torch.int64)
    return TaskVector(out)


def decode_fixed_point(encoded: Mapping[str, torch.Tensor], *, scale: float = DEFAULT_SCALE) -> TaskVector:
    """Inverse of :func:`encode_fixed_point` for a (summed) int64 vector: ``x / scale`` as float32."""
    scale = _check_scale(scale)
    return TaskVector({k: (t.to(torch.float64) / scale).to(torch.float32) for k, t in encoded.items()})


def ring_add_(acc: torch.Tensor, other: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """``acc += sign * other`` in Z_{2^64}, in place on int64 ``acc``.

    Done on uint64 views through numpy, whose unsigned wrap-around is well defined (signed overflow is
    undefined behaviour in the C++ kernels, although torch wraps in practice).
    """
    a = acc.numpy().view(np.uint64)
    b = other.detach().cpu().contiguous().numpy().view(np.uint64)
    (np.add if sign > 0 else np.subtract)(a, b.reshape(a.shape), out=a)
    return acc


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return scale


# Key agreement and masks


def _check_id(client_id: Any, what: str = "client id") -> int:
    if isinstance(client_id, bool) or not isinstance(client_id, int) or not 0 <= client_id < 2**63:
        raise ValueError(f"{what} must be an int in [0, 2**63), got {client_id!r}")
    return client_id


@functools.lru_cache(maxsize=4096)
def _valid_public_key(y: int) -> bool:
    """Full public-key validation: 1 < y < p - 1 and y in the order-q subgroup (no small-subgroup leak)."""
    return 1 < y < MODP_2048_P - 1 and pow(y, _Q, MODP_2048_P) == 1


def _check_public_key(y: Any, owner: str) -> int:
    if isinstance(y, bool) or not isinstance(y, int) or not _valid_public_key(y):
        raise SecAggError(f"{owner}: invalid Diffie-Hellman public key "
                          "(not an element of the RFC 3526 group 14 subgroup)")
    return y


def _seed_bytes(seed: int | bytes | str) -> bytes:
    if isinstance(seed, (bytes, bytearray)):
        return b"b" + bytes(seed)
    if isinstance(seed, str):
        return b"s" + seed.encode()
    if isinstance(seed, int) and not isinstance(seed, bool):
        return b"i" + str(seed).encode()
    raise TypeError(f"seed must be an int, bytes or str, got {type(seed).__name__}")


def _pair_seed(shared: int, round: int, i: int, j: int) -> bytes:
    lo, hi = min(i, j), max(i, j)
    material = b"hf_fedtask.secagg.pair-seed\x00" + shared.to_bytes(_P_BYTES, "big")
    material += round.to_bytes(8, "big") + lo.to_bytes(8, "big") + hi.to_bytes(8, "big")
    return hashlib.sha256(material).digest()


def _expand_mask(seed: bytes, template: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Uniform int64 masks for every key of ``template`` (key -> tensor or shape), one PCG64 stream over
    the keys in sorted order, so both ends of a pair (and the server at recovery) expand the same masks."""
    shapes = {k: _shape(template[k]) for k in sorted(template)}
    sizes = [math.prod(s) for s in shapes.values()]
    raw = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "big"))).bit_generator.random_raw(sum(sizes))
    flat = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint64).view(np.int64))
    return {k: piece.reshape(shape) for (k, shape), piece in zip(shapes.items(), torch.split(flat, sizes))}


def _shape(ref: Any) -> tuple[int, ...]:
    return tuple(ref.shape) if isinstance(ref, torch.Tensor) else tuple(int(d) for d in ref)


def _sign(i: int, j: int) -> int:
    """Client i adds the pair (i, j) mask when j > i and subtracts it when j < i."""
    return 1 if j > i else -1


class SecAggClient:
    """One client: its Diffie-Hellman secret (derived from ``seed`` and ``client_id``), its public key,
    masking of its update and, at recovery, the pairwise seeds with dropped peers.

    ``seed=None`` draws a random secret. In a simulation all clients may share one seed: the client id
    is mixed in. ``scale`` must match the server's.
    """

    def __init__(self, client_id: int, seed: int | bytes | str | None = None, *, scale: float = DEFAULT_SCALE):
        self.client_id = _check_id(client_id)
        self.scale = _check_scale(scale)
        material = secrets.token_bytes(32) if seed is None else _seed_bytes(seed)
        digest = hashlib.shake_256(
            b"hf_fedtask.secagg.dh-secret\x00" + material + b"\x00" + self.client_id.to_bytes(8, "big")
        ).digest(_EXPONENT_BITS // 8)
        self._secret = int.from_bytes(digest, "big") | (1 << (_EXPONENT_BITS - 1))
        self._public_key = pow(MODP_2048_G, self._secret, MODP_2048_P)
        self._rounds: dict[int, dict[int, int]] = {}  # round -> peers' public keys used to mask it

    def __repr__(self) -> str:
        return f"SecAggClient({self.client_id})"

    @property
    def public_key(self) -> int:
        """``g^a mod p``, sent to the server, which relays it to the round's other participants."""
        return self._public_key

    def _seed_with(self, peer: int, round: int) -> bytes:
        shared = pow(self._rounds[round][peer], self._secret, MODP_2048_P)
        return _pair_seed(shared, round, self.client_id, peer)

    def mask(self, update: Mapping[str, torch.Tensor], round: int, peers: Mapping[int, int]) -> TaskVector:
        """The masked upload: fixed-point ``update`` plus the pairwise masks with every peer, as int64.

        ``peers`` maps each participant of the round (this client may be included) to its public key.
        A round can be masked once: two uploads under the same masks would reveal their difference.
        """
        round = _check_id(round, "round")
        if round in self._rounds:
            raise SecAggError(f"client {self.client_id}: round {round} was already masked; masks are single-use")
        others = {}
        for peer, key in peers.items():
            peer = _check_id(peer, "peer id")
            if peer == self.client_id:
                if key != self._public_key:
                    raise SecAggError(f"client {self.client_id}: the peer list holds a different public key for it")
                continue
            others[peer] = _check_public_key(key, f"client {self.client_id}: peer {peer}")
        if not others:
            raise SecAggError(
                f"client {self.client_id}: round {round} has no other participant; at least 2 clients are needed "
                "(a sum of one update is that update)"
            )
        source = f"client {self.client_id}"
        encoded = encode_fixed_point(update, scale=self.scale, num_clients=len(others) + 1, source=source)
        self._rounds[round] = others
        for peer in sorted(others):
            for key, m in _expand_mask(self._seed_with(peer, round), encoded).items():
                ring_add_(encoded[key], m, _sign(self.client_id, peer))
        metadata = {"client_id": str(self.client_id), "round": str(round), "secagg_scale": repr(float(self.scale))}
        return TaskVector(dict(encoded), metadata)

    def reveal_pair_seeds(self, dropped_ids: Iterable[int], round: int,
                          peers: Mapping[int, int] | None = None) -> dict[int, bytes]:
        """The round's pairwise seeds with the dropped peers only (server-side recovery of their masks).

        Refused for this client itself, for ids that were not its peers in that round, and for a round
        it did not mask. `peers` (the round's public keys) lets a client process that did not mask
        the round itself (a restarted one, holding the same secret) answer.
        """
        if round not in self._rounds and peers is not None:
            self._rounds[round] = {_check_id(p, "peer id"): _check_public_key(k, f"client {self.client_id}: peer {p}")
                                   for p, k in peers.items() if p != self.client_id}
        if round not in self._rounds:
            raise SecAggError(f"client {self.client_id}: round {round} was not masked by this client")
        out = {}
        for peer in dropped_ids:
            if peer == self.client_id:
                raise SecAggError(f"client {self.client_id}: refusing to reveal its seeds as a dropped client")
            if peer not in self._rounds[round]:
                raise SecAggError(f"client {self.client_id}: client {peer!r} was not a peer in round {round}")
            out[peer] = self._seed_with(peer, round)
        return out


class SecAggServer:
    """The aggregator of one round: relays public keys, adds masked int64 uploads into a running ring sum
    (it keeps no individual upload), recovers dropped clients' masks, and decodes the float32 sum.

    ``template`` maps every key to a tensor or a shape; uploads must match it exactly.
    """

    def __init__(self, template: Mapping[str, Any], round: int, *, scale: float = DEFAULT_SCALE):
        self.round = _check_id(round, "round")
        self.scale = _check_scale(scale)
        self._shapes = {k: _shape(v) for k, v in template.items()}
        self._sum: dict[str, torch.Tensor] | None = {k: torch.zeros(s, dtype=torch.int64)
                                                     for k, s in self._shapes.items()}
        self._public_keys: dict[int, int] = {}
        self._received: set[int] = set()
        self._dropped: frozenset[int] | None = None  # set when uploads close at finish()
        self._result: TaskVector | None = None

    @property
    def public_keys(self) -> dict[int, int]:
        """Client id -> public key of every registered participant: what each client masks against."""
        return dict(self._public_keys)

    @property
    def received(self) -> frozenset[int]:
        """Ids of the clients whose uploads were added to the sum."""
        return frozenset(self._received)

    @property
    def dropped(self) -> frozenset[int] | None:
        """Participants declared dropped when uploads closed (None while uploads are open)."""
        return self._dropped

    def register(self, client_id: int, public_key: int) -> None:
        """Key exchange: record a participant's public key (before any upload)."""
        client_id = _check_id(client_id)
        if self._received or self._dropped is not None:
            raise SecAggError(f"round {self.round}: client {client_id} registered after the key exchange was over")
        if client_id in self._public_keys:
            raise SecAggError(f"round {self.round}: client {client_id} is already registered")
        self._public_keys[client_id] = _check_public_key(public_key, f"round {self.round}: client {client_id}")

    def receive(self, client_id: int, masked: Mapping[str, torch.Tensor]) -> None:
        """Check a masked upload (keys, shapes, int64 dtype, header) and add it to the running sum."""
        who = f"round {self.round}: client {client_id}"
        if self._dropped is not None and client_id in self._dropped:
            raise SecAggError(
                f"{who} was declared dropped and its pairwise seeds were revealed; its late upload is refused "
                "because its masked update would be exposed"
            )
        if self._dropped is not None:
            raise SecAggError(f"{who}: uploads are closed")
        if client_id not in self._public_keys:
            raise SecAggError(f"{who} is not a participant (it did not register a public key)")
        if client_id in self._received:
            raise SecAggError(f"{who} already uploaded")
        if not isinstance(masked, Mapping):
            raise SecAggError(f"{who}: upload is a {type(masked).__name__}, expected a TaskVector")
        if isinstance(masked, TaskVector):
            header = masked.raw_metadata
            expected = {"client_id": str(client_id), "round": str(self.round), "secagg_scale": repr(float(self.scale))}
            for field, value in expected.items():
                if field in header and header[field] != value:
                    raise SecAggError(f"{who}: header {field!r} is {header[field]!r}, expected {value!r}")
        for key in self._shapes:
            if key not in masked:
                raise SecAggError(f"{who}: key {key!r} is missing (the template has it)")
        for key, t in masked.items():
            if key not in self._shapes:
                raise SecAggError(f"{who}: unexpected key {key!r} (not in the template)")
            if not isinstance(t, torch.Tensor):
                raise SecAggError(f"{who}: key {key!r} is a {type(t).__name__}, expected an int64 tensor")
            if t.is_floating_point() or t.is_complex():
                raise SecAggError(
                    f"{who}: key {key!r} is a {str(t.dtype).removeprefix('torch.')} tensor; float uploads are "
                    "unmasked and refused"
                )
            if t.dtype != torch.int64:
                raise SecAggError(f"{who}: key {key!r} has dtype {str(t.dtype).removeprefix('torch.')}, expected int64")
            if tuple(t.shape) != self._shapes[key]:
                raise SecAggError(f"{who}: key {key!r} has shape {tuple(t.shape)}, expected {self._shapes[key]}")
        for key, acc in self._sum.items():
            ring_add_(acc, masked[key])
        self._received.add(client_id)

    def finish(self, survivors: Mapping[int, PairSeedRevealer] | None = None) -> TaskVector:
        """Close uploads, remove dropped clients' masks and return the float32 sum of the uploaded updates.

        Registered clients that did not upload are declared dropped; each surviving client in
        ``survivors`` (id -> object with ``reveal_pair_seeds``; needed only when someone dropped) is
        asked for its seeds with them. Refused with fewer than 2 uploads, before anything is revealed.
        """
        if self._result is not None:
            return self._result
        if len(self._received) < 2:
            raise SecAggError(
                f"round {self.round}: only {len(self._received)} client(s) uploaded {sorted(self._received)}; at "
                "least 2 are needed (a sum of one update is that update)"
            )
        self._dropped = frozenset(self._public_keys) - self._received
        dropped = sorted(self._dropped)
        reveals = {}
        if dropped:
            missing = sorted(self._received - set(survivors or {}))
            if missing:
                raise SecAggError(
                    f"round {self.round}: clients {dropped} dropped; surviving client {missing[0]} must be given to "
                    "finish() to reveal its pairwise seeds with them"
                )
            for i in sorted(self._received):
                seeds = survivors[i].reveal_pair_seeds(dropped, self.round)
                if not isinstance(seeds, Mapping) or set(seeds) != set(dropped):
                    raise SecAggError(f"round {self.round}: client {i} did not reveal its seeds for exactly {dropped}")
                for j, seed in seeds.items():
                    if not isinstance(seed, bytes) or len(seed) != 32:
                        raise SecAggError(f"round {self.round}: client {i} revealed a malformed seed for client {j}")
                reveals[i] = seeds
        for i, seeds in reveals.items():
            for j, seed in seeds.items():
                for key, m in _expand_mask(seed, self._shapes).items():
                    ring_add_(self._sum[key], m, -_sign(i, j))
        self._result = decode_fixed_point(self._sum, scale=self.scale)
        self._sum = None
        return self._result


def secure_sum(
    updates: Mapping[int, Mapping[str, torch.Tensor]],
    round: int,
    seed: int | bytes | str,
    dropped: Iterable[int] = (),
    *,
    scale: float = DEFAULT_SCALE,
) -> TaskVector:
    """Run one round of the protocol in-process: the float32 sum of the updates of the clients not in
    ``dropped`` (which take part in the key exchange, then never upload). Deterministic in ``seed``."""
    dropped = set(dropped)
    unknown = sorted(dropped - set(updates), key=repr)
    if unknown:
        raise ValueError(f"dropped client {unknown[0]!r} has no update")
    survivors = [cid for cid in updates if cid not in dropped]
    template = updates[survivors[0]] if survivors else next(iter(updates.values()), {})
    server = SecAggServer(template, round, scale=scale)
    clients = {cid: SecAggClient(cid, seed, scale=scale) for cid in updates}
    for cid, client in clients.items():
        server.register(cid, client.public_key)
    peers = server.public_keys
    for cid in survivors:
        server.receive(cid, clients[cid].mask(updates[cid], round, peers))
    return server.finish({cid: clients[cid] for cid in survivors})
