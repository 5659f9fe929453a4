"""Merge operators: equality with peft.utils.merge_utils on random inputs, bit-equality of the streaming
merges with their stacked definitions (odd sizes, chunk boundaries, ties at thresholds), edge cases."""

import pytest
import torch
from peft.utils import merge_utils as peft_merge

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import (
    agreement_mask,
    magnitude_prune,
    sign_similarity,
    task_arithmetic,
    ties,
    unify,
    weighted_average,
)


def _vectors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [TaskVector({"a": torch.randn(6, 5, generator=g), "b": torch.randn(7, generator=g)}) for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_task_arithmetic_equals_peft(seed):
    vs, w = _vectors(4, seed), [0.5, 1.0, 2.0, -0.3]
    got = task_arithmetic(vs, w)
    for k in vs[0]:
        torch.testing.assert_close(got[k], peft_merge.task_arithmetic([v[k] for v in vs], torch.tensor(w)))


@pytest.mark.parametrize("density", [0.0, 0.2, 0.5, 1.0])
def test_magnitude_prune_equals_peft(density):
    t = _vectors(1)[0]["a"]
    torch.testing.assert_close(magnitude_prune(t, density), peft_merge.magnitude_based_pruning(t, density))


@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_ties_equals_peft(method, density, seed):
    vs, w = _vectors(5, seed), [2.0, 1.0, 1.0, 0.5, 1.5]
    got = ties(vs, w, density, method)
    for k in vs[0]:
        expected = peft_merge.ties([v[k] for v in vs], torch.tensor(w), density, method)
        torch.testing.assert_close(got[k], expected)


def test_ties_edge_cases():
    zero = TaskVector({"a": torch.zeros(4)})
    assert torch.equal(ties([zero, zero], [1.0, 1.0], 1.0)["a"], torch.zeros(4))  # zeros never vote
    tie = [TaskVector({"a": torch.tensor([1.0])}), TaskVector({"a": torch.tensor([-1.0])})]
    assert ties(tie, [1.0, 1.0], 1.0)["a"].item() == 1.0  # a tied vote goes to +
    single = _vectors(1)[0]
    assert all(torch.equal(ties([single], [1.0], 1.0)[k], single[k]) for k in single)  # one task: itself
    with pytest.raises(ValueError, match="majority_sign_method"):
        ties([single], [1.0], 1.0, "median")


def test_sign_similarity_is_one_on_the_diagonal_and_half_for_unrelated():
    vs = _vectors(3)
    s = sign_similarity(vs)
    assert s.shape == (3, 3) and torch.allclose(s.diagonal(), torch.ones(3)) and torch.allclose(s, s.T)
    assert sign_similarity([vs[0], -vs[0]])[0, 1].item() == 0.0
    g = torch.Generator().manual_seed(5)
    big = [TaskVector({"a": torch.randn(200_000, generator=g)}) for _ in range(2)]
    assert abs(sign_similarity(big)[0, 1].item() - 0.5) < 0.01


def test_agreement_mask_is_soft():
    vs = [TaskVector({"a": torch.tensor([1.0, 1.0, 1.0])}), TaskVector({"a": torch.tensor([1.0, -1.0, 2.0])}),
          TaskVector({"a": torch.tensor([1.0, -1.0, -3.0])})]
    # alpha = |mean sign| = [1, 1/3, 1/3]; rho = 0.4 keeps the first, scales the others to 1/3
    torch.testing.assert_close(agreement_mask(vs, rho=0.4)["a"], torch.tensor([1.0, 1 / 3, 1 / 3]))
    torch.testing.assert_close(agreement_mask(vs, rho=0.3)["a"], torch.ones(3))


def test_weighted_average_matches_hand_computation():
    vs = _vectors(3)
    got = weighted_average(vs, [1.0, 2.0, 3.0])
    for k in vs[0]:
        torch.testing.assert_close(got[k], (vs[0][k] + 2 * vs[1][k] + 3 * vs[2][k]) / 6)


@pytest.mark.parametrize("seed", [0, 3])
def test_dare_equals_peft_under_the_same_seed(seed):
    from hf_fedtask.merge import dare_linear, dare_ties

    vs, w = _vectors(3, seed), [1.0, 0.5, 2.0]
    torch.manual_seed(seed)
    linear = {k: peft_merge.dare_linear([v[k] for v in vs], torch.tensor(w), 0.4) for k in vs[0]}
    torch.manual_seed(seed)
    tied = {k: peft_merge.dare_ties([v[k] for v in vs], torch.tensor(w), 0.4) for k in vs[0]}
    got_linear, got_ties = dare_linear(vs, w, 0.4, seed=seed), dare_ties(vs, w, 0.4, seed=seed)
    for k in vs[0]:
        torch.testing.assert_close(got_linear[k], linear[k])
        torch.testing.assert_close(got_ties[k], tied[k])


def _unify_reference(vs):
    """Independent, stacked implementation of MaTU/EMR unification (paper's global-sum rescaler)."""
    flat = torch.stack([v.flatten() for v in vs])
    sign = flat.sum(0).sign()
    agree = flat.sign() == sign
    mu = torch.where(agree, flat.abs(), torch.zeros_like(flat)).max(0).values
    tau = sign * mu
    masks = flat * tau > 0
    lam = [float(flat[t].abs().sum() / (masks[t] * tau).abs().sum()) for t in range(len(vs))]
    return tau, masks, lam


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unify_equals_independent_implementation(seed):
    vs = _vectors(4, seed)
    u = unify(vs)
    tau, masks, lam = _unify_reference(vs)
    torch.testing.assert_close(u.vector.flatten(), tau)
    for t in range(4):
        assert torch.equal(u.mask(t).flatten(), masks[t])
        assert u.rescalers[t] == pytest.approx(lam[t], rel=1e-6)
    # the per-tensor-mean (EMR code) variant differs but is also positive
    assert all(r > 0 for r in unify(vs, rescaler="per_tensor_mean").rescalers)


def test_unify_of_one_task_recovers_it():
    v = _vectors(1)[0]
    u = unify([v])
    assert u.rescalers[0] == pytest.approx(1.0)
    for k in v:
        torch.testing.assert_close(u.task_vector(0)[k], v[k])


def test_unify_recovery_error_is_smaller_than_plain_average():
    vs = _vectors(3, seed=7)
    u = unify(vs)
    mean = task_arithmetic(vs, [1 / 3] * 3)
    err_unified = sum((u.task_vector(t) - vs[t]).norm() for t in range(3))
    err_mean = sum((mean - vs[t]).norm() for t in range(3))
    assert err_unified < err_mean


def test_ties_model_scope_trims_over_the_whole_vector():
    from hf_fedtask.merge.ties import trim

    small = TaskVector({"a": torch.tensor([0.1, 0.2, 0.3, 0.4]), "b": torch.tensor([5.0, 6.0, 7.0, 8.0])})
    kept = trim(small, 0.5, "model")  # the 4 largest of 8 entries are all in "b"
    assert torch.equal(kept["a"], torch.zeros(4)) and torch.equal(kept["b"], small["b"])
    per_tensor = trim(small, 0.5, "tensor")  # the 2 largest of each parameter
    assert torch.equal(per_tensor["a"], torch.tensor([0.0, 0.0, 0.3, 0.4]))
    merged = ties([small, small], [1.0, 1.0], 0.5, scope="model")
    assert torch.equal(merged["a"], torch.zeros(4)) and torch.equal(merged["b"], small["b"])
    with pytest.raises(ValueError, match="scope"):
        ties([small], [1.0], 0.5, scope="layer")


# -- streaming versions vs the stacked definitions (bit for bit), across chunk boundaries ----------

SHAPES = {"w": (13, 29), "b": (1,), "x": (1031,), "empty": (0,), "t": (9, 7)}


def _odd_vectors(n, seed, dtype=torch.float32, quantized=False):
    """Several keys of odd sizes (one empty, one a non-contiguous transpose); `quantized` rounds to
    quarters so many entries tie at the trimming threshold and many are zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tv = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
        tv["t"] = tv["t"].T
        if quantized:
            tv = {k: torch.round(v * 4) / 4 for k, v in tv.items()}
        out.append(TaskVector({k: v.to(dtype) for k, v in tv.items()}))
    return out


def _elect_reference(trimmed, weights, method):
    """TIES' election and disjoint mean over stacked trimmed tensors, task by task."""
    vote = torch.zeros_like(trimmed[0])
    for t in trimmed:
        vote += t if method == "total" else t.sign()
    majority = torch.where(vote >= 0, 1.0, -1.0).to(vote.dtype)
    total, count = torch.zeros_like(vote), torch.zeros_like(vote)
    for t, w in zip(trimmed, weights):
        agree = (t.sign() == majority).to(t.dtype)
        total += t * float(w) * agree
        count += agree
    return total / count.clamp(min=1.0)


def _ties_reference(vs, weights, density, method, scope):
    from hf_fedtask.merge.ties import trim

    trimmed = [trim(v, density, scope) for v in vs]
    return {k: _elect_reference([t[k] for t in trimmed], weights, method) for k in vs[0]}


@pytest.fixture(params=["default", "tiny"])
def chunking(request, monkeypatch):
    """Default chunks, or chunks of 8-16 entries: many boundaries, chunks spanning several keys."""
    import importlib

    if request.param == "tiny":
        monkeypatch.setattr(importlib.import_module("hf_fedtask.merge.streaming"), "CACHE_BYTES", 300)
    return request.param


@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.37, 1.0])
@pytest.mark.parametrize("quantized", [False, True])
def test_streaming_ties_equals_stacked_definition(chunking, scope, method, density, quantized):
    vs, w = _odd_vectors(5, seed=11, quantized=quantized), [1.0, 0.5, 2.0, -0.7, 1.3]
    got, expected = ties(vs, w, density, method, scope), _ties_reference(vs, w, density, method, scope)
    for k in vs[0]:
        assert got[k].shape == vs[0][k].shape and torch.equal(got[k], expected[k]), k


