"""Model-side math with the model on a device: batches go to the model's device, what leaves the model
comes back as CPU tensors, and merges of task vectors whose tensors sit on a device run there (the
torch paths) and return results there.

Tests marked `cuda` compare a CUDA run with the CPU one and are skipped without a CUDA device. The
others run anywhere: merges of `meta` tensors (a device without data) must take the torch path and
return `meta` tensors, which fails wherever a path touches numba, numpy or a CPU buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.merge import (
    agreement_mask,
    dare_linear,
    dare_ties,
    sign_similarity,
    streaming,
    task_arithmetic,
    ties,
    unify,
    weighted_average,
)
from hf_fedtask.merge.bitmask import pack_bits, pack_rows, unpack_bits
from hf_fedtask.merge.ties import elect_and_merge

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"

SHAPES = {"a.weight": (37, 11), "a.bias": (37,), "b.weight": (5, 3, 7), "c": (1001,)}


def _vectors(n: int = 4, seed: int = 0, device: str = "cpu") -> list[TaskVector]:
    """n random task vectors of odd sizes, values on a 1/4 grid (so that magnitudes tie at TIES'
    thresholds and signs at 0)."""
    gen = torch.Generator().manual_seed(seed)
    return [TaskVector({k: ((torch.randn(s, generator=gen) * 4).round() / 4).to(device) for k, s in SHAPES.items()})
            for _ in range(n)]


def _on(vectors: list[TaskVector], device: str) -> list[TaskVector]:
    return [tv.apply(lambda t: t.to(device)) for tv in vectors]


def _assert_on(tv, device: str, like: dict | None = None) -> None:
    for k, t in tv.items():
        assert t.device.type == device, k
        if like is not None:
            assert t.shape == like[k].shape and t.dtype == like[k].dtype, k


# -- anywhere: merges of tensors on another device take the torch path there -------------------------


@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("method", ["total", "frequency"])
def test_merges_of_meta_vectors_run_on_meta(scope, method):
    """Every merge of vectors on a device other than the CPU stays there: the outputs are `meta`
    tensors of the inputs' shapes and dtypes (TIES at density 1: a threshold needs the values)."""
    vectors, weights = _on(_vectors(3), "meta"), [0.5, 1.0, 2.0]
    like = vectors[0]
    _assert_on(ties(vectors, weights, density=1.0, majority_sign_method=method, scope=scope), "meta", like)
    _assert_on(weighted_average(vectors, weights), "meta", like)
    _assert_on(weighted_average(iter(vectors), weights), "meta", like)  # the streamed running mean
    _assert_on(weighted_average(vectors, weights, backend="torch"), "meta", like)
    _assert_on(task_arithmetic(vectors, weights), "meta", like)
    _assert_on(agreement_mask(vectors, rho=0.4), "meta", like)
    _assert_on(dare_linear(vectors, weights, density=0.5, seed=1), "meta", like)  # masks drawn on the CPU
    _assert_on(dare_ties(vectors, weights, density=0.5, seed=1, majority_sign_method=method), "meta", like)
    merged = elect_and_merge([tv["a.weight"] for tv in vectors], weights, method)
    assert merged.device.type == "meta" and merged.shape == SHAPES["a.weight"]
    similarity = sign_similarity(vectors)
    assert similarity.device.type == "meta" and similarity.shape == (3, 3)


def test_the_numba_backend_refuses_a_device_and_devices_do_not_mix():
    vectors = _on(_vectors(2), "meta")
    with pytest.raises(ValueError, match="numba backend takes CPU task vectors"):
        ties(vectors, [1.0, 1.0], density=1.0, backend="numba")
    with pytest.raises(ValueError, match="numba backend takes CPU task vectors"):
        weighted_average(vectors, [1.0, 1.0], backend="numba")
    mixed = [_vectors(1)[0], vectors[1]]
    with pytest.raises(ValueError, match="different devices"):
        weighted_average(mixed, [1.0, 1.0])
    with pytest.raises(ValueError, match="different devices"):
        unify(mixed)


