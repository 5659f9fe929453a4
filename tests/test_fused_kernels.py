"""The fused numba kernels against the torch reference path, on fresh random inputs of odd sizes:
`ties` bit for bit (ties at the threshold included), `unify`'s vector and masks bit for bit
(a zero may differ in sign), its rescalers to float rounding; the threshold selection against numpy."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import agreement_mask, fused_passes, kernels, threshold_select, ties, unify, weighted_average
from hf_fedtask.merge.bitmask import packed_size
from hf_fedtask.merge.streaming import Layout
from hf_fedtask.merge.ties import magnitude_prune

SIZES = {"w": (13, 29), "b": (1,), "x": (1031,), "big": (70_001,), "t": (9, 7), "lone": (3,)}


def _vectors(n: int, seed: int, quantized: bool = False) -> list[TaskVector]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tv = {k: torch.randn(s, generator=g) for k, s in SIZES.items()}
        tv["t"] = tv["t"].T  # non-contiguous
        if quantized:  # quarters: many entries tie at every threshold, many are zero
            tv = {k: torch.round(v * 4) / 4 for k, v in tv.items()}
        out.append(TaskVector(tv))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("method", ["total", "frequency"])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.2, 0.63, 1.0])
def test_fused_ties_is_the_torch_path_bit_for_bit(quantized, scope, method, density):
    vectors = _vectors(5, seed=int(density * 100) + 7 * quantized, quantized=quantized)
    weights = [1.0, 0.5, 2.0, -0.7, 1.3]
    fused = ties(vectors, weights, density, method, scope, backend="numba")
    reference = ties(vectors, weights, density, method, scope, backend="torch")
    for key in vectors[0]:
        assert fused[key].shape == vectors[0][key].shape
        assert torch.equal(_bits(fused[key]), _bits(reference[key])), key


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("rescaler", ["global_sum", "per_tensor_mean"])
def test_fused_unify_is_the_torch_path(quantized, rescaler):
    vectors = _vectors(6, seed=3, quantized=quantized)
    vectors.append(TaskVector({k: -v for k, v in vectors[0].items()}))  # sums of exactly zero: sign 0
    fused, reference = unify(vectors, rescaler, backend="numba"), unify(vectors, rescaler, backend="torch")
    for key in vectors[0]:
        a, b = fused.vector[key], reference.vector[key]
        assert torch.equal(a, b), key  # as values; a zero may be -0.0 in the torch path
        nonzero = b != 0
        assert torch.equal(_bits(a)[nonzero], _bits(b)[nonzero]), key
    assert all(torch.equal(m, r) for m, r in zip(fused.masks, reference.masks))
    np.testing.assert_allclose(fused.rescalers, reference.rescalers, rtol=1e-6)


@pytest.mark.parametrize("n_tasks", [1, 2, 3, 4, 5, 6, 9])
def test_fused_kernels_for_every_count_of_tasks(n_tasks):
    """The kernels sweep 2 or 4 tasks at once (ties' vote and disjoint mean 2, unify's sum 4 and its
    agreement 2), the first sweep assigning: every remainder of both, bit for bit."""
    vectors = _vectors(n_tasks, seed=40 + n_tasks, quantized=n_tasks % 2 == 0)
    for sign in (1, -1):  # all weights negative: entries trimmed in every task merge to -0.0
        weights = [sign * (0.5 + 0.25 * t) for t in range(n_tasks)]
        for method in ("total", "frequency"):
            fused = ties(vectors, weights, 0.4, method, backend="numba")
            reference = ties(vectors, weights, 0.4, method, backend="torch")
            assert all(torch.equal(_bits(fused[k]), _bits(reference[k])) for k in vectors[0]), (sign, method)
    fused, reference = unify(vectors, backend="numba"), unify(vectors, backend="torch")
    for key in vectors[0]:
        assert torch.equal(fused.vector[key], reference.vector[key]), key
    assert all(torch.equal(m, r) for m, r in zip(fused.masks, reference.masks))
    np.testing.assert_allclose(fused.rescalers, reference.rescalers, rtol=1e-6)


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x5A])
def test_unify_pass_writes_every_mask_byte(fill):
    """unify hands the kernel uninitialized masks: every byte must be written, the bytes that two
    ranges share (a key or a sub-chunk ending inside a byte) merged, whatever the memory held."""
    vectors = _vectors(5, seed=17)
    layout = Layout(vectors)
    plan = kernels.Plan(layout, [layout.flat_views(tv) for tv in vectors])
    masks = [torch.full((packed_size(layout.numel),), fill, dtype=torch.uint8) for _ in vectors]
    fused_passes.unify_pass(plan, layout.empty_flat(), masks)
    reference = unify(vectors, backend="torch")
    assert all(torch.equal(m, r) for m, r in zip(masks, reference.masks))


def test_kernels_on_a_lora_layout_of_many_small_tensors():
    g = torch.Generator().manual_seed(5)
    shapes = {f"layers.{i}.{m}.lora_{ab}.weight": (8, 48) if ab == "A" else (48 + 16 * (m == "up"), 8)
              for i in range(6) for m in ("q", "v", "up") for ab in "AB"}
    vectors = [TaskVector({k: torch.randn(s, generator=g) for k, s in shapes.items()}) for _ in range(9)]
    weights = [0.5 + t / 9 for t in range(9)]
    for scope in ("tensor", "model"):
        fused, reference = ties(vectors, weights, 0.3, scope=scope, backend="numba"), \
            ties(vectors, weights, 0.3, scope=scope, backend="torch")
        assert all(torch.equal(_bits(fused[k]), _bits(reference[k])) for k in shapes)
    fused, reference = unify(vectors, backend="numba"), unify(vectors, backend="torch")
    assert all(torch.equal(m, r) for m, r in zip(fused.masks, reference.masks))
    assert all(torch.equal(fused.vector[k], reference.vector[k]) for k in shapes)


@pytest.mark.parametrize("weights", [[1.0, 2.0, 3.5, 0.25, 7.0, 1.5], [0.1, -0.3, 2.7, 1e-3, 5.0, 0.5]])
def test_fused_weighted_average_is_the_torch_path_bit_for_bit(weights):
    """Both fused paths (a list: one pass; a generator: a running sum) against the torch reference."""
    vectors = _vectors(6, seed=21)
    reference = weighted_average(iter(vectors), weights, backend="torch")
    for fused in (weighted_average(vectors, weights, backend="numba"),
                  weighted_average(iter(vectors), weights, backend="numba")):
        for key in vectors[0]:
            assert fused[key].shape == vectors[0][key].shape and fused[key].dtype == torch.float32
            assert torch.equal(_bits(fused[key]), _bits(reference[key])), key


def test_weighted_average_refuses_a_mismatched_vector_before_reading_it():
    """A shape mismatch is refused before any raw read; a dtype mix is summed (torch for that input)."""
    vectors = _vectors(3, seed=2)
    bad = TaskVector({**vectors[2], "big": torch.zeros(70_000)})  # a smaller tensor: the kernel would read past it
    for given in ([vectors[0], vectors[1], bad], iter([vectors[0], vectors[1], bad])):
        with pytest.raises(ValueError, match="shape of 'big'"):
            weighted_average(given, [1.0, 1.0, 1.0])
    mixed = [vectors[0], TaskVector({**vectors[1], "b": vectors[1]["b"].double()})]  # "auto": torch where not float32
    for given in (mixed, iter(mixed)):
        got = weighted_average(given, [1.0, 3.0])
        reference = weighted_average(iter(mixed), [1.0, 3.0], backend="torch")
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    with pytest.raises(ValueError, match="float32"):
        weighted_average([TaskVector({"w": torch.ones(3, dtype=torch.float64)})], [1.0], backend="numba")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("rho", [0.0, 0.4, 1 / 3, 1.0])
def test_fused_agreement_mask_is_the_torch_path_bit_for_bit(quantized, rho):
    vectors = _vectors(6, seed=4, quantized=quantized)  # quantized: many zeros, whose sign is 0
    fused = agreement_mask(vectors, rho, backend="numba")
    reference = agreement_mask(vectors, rho, backend="torch")
    for key in vectors[0]:
        assert torch.equal(_bits(fused[key]), _bits(reference[key])), key
    assert any(bool((reference[k] < 1).any()) for k in vectors[0]) or rho == 0.0


@pytest.mark.parametrize("n", [1, 2, 9, 4097, 300_001])
def test_kth_largest_abs_is_numpy_partition(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[: n // 3] = torch.round(x[: n // 3] * 8) / 8  # ties
    pieces = list(torch.split(x, max(1, n // 3)))
    for k in sorted({1, max(1, n // 5), max(1, n // 2), n}):
        (value, tied, kept), = threshold_select.kth_largest_abs([pieces], [k])
        magnitude = np.sort(np.abs(x.numpy()))[::-1]
        assert value == magnitude[k - 1]
        assert tied == bool(np.count_nonzero(magnitude >= magnitude[k - 1]) > k)
        if tied:  # the first tied entries, as many as the top k still needs
            at = np.flatnonzero(np.abs(x.numpy()) == value)
            assert kept.tolist() == at[: k - np.count_nonzero(np.abs(x.numpy()) > value)].tolist()
        else:
            assert kept is None


def test_kth_largest_abs_of_many_populations_in_one_call():
    """Populations that need tied entries kept, beside ones that need none, in one parallel call:
    each gets its own first tied indices (in later pieces too), the others none."""
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, generator=g) for n in (5_001, 90_001, 3_001, 70_001)]
    xs[0][2_000:] = torch.round(xs[0][2_000:] * 4) / 4  # ties, only past the first piece
    xs[3] = torch.round(xs[3] * 16) / 16
    ks = [2_500, 20_000, 3_001, 9_999]
    found = threshold_select.kth_largest_abs([list(torch.split(x, 1_700)) for x in xs], ks)
    assert [t for _, t, _ in found] == [True, False, False, True]
    assert found[0][2].min() > 1_700  # population 0's tied entries all lie past its first piece
    for x, k, (value, tied, kept) in zip(xs, ks, found):
        magnitude = np.abs(x.numpy())
        assert value == np.sort(magnitude)[::-1][k - 1]
        if tied:
            at = np.flatnonzero(magnitude == value)
            assert kept.tolist() == at[: k - np.count_nonzero(magnitude > value)].tolist()
        else:
            assert kept is None


def test_ties_at_the_threshold_are_kept_in_index_order():
    x = torch.tensor([0.5, -2.0, 1.0, -1.0, 1.0, 0.1, -1.0])
    assert magnitude_prune(x, 3 / 7).tolist() == [0.0, -2.0, 1.0, -1.0, 0.0, 0.0, 0.0]
    merged = ties([TaskVector({"x": x})], [1.0], 3 / 7)
    assert merged["x"].tolist() == [0.0, -2.0, 1.0, -1.0, 0.0, 0.0, 0.0]


def test_kernels_leave_torchs_thread_count_alone():
    """Numba's OpenMP pool starts on the first kernel call and resets the process's OpenMP threads:
    in a fresh process (where that first call happens) torch keeps the count it was given."""
    code = ("import torch; torch.set_num_threads(1)\n"
            "from hf_fedtask.merge import ties, unify; from hf_fedtask.core.taskvector import TaskVector\n"
            "vs = [TaskVector({'a': torch.randn(999)}) for _ in range(3)]\n"
            "ties(vs, [1.0] * 3, 0.2, backend='numba'); unify(vs, backend='numba'); print(torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "1", out.stderr[-2000:]


def test_numba_backend_refuses_what_it_cannot_do():
    half = [TaskVector({"a": torch.randn(5).half()}) for _ in range(2)]
    with pytest.raises(ValueError, match="numba backend takes float32"):
        ties(half, [1.0, 1.0], 0.5, backend="numba")
    with pytest.raises(ValueError, match="backend must be one of"):
        unify(half, backend="cuda")
    assert ties(half, [1.0, 1.0], 0.5)["a"].dtype == torch.float16  # auto: the torch path


@pytest.mark.parametrize("n", [3, 1000, 200_003])
def test_radix_selection_agrees_with_numpy(n):
    """The radix selection called directly on a population split over several tensors, with zeros and ties."""
    g = torch.Generator().manual_seed(n + 1)
    x = torch.randn(n, generator=g)
    x[::7] = 0.0
    x[1::5] = torch.round(x[1::5] * 16) / 16
    pieces = [p.contiguous() for p in torch.split(x, max(1, n // 4))]
    ptrs = kernels.Plan.pointers(pieces)
    lens = np.array([p.numel() for p in pieces], dtype=np.int64)
    magnitude = np.abs(x.numpy())
    for k in sorted({1, max(1, n // 10), max(1, n // 2), n}):
        v = np.sort(magnitude)[::-1][k - 1]
        bits, greater, equal = threshold_select._radix_select(ptrs, lens, 0, len(pieces), k)
        assert np.array([bits], dtype=np.uint32).view(np.float32)[0] == v
        assert (greater, equal) == (np.count_nonzero(magnitude > v), np.count_nonzero(magnitude == v))


def _population(x, parts=3):
    pieces = [p.contiguous() for p in torch.split(x, -(-x.numel() // parts))]
    return pieces, kernels.Plan.pointers(pieces), np.array([p.numel() for p in pieces], dtype=np.int64)


@pytest.mark.parametrize("case", ["random", "sample_misses", "heavy_ties"])
@pytest.mark.parametrize("size", ["counted", "one_pass"])
def test_sampled_selection_agrees_with_radix_and_numpy(case, size):
    """The sampled-bracket selection (populations of _SAMPLED_FROM entries or more; under
    _COUNTED_BELOW the bracket is first narrowed by counting at edges) against the radix selection
    and numpy: on random data with zeros and ties, on data whose strided sample is all zeros (the
    bracket misses: the radix fallback), and with 60% of the entries tied (the bracket overflows)."""
    sampled_from, counted_below = threshold_select._SAMPLED_FROM, threshold_select._COUNTED_BELOW
    n = (sampled_from if size == "counted" else max(counted_below, sampled_from)) + 12_345
    assert (n < counted_below) == (size == "counted")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, generator=g)
    if case == "random":
        x[::7] = 0.0
        x[1::5] = torch.round(x[1::5] * 16) / 16
    elif case == "sample_misses":
        runs, stride = threshold_select._sample_runs(n)
        starts = torch.arange(runs) * stride
        x[(starts[:, None] + torch.arange(threshold_select._SAMPLE_RUN)).reshape(-1)] = 0.0
    else:
        x[: int(0.6 * n)] = 0.25
    pieces, ptrs, lens = _population(x)
    if case == "sample_misses":  # the sample sees only the zeros
        sample = threshold_select._strided_sample(ptrs, lens, 0, len(pieces), n)
        assert sample.size == runs * threshold_select._SAMPLE_RUN and not sample.any()
        assert np.count_nonzero(x.numpy()) > 0.9 * n
    magnitude = np.abs(x.numpy())
    ordered = np.sort(magnitude)[::-1]
    for k in sorted({1, n // 1000, n // 5, n // 2, n - 1, n}):
        v = ordered[k - 1]
        bits, greater, equal = threshold_select._sampled_select(ptrs, lens, 0, len(pieces), k)
        assert np.array([bits], dtype=np.uint32).view(np.float32)[0] == v
        assert (greater, equal) == (np.count_nonzero(magnitude > v), np.count_nonzero(magnitude == v))
        assert (bits, greater, equal) == threshold_select._radix_select(ptrs, lens, 0, len(pieces), k)
    (value, tied, _), = threshold_select.kth_largest_abs([pieces], [n // 5])  # the public entry takes this path
    assert value == ordered[n // 5 - 1]


def test_counted_bracket_is_narrow_and_exact():
    """The counted bracket of a small population holds the k-th largest and few entries besides (so the
    fast path is what runs, not the radix fallback), and its count of entries inside is exact."""
    n = threshold_select._SAMPLED_FROM + 999
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    pieces, ptrs, lens = _population(x)
    magnitude = np.abs(x.numpy())
    for k in (n // 100, n // 5, n // 2):
        sample = threshold_select._strided_sample(ptrs, lens, 0, len(pieces), n)
        lo, hi, inside = threshold_select._counted_bracket(ptrs, lens, 0, len(pieces), k, sample)
        lo_v, hi_v = np.array([lo, hi], dtype=np.uint32).view(np.float32)
        v = np.sort(magnitude)[::-1][k - 1]
        assert lo_v <= v <= hi_v
        assert inside == np.count_nonzero((magnitude >= lo_v) & (magnitude <= hi_v))
        assert 0 < inside < 0.04 * n
