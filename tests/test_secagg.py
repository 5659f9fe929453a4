"""Secure aggregation: exact sums, masked uploads, a server that holds only the sum, dropout recovery."""

import numpy as np
import pytest
import torch

from hf_fedtask.core import secagg
from hf_fedtask.core.secagg import (
    DEFAULT_SCALE,
    SecAggClient,
    SecAggServer,
    decode_fixed_point,
    encode_fixed_point,
    ring_add_,
    secure_sum,
)
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.errors import FedTaskError, ProtocolError, SecAggError

SHAPES = {"lora_A.weight": (4, 16), "lora_B.weight": (16, 4), "bias": (7,), "scalar": ()}


def random_update(seed, shapes=SHAPES, std=1.0):
    gen = torch.Generator().manual_seed(seed)
    return TaskVector({k: torch.randn(s, generator=gen) * std for k, s in shapes.items()})


@pytest.fixture(scope="module")
def updates():
    return {cid: random_update(cid) for cid in range(5)}


def plain_sum(updates, ids):
    return TaskVector({k: sum(updates[i][k].double() for i in ids).float() for k in SHAPES})


def setup_round(updates, round=3, seed=7, dropped=()):
    """Key exchange done, survivors' masked uploads made (not yet sent): (server, clients, masked)."""
    server = SecAggServer(next(iter(updates.values())), round)
    clients = {cid: SecAggClient(cid, seed) for cid in updates}
    for cid, c in clients.items():
        server.register(cid, c.public_key)
    peers = server.public_keys
    masked = {cid: clients[cid].mask(updates[cid], round, peers) for cid in updates if cid not in dropped}
    return server, clients, masked


def test_ring_arithmetic_wraps():
    top = torch.tensor([2**63 - 1, -(2**63), 5], dtype=torch.int64)
    acc = top.clone()
    ring_add_(acc, torch.tensor([1, -1, -10], dtype=torch.int64))
    assert acc.tolist() == [-(2**63), 2**63 - 1, -5]
    ring_add_(acc, torch.tensor([1, -1, -10], dtype=torch.int64), -1)
    assert torch.equal(acc, top)
    # torch's own int64 add/sub wrap the same way
    assert (top + 1).tolist()[:2] == [-(2**63), -(2**63) + 1] and (top - 1).tolist()[1] == 2**63 - 1


def test_secure_sum_equals_plain_sum(updates):
    result = secure_sum(updates, round=1, seed=0)
    assert list(result) == list(SHAPES) and all(v.dtype == torch.float32 for v in result.values())
    expected = plain_sum(updates, range(5))
    for k in SHAPES:
        torch.testing.assert_close(result[k], expected[k], rtol=1e-6, atol=5 / DEFAULT_SCALE)
    # deterministic in the seed, and the masks (not the result) depend on it
    assert all(torch.equal(result[k], secure_sum(updates, round=1, seed=123)[k]) for k in SHAPES)


def test_masks_cancel_exactly_in_the_ring(updates):
    """The decoded aggregate equals the decoded sum of the fixed-point encodings bit for bit."""
    result = secure_sum(updates, round=2, seed=5)
    encoded = [encode_fixed_point(u, num_clients=5) for u in updates.values()]
    ring = {k: sum(e[k] for e in encoded) for k in SHAPES}
    reference = decode_fixed_point(ring)
    assert all(torch.equal(result[k], reference[k]) for k in SHAPES)


def test_masked_uploads_look_nothing_like_the_updates():
    shapes = {"a": (64, 64), "b": (1000,)}
    ups = {cid: random_update(cid, shapes, std=0.01) for cid in range(3)}
    server, _, masked = setup_round(ups)
    for cid, m in masked.items():
        assert set(m) == set(shapes) and all(v.dtype == torch.int64 for v in m.values())
        assert m.metadata["round"] == 3 and m.metadata["client_id"] == str(cid)
        plain = encode_fixed_point(ups[cid], num_clients=3)
        flat, plain_flat = m.flatten(), plain.flatten()
        assert (flat == plain_flat).float().mean() < 1e-3
        # the fixed-point update is small (high bits are all sign bits); the masked bits are uniform
        bits = flat.numpy().view(np.uint64)
        for b in range(48, 64):
            freq = ((bits >> np.uint64(b)) & np.uint64(1)).mean()
            assert abs(freq - 0.5) < 0.05, (cid, b, freq)
        assert plain_flat.abs().max() < 2**24
    # two clients' uploads differ from each other too, and a new round gives new masks
    assert not torch.equal(masked[0]["a"], masked[1]["a"])
    client = SecAggClient(0, 7)
    again = client.mask(ups[0], 4, server.public_keys)
    assert (again["a"] != masked[0]["a"]).float().mean() > 0.999