@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 1001])
def test_pack_rows_is_numpys_packbits(width):
    """What unify packs its masks with on a device: numpy's `packbits(axis=1)` layout, also for the
    strided last chunk of a scratch buffer, and `unpack_bits` reads each row back."""
    gen = torch.Generator().manual_seed(width)
    buffer = torch.rand(5, width + 13, generator=gen) > 0.5
    mask = buffer[:, :width]  # a view with a row stride larger than its width, as unify's chunks are
    packed = pack_rows(mask)
    assert packed.dtype == torch.uint8
    np.testing.assert_array_equal(packed.numpy(), np.packbits(mask.numpy(), axis=1))
    for row, bits in zip(packed, mask):
        assert torch.equal(row, pack_bits(bits))
        assert torch.equal(unpack_bits(row, width), bits)


@pytest.mark.parametrize("mode", ["network", "lora_layers"])
def test_the_linearization_point_follows_the_parameters(tiny_bert_dir, mode):
    """`LinearizedModel.to(...)` (here `.double()`, a conversion like a device move) converts θ_lin
    with the parameters: the linearized model wrapped in float32 and then converted computes what one
    wrapped in float64 computes, and `delta()` comes back as CPU tensors."""
    from peft import LoraConfig, get_peft_model

    from hf_fedtask.model.backbone import load_classifier, resolve_base_model
    from hf_fedtask.model.linearize import LinearizedModel

    def lora_model():
        torch.manual_seed(0)
        base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3)
        return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", init_lora_weights=False))

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 3000, (4, 10), generator=gen)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def shifted_logits(lin):
        with torch.no_grad():
            for n, p in lin.model.named_parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n)), dtype=p.dtype))
        return lin(**inputs).logits.detach()

    converted = LinearizedModel(lora_model(), mode=mode).eval().double()
    assert all(t.dtype == torch.float64 for t in converted.point.values())
    wrapped = LinearizedModel(lora_model().double(), mode=mode).eval()
    torch.testing.assert_close(shifted_logits(converted), shifted_logits(wrapped), rtol=0, atol=1e-12)
    delta = converted.delta()
    assert all(t.device.type == "cpu" and t.dtype == torch.float64 for t in delta.values())
    assert sum(float(t.abs().sum()) for t in delta.values()) > 0


# -- on CUDA: the device run equals the CPU one, and its results are where they are promised -------------


