"""The batched merges (`hf_fedtask.merge.batched`, backend="batched": all tasks stacked into one tensor
per chunk, the path taken on an accelerator) on CPU tensors: TIES and task arithmetic bit for bit equal
to the streaming torch path and the numba kernels, unify's vector and masks bit for bit (its rescalers to
float rounding), in one chunk and in many, for every float dtype, with ties at the thresholds; and the
same code path against peft.utils.merge_utils on the same inputs."""

import pytest
import torch
from peft.utils import merge_utils as peft_merge

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import batched, kernels, task_arithmetic, ties, unify, weighted_average
from hf_fedtask.merge.bitmask import unpack_bits
from hf_fedtask.merge.streaming import Layout
from hf_fedtask.merge.ties import magnitude_prune

SHAPES = {"w": (13, 29), "b": (1,), "x": (1031,), "empty": (0,), "t": (9, 7), "big": (5003,), "x2": (1031,)}
WEIGHTS = [1.0, 0.7, 2.1, -0.7, 1.3]  # not representable in 16-bit floats: their rounding is checked too
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _vectors(n: int, seed: int, quantized: bool = False, dtype: torch.dtype = torch.float32) -> list[TaskVector]:
    """Keys of odd sizes (one empty, one a non-contiguous transpose, two of one size: one topk call);
    `quantized` rounds to quarters, so many entries tie at every threshold and many are zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tv = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
        tv["t"] = tv["t"].T
        if quantized:
            tv = {k: torch.round(v * 4) / 4 for k, v in tv.items()}
        out.append(TaskVector({k: v.to(dtype) for k, v in tv.items()}))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(got: TaskVector, want: TaskVector) -> None:
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


@pytest.fixture(params=["one chunk", "many chunks"])
def chunks(request, monkeypatch):
    """The default budget (everything in one chunk), or 20,000 bytes: chunks of 88-200 entries
    (5 to 7 tasks) that straddle keys, and threshold selections of one population at a time."""
    if request.param == "many chunks":
        monkeypatch.setattr(batched, "BUDGET_BYTES", 20_000)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_batched_ties_is_the_torch_path_bit_for_bit(chunks, dtype, quantized, scope):
    vectors = _vectors(5, seed=11 + quantized, quantized=quantized, dtype=dtype)
    stack = batched.Stack(Layout(vectors), vectors, batched.TIES_BYTES(dtype.itemsize))
    assert (stack.size < stack.layout.numel // 20) == (chunks == "many chunks")
    for method in ("total", "frequency"):
        for density in (0.0, 0.1, 0.37, 0.9999, 1.0):
            got = ties(vectors, WEIGHTS, density, method, scope, backend="batched")
            _same_bits(got, ties(vectors, WEIGHTS, density, method, scope, backend="torch"))
            if dtype == torch.float32:
                _same_bits(got, ties(vectors, WEIGHTS, density, method, scope, backend="numba"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("rescaler", ["global_sum", "per_tensor_mean"])
def test_batched_unify_is_the_torch_path(chunks, dtype, quantized, rescaler):
    vectors = _vectors(6, seed=5, quantized=quantized, dtype=dtype)
    vectors.append(TaskVector({k: -v for k, v in vectors[0].items()}))  # sums of exactly zero: sign 0
    got = unify(vectors, rescaler, backend="batched")
    for want in [unify(vectors, rescaler, backend="torch")] + (
            [unify(vectors, rescaler, backend="numba")] if dtype == torch.float32 else []):
        for k in want.vector:
            assert torch.equal(got.vector[k], want.vector[k]) and got.vector[k].dtype == want.vector[k].dtype, k
        assert len(got.masks) == len(vectors)
        for a, b in zip(got.masks, want.masks, strict=True):
            assert a.dtype == torch.uint8 and torch.equal(a, b)
        assert got.rescalers == pytest.approx(want.rescalers, rel=1e-6)
    assert len({m.untyped_storage().data_ptr() for m in got.masks}) == len(vectors)  # a tensor each


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_task_arithmetic_is_the_torch_path_bit_for_bit(dtype):
    vectors = _vectors(5, seed=2, dtype=dtype)
    _same_bits(task_arithmetic(vectors, WEIGHTS, backend="batched"), task_arithmetic(vectors, WEIGHTS, backend="torch"))
    mixed = [TaskVector({k: v.double() if k == "x" else v for k, v in tv.items()}) for tv in vectors]  # keys' dtypes
    _same_bits(task_arithmetic(mixed, WEIGHTS, backend="batched"), task_arithmetic(mixed, WEIGHTS, backend="torch"))


def test_batched_ties_of_mixed_dtypes_computes_in_the_promoted_dtype(chunks):
    vectors = [TaskVector({k: v.to(torch.bfloat16) if k in ("x", "t") else v for k, v in tv.items()})
               for tv in _vectors(4, seed=3, quantized=True)]
    for scope in ("tensor", "model"):
        _same_bits(ties(vectors, WEIGHTS[:4], 0.3, "total", scope, backend="batched"),
                   ties(vectors, WEIGHTS[:4], 0.3, "total", scope, backend="torch"))


@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_merges_equal_peft(method, seed):
    """The batched path against peft.utils.merge_utils on the same CPU tensors: TIES per parameter
    (peft's `ties`, trimming each tensor) and task arithmetic."""
    vectors = _vectors(5, seed)
    w = torch.tensor(WEIGHTS)
    for density in (0.2, 0.5, 1.0):
        got = ties(vectors, WEIGHTS, density, method, backend="batched")
        for k in vectors[0]:
            torch.testing.assert_close(got[k], peft_merge.ties([v[k] for v in vectors], w, density, method), msg=k)
    got = task_arithmetic(vectors, WEIGHTS, backend="batched")
    for k in vectors[0]:
        torch.testing.assert_close(got[k], peft_merge.task_arithmetic([v[k] for v in vectors], w), msg=k)


def test_ties_at_the_threshold_are_kept_in_flat_order(chunks):
    """Every magnitude equal: the top k are the first k entries in flat order, per tensor or across
    the keys of the whole vector (scope="model"), wherever the chunks cut."""
    ones = TaskVector({"a": torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]), "b": -torch.ones(2, 7)})
    for density in (0.3, 0.5, 0.8):
        got = ties([ones], [1.0], density, backend="batched")
        assert all(torch.equal(got[k], magnitude_prune(v, density)) for k, v in ones.items())
        got = ties([ones], [1.0], density, scope="model", backend="batched")
        k = int(density * ones.numel())
        assert torch.equal(got.flatten(), torch.cat([ones.flatten()[:k], torch.zeros(ones.numel() - k)]))
    # two tasks tied at different positions: each keeps its own first entries
    a = TaskVector({"a": torch.tensor([2.0, 1.0, 1.0, 1.0, 3.0, 1.0])})
    b = TaskVector({"a": torch.tensor([1.0, 1.0, 5.0, 1.0, 1.0, 1.0])})
    got = ties([a, b], [1.0, 1.0], 0.5, backend="batched")["a"]
    # a keeps 2, 3 and its first tied 1 (index 1); b keeps 5 and its first two tied 1s (indices 0, 1)
    assert got.tolist() == [(2.0 + 1.0) / 2, (1.0 + 1.0) / 2, 5.0, 0.0, 3.0, 0.0]