def test_server_only_holds_the_running_sum(updates, monkeypatch):
    seen_dtypes = []
    original = SecAggServer.receive

    def instrumented(self, client_id, masked):
        seen_dtypes.extend(t.dtype for t in masked.values())
        upload_ptrs = {t.untyped_storage().data_ptr() for t in masked.values()}
        original(self, client_id, masked)
        held = list(_tensors_in(vars(self)))
        sums = list(self._sum.values())
        assert len(held) == len(sums) and all(any(h is s for s in sums) for h in held)
        assert not {h.untyped_storage().data_ptr() for h in held} & upload_ptrs
        assert not any(v is masked for v in vars(self).values())

    monkeypatch.setattr(SecAggServer, "receive", instrumented)
    secure_sum(updates, round=1, seed=0, dropped=(4,))
    assert seen_dtypes and set(seen_dtypes) == {torch.int64}


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _tensors_in(v)
    elif isinstance(obj, TaskVector):
        yield from obj.values()


def test_float_upload_refused(updates):
    server, _, masked = setup_round({0: updates[0], 1: updates[1]})
    with pytest.raises(SecAggError, match=r"client 1: key 'lora_A.weight' is a float32 tensor; float uploads"):
        server.receive(1, updates[1])
    half = dict(masked[0], bias=masked[0]["bias"].to(torch.float64))
    with pytest.raises(SecAggError, match=r"client 0: key 'bias' is a float64"):
        server.receive(0, half)
    with pytest.raises(SecAggError, match=r"client 0: key 'bias' has dtype int32, expected int64"):
        server.receive(0, dict(masked[0], bias=masked[0]["bias"].to(torch.int32)))
    # nothing was added by the refused uploads: the round still sums correctly
    server.receive(0, masked[0])
    server.receive(1, masked[1])
    torch.testing.assert_close(server.finish()["bias"], plain_sum(updates, [0, 1])["bias"], rtol=1e-6, atol=1e-6)


def test_dropout_recovery_and_late_upload_refused(updates):
    expected = plain_sum(updates, [0, 1, 3, 4])
    result = secure_sum(updates, round=9, seed=1, dropped=[2])
    for k in SHAPES:
        torch.testing.assert_close(result[k], expected[k], rtol=1e-6, atol=4 / DEFAULT_SCALE)

    server, clients, masked = setup_round(updates, dropped=(2,))
    for cid, m in masked.items():
        server.receive(cid, m)
    with pytest.raises(SecAggError, match=r"clients \[2\] dropped; surviving client 0 must be given"):
        server.finish()
    assert server.dropped == frozenset({2})
    late = clients[2].mask(updates[2], 3, server.public_keys)
    with pytest.raises(SecAggError, match=r"client 2 was declared dropped .* late upload is refused"):
        server.receive(2, late)
    result = server.finish({cid: clients[cid] for cid in masked})
    assert all(torch.equal(result[k], secure_sum(updates, 3, 7, dropped=[2])[k]) for k in SHAPES)
    with pytest.raises(SecAggError, match=r"client 2 was declared dropped"):
        server.receive(2, late)
    with pytest.raises(SecAggError, match="uploads are closed"):
        server.receive(0, masked[0])


def test_pair_seeds_are_shared_and_reveal_is_restricted(updates):
    _, clients, _ = setup_round(updates)
    assert clients[0].reveal_pair_seeds([3], 3)[3] == clients[3].reveal_pair_seeds([0], 3)[0]
    assert clients[0].reveal_pair_seeds([3], 3)[3] != clients[0].reveal_pair_seeds([4], 3)[4]
    with pytest.raises(SecAggError, match="client 0: refusing"):
        clients[0].reveal_pair_seeds([0], 3)
    with pytest.raises(SecAggError, match="client 42 was not a peer in round 3"):
        clients[0].reveal_pair_seeds([42], 3)
    with pytest.raises(SecAggError, match="round 8 was not masked"):
        clients[0].reveal_pair_seeds([1], 8)
    with pytest.raises(SecAggError, match="already masked"):
        clients[0].mask(updates[0], 3, {1: clients[1].public_key})
    # the server cannot derive a pair seed from the public keys alone, and different seeds give different keys
    assert SecAggClient(0, 7).public_key == clients[0].public_key != SecAggClient(0, 8).public_key
    assert clients[0].public_key != clients[1].public_key