@pytest.fixture
def full_float32():
    """No TF32 on the device while a test compares float32 results with the CPU's."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _small_cnn():
    from hf_fedtask.model.small_cnn import SmallCNNConfig, SmallCNNForImageClassification

    torch.manual_seed(0)
    return SmallCNNForImageClassification(SmallCNNConfig(num_labels=3, conv_channels=(4, 8), hidden_size=16)).eval()


def _images(n: int, seed: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.cuda
@requires_cuda
def test_entk_features_of_a_cuda_model_equal_the_cpu_ones(tiny_bert_dir, full_float32):
    """Both feature paths (per layer: a CNN, whose convolutions go dense and linear layers gather;
    torch.func: a BERT trained in full, on a padded batch), CPU batches in, CPU rows out."""
    from transformers import AutoTokenizer

    from hf_fedtask.model.backbone import load_classifier, resolve_base_model
    from hf_fedtask.model.entk import coordinate_subset, model_features

    cnn = _small_cnn()
    paths = [n for n, _ in cnn.named_parameters()]
    index = coordinate_subset(sum(p.numel() for p in cnn.parameters()), 3000, seed=5)
    batches = [_images(5, 1), _images(3, 2)]
    bert = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3, "eager").eval()
    tokens = AutoTokenizer.from_pretrained(tiny_bert_dir)(["a short one", "a somewhat longer sentence than that",
                                                           "mid length text", "x"], padding=True, return_tensors="pt")
    bert_paths = [n for n, _ in bert.named_parameters()]
    bert_index = coordinate_subset(sum(p.numel() for p in bert.parameters()), 2000, seed=6)
    for model, names, inputs, idx in ((cnn, paths, batches, index), (bert, bert_paths, [dict(tokens)], bert_index)):
        cpu = model_features(model.cpu(), names, inputs, idx)
        model.to(CUDA)
        for where in (idx, idx.to(CUDA)):  # the coordinates as given, or on the device (a TCT export moved there)
            got = model_features(model, names, inputs, where)
            assert got.device.type == "cpu" and got.dtype == torch.float32 and got.shape == cpu.shape
            torch.testing.assert_close(got, cpu, rtol=1e-4, atol=1e-5)
        assert next(model.parameters()).device.type == "cuda"  # left where it was


@pytest.mark.cuda
@requires_cuda
def test_host_entk_features_on_cuda_equal_the_cpu_ones(full_float32):
    """Through the host: `entk_features` and the per-sample reference with the host model on CUDA."""
    from hf_fedtask.config import RunConfig
    from hf_fedtask.core.state import SHARED
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.model.entk import coordinate_subset, entk_features, per_sample_loop

    env = Environment(RunConfig(tasks=["digits"], suite=None, base_model="hf-fedtask/small-cnn", peft_method="full",
                                num_clients=2, seed=0))
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task).select(range(10))
    index = coordinate_subset(state.numel(), 20000, seed=5)
    results = {}
    for device in ("cpu", CUDA):
        env.host.model.to(device)
        results[device] = (entk_features(env.host, state, data, index, batch_size=4),
                           per_sample_loop(env.host, state, data, index))
    for got, want in zip(results[CUDA], results["cpu"]):
        assert got.device.type == "cpu" and got.shape == (10, 20000)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@requires_cuda
def test_a_tct_export_moved_to_cuda_predicts_as_on_the_cpu(full_float32):
    from hf_fedtask.export.tct import TCTClassifier
    from hf_fedtask.model.entk import coordinate_subset

    cnn = _small_cnn()
    p = 3000
    gen = torch.Generator().manual_seed(0)
    linear = {"index": coordinate_subset(sum(q.numel() for q in cnn.parameters()), p, seed=7),
              "mean": 0.01 * torch.randn(p, generator=gen), "std": torch.rand(p, generator=gen) + 0.5,
              "weight": torch.randn(p, 3, generator=gen), "bias": torch.randn(3, generator=gen)}
    model = TCTClassifier(cnn, [n for n, _ in cnn.named_parameters()], linear, None, {"output": 0})
    batch = _images(4, 3)
    cpu = model(**batch)
    model.to(CUDA)
    got = model(**batch)  # CPU inputs
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@requires_cuda
def test_gauss_newton_and_data_gradient_on_cuda_equal_the_cpu_ones(full_float32):
    """F²L²'s pieces with the host model on CUDA: the same CPU vectors as on the CPU."""
    from hf_fedtask.config import RunConfig
    from hf_fedtask.core.state import SHARED
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.model.newton import GaussNewton, JacobianGaussNewton, data_gradient

    env = Environment(RunConfig(tasks=["digits"], suite=None, base_model="hf-fedtask/small-mlp", peft_method="full",
                                num_clients=2, strategy="f2l2", seed=0))
    task = env.tasks[0].name
    point = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    gen = torch.Generator().manual_seed(0)
    v = TaskVector({k: 0.01 * torch.randn(t.shape, generator=gen) for k, t in point.items()})
    data = env.test_data(task).select(range(24))
    results = {}
    for device in ("cpu", CUDA):
        env.host.model.to(device)
        gradient, loss = data_gradient(env.host, point + v, point, data, batch_size=10)
        with GaussNewton(env.host, point, data, batch_size=10) as products:
            hv = products(v)
        with JacobianGaussNewton(env.host, point, data, outputs=10) as products:
            jv = products(v)
        results[device] = gradient, loss, hv, jv
    (g, loss, hv, jv), (g0, loss0, hv0, jv0) = results[CUDA], results["cpu"]
    assert loss == pytest.approx(loss0, rel=1e-4)
    for got, want in ((g, g0), (hv, hv0), (jv, jv0), (jv, hv0)):
        for k in want:
            assert got[k].device.type == "cpu" and got[k].dtype == want[k].dtype, k
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("mode", ["network", "lora_layers"])
def test_a_linearized_model_moved_to_cuda_computes_what_it_did_on_the_cpu(tiny_bert_dir, mode, full_float32):
    from peft import LoraConfig, get_peft_model

    from hf_fedtask.model.backbone import load_classifier, resolve_base_model
    from hf_fedtask.model.linearize import LinearizedModel

    torch.manual_seed(0)
    base = load_classifier(resolve_base_model(tiny_bert_dir, "tests/tiny-bert"), 3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", init_lora_weights=False))
    lin = LinearizedModel(model, mode=mode).eval()  # θ_lin taken on the CPU
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    ids = torch.randint(1000, 3000, (4, 10), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cpu, cpu_delta = lin(**inputs).logits.detach(), lin.delta()
    lin.to(CUDA)
    assert all(t.device.type == "cuda" for t in lin.point.values())
    got = lin(**{k: v.to(CUDA) for k, v in inputs.items()}).logits.detach()
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-4, atol=1e-5)
    delta = lin.delta()
    for k, t in cpu_delta.items():
        assert delta[k].device.type == "cpu"
        torch.testing.assert_close(delta[k], t, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@requires_cuda
def test_a_linear_correction_on_cuda_parameters_adds_c_to_the_gradients():
    from hf_fedtask.client.objectives import LinearCorrection

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2).to(CUDA)
    params = dict(module.named_parameters())
    c = {"weight": torch.randn(2, 3)}  # on the CPU, as the server sends it
    objective = LinearCorrection(c)
    objective.start(params)
    x = torch.randn(5, 3, device=CUDA)
    model_loss = module(x).square().mean()
    plain = torch.autograd.grad(model_loss, [params["weight"]], retain_graph=True)[0]
    (grad,) = torch.autograd.grad(objective.loss(model_loss, None, {}), [params["weight"]])
    torch.testing.assert_close(grad.cpu(), (plain + c["weight"].to(CUDA)).cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("chunk_bytes", [streaming.DEVICE_BYTES, 4096])
def test_merges_of_cuda_vectors_stay_on_cuda_and_equal_the_cpu_kernels(chunk_bytes, monkeypatch):
    """TIES, unify, the weighted mean, MaTU's agreement mask and sign similarity, DARE and task
    arithmetic of CUDA task vectors: results on CUDA, equal to the CPU's (the numba kernels where
    they apply); in one chunk, and in many (4 KiB chunks)."""
    monkeypatch.setattr(streaming, "DEVICE_BYTES", chunk_bytes)
    cpu, weights = _vectors(4), [0.5, 1.0, 2.0, 0.7]
    dev = _on(cpu, CUDA)

    def same(got, want, rtol=1e-6, atol=1e-7):
        for k in want:
            assert got[k].device.type == "cuda" and got[k].dtype == want[k].dtype, k
            torch.testing.assert_close(got[k].cpu(), want[k], rtol=rtol, atol=atol, msg=k)

    for density in (0.2, 0.5, 1.0):
        for method in ("total", "frequency"):
            for scope in ("tensor", "model"):
                same(ties(dev, weights, density, method, scope), ties(cpu, weights, density, method, scope))
        same(dare_linear(dev, weights, density, seed=3), dare_linear(cpu, weights, density, seed=3))
        same(dare_ties(dev, weights, density, seed=3), dare_ties(cpu, weights, density, seed=3))
    for rescaler in ("global_sum", "per_tensor_mean"):
        got, want = unify(dev, rescaler=rescaler), unify(cpu, rescaler=rescaler)
        same(got.vector, want.vector)
        for m, m0 in zip(got.masks, want.masks):
            assert m.device.type == "cuda" and torch.equal(m.cpu(), m0)
        assert got.rescalers == pytest.approx(want.rescalers, rel=1e-5)
        same(got.task_vector(1), want.task_vector(1))
    same(weighted_average(dev, weights), weighted_average(cpu, weights))
    same(weighted_average(iter(dev), weights), weighted_average(iter(cpu), weights))
    same(agreement_mask(dev, 0.4), agreement_mask(cpu, 0.4))
    same(task_arithmetic(dev, weights), task_arithmetic(cpu, weights))
    similarity = sign_similarity(dev)
    assert similarity.device.type == "cuda"
    torch.testing.assert_close(similarity.cpu(), sign_similarity(cpu), rtol=1e-6, atol=1e-7)