def test_batched_ties_on_a_lora_layout_of_many_small_tensors(chunks):
    g = torch.Generator().manual_seed(4)
    sizes = {f"layers.{i}.{m}.lora_{ab}.weight": (8, 64) if ab == "A" else (96, 8)
             for i in range(3) for m in ("q", "v") for ab in "AB"}
    vectors = [TaskVector({k: torch.randn(s, generator=g) for k, s in sizes.items()}) for _ in range(6)]
    weights = [0.5 + t / 6 for t in range(6)]
    for scope in ("tensor", "model"):
        _same_bits(ties(vectors, weights, 0.3, scope=scope, backend="batched"),
                   ties(vectors, weights, 0.3, scope=scope, backend="numba"))
    got, want = unify(vectors, backend="batched"), unify(vectors, backend="numba")
    assert all(torch.equal(got.vector[k], want.vector[k]) for k in sizes)
    assert all(torch.equal(a, b) for a, b in zip(got.masks, want.masks))


def test_the_budget_sets_the_chunks(monkeypatch):
    """One chunk when N·d fits the budget at TIES_BYTES per entry, else chunks of whole mask bytes
    that fill it; on the CPU the budget is at most CPU_MAX_BYTES."""
    assert 0 < batched.budget_bytes(torch.device("cpu")) <= batched.CPU_MAX_BYTES
    vectors = _vectors(5, seed=0)
    layout = Layout(vectors)
    per_entry = batched.TIES_BYTES(4)
    monkeypatch.setattr(batched, "BUDGET_BYTES", 5 * per_entry * layout.numel)
    assert batched.Stack(layout, vectors, per_entry).size >= layout.numel
    assert len(list(batched.Stack(layout, vectors, per_entry).chunks())) == 1
    monkeypatch.setattr(batched, "BUDGET_BYTES", 5 * per_entry * 1000)
    assert batched.Stack(layout, vectors, per_entry).size == 1000
    monkeypatch.setattr(batched, "BUDGET_BYTES", 5 * per_entry * 1003)
    assert batched.Stack(layout, vectors, per_entry).size == 1000  # rounded down to whole mask bytes
    monkeypatch.setattr(batched, "BUDGET_BYTES", 1)
    assert batched.Stack(layout, vectors, per_entry).size == 8