@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_streaming_ties_bfloat16_and_large_keys(scope):
    """bf16 (numpy has no bf16; ties at the threshold everywhere) and a key of 70k entries."""
    g = torch.Generator().manual_seed(3)
    vs = [TaskVector({"big": torch.randn(70_001, generator=g), "small": torch.randn(33, generator=g)}).to(dtype)
          for dtype in [torch.bfloat16] * 3]
    w = [1.0, 2.0, 0.5]
    got, expected = ties(vs, w, 0.2, "total", scope), _ties_reference(vs, w, 0.2, "total", scope)
    assert all(torch.equal(got[k], expected[k]) and got[k].dtype == torch.bfloat16 for k in vs[0])
    fp32 = [v.to(torch.float32) for v in vs]
    got, expected = ties(fp32, w, 0.2, "frequency", scope), _ties_reference(fp32, w, 0.2, "frequency", scope)
    assert all(torch.equal(got[k], expected[k]) for k in vs[0])


def _unify_sequential_reference(vs, rescaler):
    """The stacked definition with Σ_t τ_t taken task by task (the order `unify` sums in)."""
    tau, masks = {}, [{} for _ in vs]
    for k in vs[0]:
        sign = sum(v[k] for v in vs).sign()
        mu = torch.stack([torch.where(v[k].sign() == sign, v[k].abs(), 0) for v in vs]).amax(0)
        tau[k] = sign * mu
        for t, v in enumerate(vs):
            masks[t][k] = v[k] * tau[k] > 0
    lams = []
    for v, m in zip(vs, masks):
        if rescaler == "global_sum":
            num = sum(float(v[k].abs().double().sum()) for k in tau)
            den = sum(float((tau[k] * m[k]).abs().double().sum()) for k in tau)
        else:
            num = sum(float(v[k].abs().double().sum()) / max(v[k].numel(), 1) for k in tau)
            den = sum(float((tau[k] * m[k]).abs().double().sum()) / max(v[k].numel(), 1) for k in tau)
        lams.append(num / den)
    return TaskVector(tau), [TaskVector(m) for m in masks], lams