def test_fewer_than_two_survivors_refused(updates):
    two = {0: updates[0], 1: updates[1], 2: updates[2]}
    with pytest.raises(SecAggError, match=r"only 1 client\(s\) uploaded \[0\]; at least 2 are needed"):
        secure_sum(two, round=0, seed=0, dropped=[1, 2])
    with pytest.raises(SecAggError, match="only 0 client"):
        secure_sum(two, round=0, seed=0, dropped=[0, 1, 2])
    with pytest.raises(SecAggError, match="no other participant; at least 2 clients"):
        secure_sum({0: updates[0]}, round=0, seed=0)
    # refused before any seed is revealed: the server can still take the missing upload
    server, clients, masked = setup_round(two, dropped=(1, 2))
    server.receive(0, masked[0])
    with pytest.raises(SecAggError, match="at least 2"):
        server.finish({0: clients[0]})
    assert server.dropped is None
    server.receive(1, clients[1].mask(two[1], 3, server.public_keys))
    server.receive(2, clients[2].mask(two[2], 3, server.public_keys))
    torch.testing.assert_close(server.finish()["bias"], plain_sum(two, [0, 1, 2])["bias"], rtol=1e-6, atol=1e-6)


def test_overflow_refused_naming_the_key(updates):
    big = dict(updates[1], **{"lora_B.weight": updates[1]["lora_B.weight"] * 0 + 1e12})
    with pytest.raises(SecAggError, match=r"client 1: key 'lora_B.weight' has \|value\| up to 1e\+12.*overflow"):
        secure_sum({0: updates[0], 1: TaskVector(big)}, round=0, seed=0)
    limit = 2**62 / DEFAULT_SCALE
    encode_fixed_point({"x": torch.tensor([limit / 2 * 0.99])}, num_clients=2)
    with pytest.raises(SecAggError, match="key 'x'"):
        encode_fixed_point({"x": torch.tensor([limit / 2])}, num_clients=2)
    with pytest.raises(SecAggError, match="key 'n' has NaN"):
        encode_fixed_point({"n": torch.tensor([float("nan")])})
    with pytest.raises(SecAggError, match="key 'i' is int64, expected a floating-point"):
        encode_fixed_point({"i": torch.tensor([1])})
    # a smaller scale makes room
    result = secure_sum({0: TaskVector({"x": torch.tensor([1e6])}), 1: TaskVector({"x": torch.tensor([2e6])})},
                        round=0, seed=0, scale=2**8)
    assert result["x"].item() == 3e6


def test_wrong_keys_and_shapes_refused(updates):
    server, clients, masked = setup_round({0: updates[0], 1: updates[1]})
    m = dict(masked[1])
    with pytest.raises(SecAggError, match=r"client 1: key 'bias' is missing"):
        server.receive(1, {k: v for k, v in m.items() if k != "bias"})
    with pytest.raises(SecAggError, match=r"client 1: unexpected key 'extra'"):
        server.receive(1, dict(m, extra=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(SecAggError, match=r"client 1: key 'lora_A.weight' has shape \(16, 4\), expected \(4, 16\)"):
        server.receive(1, dict(m, **{"lora_A.weight": m["lora_A.weight"].reshape(16, 4)}))
    with pytest.raises(SecAggError, match=r"client 7 is not a participant"):
        server.receive(7, masked[1])
    with pytest.raises(SecAggError, match=r"client 0: header 'client_id' is '1'"):
        server.receive(0, masked[1])
    other_round = SecAggClient(1, 99).mask(updates[1], 4, {0: clients[0].public_key})
    with pytest.raises(SecAggError, match=r"client 1: header 'round' is '4', expected '3'"):
        server.receive(1, other_round)
    server.receive(1, TaskVector.from_bytes(masked[1].to_bytes()))  # the wire format round-trips
    with pytest.raises(SecAggError, match="client 1 already uploaded"):
        server.receive(1, masked[1])
    with pytest.raises(SecAggError, match="after the key exchange"):
        server.register(5, SecAggClient(5, 0).public_key)


def test_errors_and_key_validation():
    assert issubclass(SecAggError, FedTaskError) and issubclass(SecAggError, ValueError)
    assert issubclass(SecAggError, ProtocolError) and secagg.SecAggError is SecAggError  # still importable there
    server = SecAggServer(SHAPES, 0)
    with pytest.raises(SecAggError, match="client 3: invalid Diffie-Hellman public key"):
        server.register(3, secagg.MODP_2048_P - 1)  # order 2: would leak the secret's parity
    with pytest.raises(SecAggError, match="client 4: invalid"):
        server.register(4, 1)
    server.register(1, SecAggClient(1, 0).public_key)
    with pytest.raises(SecAggError, match="already registered"):
        server.register(1, SecAggClient(1, 0).public_key)
    with pytest.raises(ValueError, match="scale must be a positive"):
        SecAggServer(SHAPES, 0, scale=0)
    with pytest.raises(ValueError, match="dropped client 9 has no update"):
        secure_sum({0: random_update(0), 1: random_update(1)}, 0, 0, dropped=[9])