def test_which_backend_runs():
    cpu = _vectors(2, seed=0)
    meta = [tv.apply(lambda t: t.to("meta")) for tv in cpu]
    assert kernels.choose("auto", Layout(cpu)) == "numba"
    assert kernels.choose("auto", Layout([tv.to(torch.float64) for tv in cpu])) == "torch"
    assert kernels.choose("auto", Layout(meta)) == "batched"  # any device other than the CPU
    assert kernels.choose("batched", Layout(cpu)) == "batched"
    with pytest.raises(ValueError, match="backend must be one of .*'batched'"):
        ties(cpu, [1.0, 1.0], 0.5, backend="stacked")
    with pytest.raises(ValueError, match="backend must be one of"):
        weighted_average(cpu, [1.0, 1.0], backend="batched")  # no batched weighted mean: refused, not ignored
    with pytest.raises(ValueError, match="backend must be one of"):
        task_arithmetic(cpu, [1.0, 1.0], backend="numba")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("budget", [None, 20_000])
def test_batched_merges_on_cuda_equal_the_cpu_kernels(budget, monkeypatch):
    """On CUDA (where "auto" takes the batched path): TIES and unify's vector and masks bit for bit as
    the CPU kernels, task arithmetic to float rounding, results on the device."""
    monkeypatch.setattr(batched, "BUDGET_BYTES", budget)
    for quantized in (False, True):
        cpu = _vectors(5, seed=7, quantized=quantized)
        dev = [tv.apply(lambda t: t.to("cuda")) for tv in cpu]
        for scope in ("tensor", "model"):
            for method in ("total", "frequency"):
                got = ties(dev, WEIGHTS, 0.2, method, scope)
                assert all(t.device.type == "cuda" for t in got.values())
                _same_bits(got.apply(lambda t: t.cpu()), ties(cpu, WEIGHTS, 0.2, method, scope))
        got, want = unify(dev), unify(cpu)
        assert all(torch.equal(got.vector[k].cpu(), want.vector[k]) for k in want.vector)
        assert all(m.device.type == "cuda" and torch.equal(m.cpu(), w) for m, w in zip(got.masks, want.masks))
        assert torch.equal(unpack_bits(got.masks[1].cpu(), got.vector.numel()), want.mask(1).flatten())
        assert got.rescalers == pytest.approx(want.rescalers, rel=1e-5)
        ta = task_arithmetic(dev, WEIGHTS)
        for k, v in task_arithmetic(cpu, WEIGHTS).items():
            torch.testing.assert_close(ta[k].cpu(), v, rtol=1e-6, atol=1e-6)