@pytest.mark.parametrize("rescaler", ["global_sum", "per_tensor_mean"])
@pytest.mark.parametrize("quantized", [False, True])
def test_streaming_unify_equals_stacked_definition(chunking, rescaler, quantized):
    from hf_fedtask.merge.bitmask import pack_bits

    vs = _odd_vectors(6, seed=5, quantized=quantized)
    u = unify(vs, rescaler)
    tau, masks, lams = _unify_sequential_reference(vs, rescaler)
    for k in vs[0]:
        assert torch.equal(u.vector[k], tau[k]) and u.vector[k].shape == vs[0][k].shape
    for t in range(len(vs)):
        assert u.masks[t].dtype == torch.uint8 and torch.equal(u.masks[t], pack_bits(masks[t].flatten()))
        assert all(torch.equal(u.mask(t)[k], masks[t][k]) for k in vs[0])
        assert u.rescalers[t] == pytest.approx(lams[t], rel=1e-6)
        for k, v in u.task_vector(t).items():
            torch.testing.assert_close(v, lams[t] * masks[t][k] * tau[k])


def test_streaming_sign_similarity_equals_stacked(chunking):
    vs = _odd_vectors(4, seed=2, quantized=True)
    signs = torch.stack([v.flatten().sign() for v in vs])
    assert torch.equal(sign_similarity(vs), 0.5 * (signs @ signs.T / signs.shape[1] + 1.0))


def test_merges_reject_mismatched_shapes():
    a, b = TaskVector({"w": torch.zeros(2, 3)}), TaskVector({"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="shape of 'w'"):
        ties([a, b], [1.0, 1.0], 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_next_float_below_a_threshold_is_torch_nextafter(dtype):
    from hf_fedtask.merge.ties import _below

    values = torch.rand(200, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype) * 10
    values = torch.cat([values, torch.tensor([1e-40, 1.0, 65504.0], dtype=torch.float64).to(dtype)])
    values = values[values > 0]
    for v in values:
        want = torch.nextafter(v, torch.tensor(0.0, dtype=dtype)).item()
        assert _below(v.item(), dtype) == want, (dtype, v.item())
