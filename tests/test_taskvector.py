"""Task vectors: arithmetic, flat view, safetensors I/O and validation at the trust boundary."""

import json
import math
import os

import peft
import pytest
import safetensors.torch
import torch
import transformers

from hf_fedtask.core import taskvector_file
from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import inspect_file, make_metadata, validate
from hf_fedtask.errors import TaskVectorError


def lora_config(**overrides):
    kwargs = dict(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])
    kwargs.update(overrides)
    return peft.LoraConfig(**kwargs)


@pytest.fixture(scope="module")
def peft_state():
    """A real PEFT state dict (saved names) of a tiny LoRA BERT classifier."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=100
    )
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora_config())
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def randn_like_state(state, seed):
    gen = torch.Generator().manual_seed(seed)
    return TaskVector({k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()})


@pytest.fixture
def tv(peft_state):
    return randn_like_state(peft_state, 1)


@pytest.fixture
def meta():
    return make_metadata(
        base_model="tiny-bert",
        base_model_revision="sha256:abc",
        peft_config_hash=peft_config_hash(lora_config()),
        kind="delta",
        task_ids=["sst2", "rte"],
        client_id="c7",
        round=3,
    )


def assert_identical(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_peft_state_uses_saved_names(peft_state):
    assert "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight" in peft_state
    assert "base_model.model.classifier.weight" in peft_state
    assert not any(".default." in k for k in peft_state)


def test_arithmetic_matches_tensorwise_reference(peft_state, tv):
    other, third = randn_like_state(peft_state, 2), randn_like_state(peft_state, 3)
    cases = {
        "add": (tv + other, lambda k: tv[k] + other[k]),
        "sub": (tv - other, lambda k: tv[k] - other[k]),
        "neg": (-tv, lambda k: -tv[k]),
        "mul": (tv * 2.5, lambda k: tv[k] * 2.5),
        "rmul": (0.5 * tv, lambda k: tv[k] * 0.5),
        "div": (tv / 4, lambda k: tv[k] / 4),
        "sum": (sum([tv, other, third]), lambda k: tv[k] + other[k] + third[k]),
        "sign": (tv.sign(), lambda k: torch.sign(tv[k])),
        "abs": (tv.abs(), lambda k: tv[k].abs()),
        "apply": (tv.apply(torch.square), lambda k: tv[k] ** 2),
        "zeros": (tv.zeros_like(), lambda k: torch.zeros_like(tv[k])),
        "to": (tv.to(torch.bfloat16), lambda k: tv[k].to(torch.bfloat16)),
    }
    for name, (result, ref) in cases.items():
        assert isinstance(result, TaskVector), name
        assert list(result) == list(tv), name
        for k in tv:
            assert result[k].dtype == ref(k).dtype and torch.allclose(result[k], ref(k), atol=1e-6), (name, k)


def test_reductions_match_flat_reference(peft_state, tv):
    other = randn_like_state(peft_state, 2)
    flat, flat_other = tv.flatten().double(), other.flatten().double()
    assert tv.numel() == flat.numel() == sum(v.numel() for v in peft_state.values())
    assert math.isclose(tv.norm(), flat.norm().item(), rel_tol=1e-12)
    assert math.isclose(tv.norm(1), flat.abs().sum().item(), rel_tol=1e-12)
    assert math.isclose(tv.norm(float("inf")), flat.abs().max().item(), rel_tol=1e-12)
    assert math.isclose(tv.dot(other), (flat * flat_other).sum().item(), rel_tol=1e-9)
    with pytest.raises(ValueError):
        tv.norm(0)


def test_metadata_handling_of_derived_vectors(tv, meta):
    tv = TaskVector(tv, meta)
    assert (tv * 2).raw_metadata == {} and tv.filter(lambda k: True).raw_metadata == {}
    copy = tv.clone()
    assert copy.raw_metadata == meta
    first = next(iter(tv))
    copy[first].add_(1)
    assert not torch.equal(copy[first], tv[first])


def test_filter_keeps_order_and_selection(tv):
    lora_a = tv.filter(lambda k: "lora_A" in k)
    assert list(lora_a) == [k for k in tv if "lora_A" in k] and len(lora_a) == 4
    assert all(lora_a[k] is tv[k] for k in lora_a)


def test_mismatched_keys_name_the_first_differing_key(tv):
    last = list(tv)[-1]
    smaller = tv.filter(lambda k: k != last)
    for a, b in [(tv, smaller), (smaller, tv)]:
        for op in (lambda: a + b, lambda: a - b, lambda: a.dot(b)):
            with pytest.raises(ValueError, match=last.replace(".", r"\.")):
                op()


def test_flatten_unflatten_round_trip_exact(tv):
    mixed = TaskVector({**tv.to(torch.bfloat16), "prompt_embeddings": torch.randn(3, 5, dtype=torch.float32)})
    for vector in (tv, mixed):
        flat = vector.flatten()
        assert flat.dim() == 1 and flat.numel() == vector.numel()
        assert_identical(TaskVector.unflatten(flat, vector), vector)
    shapes = {k: tuple(v.shape) for k, v in tv.items()}
    assert_identical(TaskVector.unflatten(tv.flatten(), shapes), tv)
    with pytest.raises(ValueError):
        TaskVector.unflatten(tv.flatten()[:-1], tv)


def test_save_load_round_trip_bit_identical(tmp_path, peft_state, tv, meta):
    path = tmp_path / "client.safetensors"
    TaskVector(tv, meta).save(path)
    loaded = TaskVector.load(path, template=peft_state, expect={"base_model": "tiny-bert", "round": 3})
    assert_identical(loaded, tv)
    decoded = loaded.metadata
    assert decoded["task_ids"] == ["sst2", "rte"] and decoded["round"] == 3 and decoded["client_id"] == "c7"
    assert decoded["format"] == "hf_fedtask.core.taskvector" and decoded["format_version"] == "1"
    assert decoded["kind"] == "delta" and decoded["dtype"] == "float32"
    assert decoded["peft_config_hash"] == peft_config_hash(lora_config())
    assert list(TaskVector.load(path)) == sorted(tv)  # no template: sorted key order


def test_save_uses_given_metadata_and_infers_dtype(tmp_path, tv, meta):
    path = tmp_path / "a.safetensors"
    TaskVector(tv).to(torch.bfloat16).save(path, metadata={**meta, "round": ""})
    decoded = TaskVector.load(path).metadata
    assert decoded["dtype"] == "bfloat16" and decoded["round"] is None and decoded["base_model"] == "tiny-bert"


def test_bytes_round_trip(peft_state, tv, meta):
    data = tv.to_bytes(meta)
    loaded = TaskVector.from_bytes(data, template=peft_state, expect={"peft_config_hash": meta["peft_config_hash"]})
    assert_identical(loaded, tv)
    assert loaded.metadata["task_ids"] == ["sst2", "rte"]


def test_views_and_tied_tensors_serialize(tv):
    shared = torch.arange(6.0)
    tied = TaskVector({"a": shared, "b": shared, "c": torch.ones(3, 2).t()})
    assert_identical(TaskVector.from_bytes(tied.to_bytes()), tied)
    views = TaskVector.unflatten(tv.flatten(), tv)
    assert_identical(TaskVector.from_bytes(views.to_bytes(), template=tv), tv)


def test_truncated_file_names_the_file(tmp_path, tv, meta):
    path = tmp_path / "truncated.safetensors"
    TaskVector(tv, meta).save(path)
    data = path.read_bytes()
    for cut in (len(data) - 7, 40, 3):
        path.write_bytes(data[:cut])
        with pytest.raises(TaskVectorError, match="truncated.safetensors") as info:
            TaskVector.load(path)
        assert "\n" not in str(info.value)
        with pytest.raises(TaskVectorError, match="upload-1"):
            TaskVector.from_bytes(data[:cut], source="upload-1")


@pytest.mark.parametrize("data", [b"", b"\x00" * 8, b"not a safetensors file at all", os.urandom(256), bytearray(8)])
def test_garbage_bytes(data):
    with pytest.raises(TaskVectorError, match="client-9"):
        TaskVector.from_bytes(data, source="client-9")


def test_missing_file_and_directory(tmp_path):
    for path in (tmp_path / "absent.safetensors", tmp_path):
        with pytest.raises(TaskVectorError, match=str(path.name)):
            TaskVector.load(path)


def test_header_format_required(tmp_path, tv):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file(dict(tv), path)
    with pytest.raises(TaskVectorError, match="plain.safetensors.*'format'"):
        TaskVector.load(path)
    safetensors.torch.save_file(dict(tv), path,
                                metadata={"format": "hf_fedtask.core.taskvector", "format_version": "2"})
    with pytest.raises(TaskVectorError, match="format_version.*'2'"):
        TaskVector.load(path)


@pytest.mark.parametrize("field, value", [("round", "three"), ("task_ids", "sst2"), ("task_ids", '{"a": 1}')])
def test_undecodable_header_field(tv, meta, field, value):
    data = safetensors.torch.save(dict(tv), metadata={**meta, field: value})
    with pytest.raises(TaskVectorError, match=f"up.bin.*'{field}'"):
        TaskVector.from_bytes(data, source="up.bin")


KEY = "base_model.model.bert.encoder.layer.1.attention.self.value.lora_B.weight"


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: d.update({KEY: torch.zeros(4, 32)}), "shape"),
        (lambda d: d.update({KEY: d[KEY].double()}), "dtype float64, expected float32"),
        (lambda d: d.pop(KEY), "missing"),
        (lambda d: d.update({KEY + ".extra": torch.zeros(1)}), "unexpected"),
    ],
)
def test_template_mismatch_names_key(peft_state, tv, meta, corrupt, message):
    tensors = dict(tv)
    corrupt(tensors)
    data = TaskVector(tensors).to_bytes(meta)
    with pytest.raises(TaskVectorError, match="client-3.bin") as info:
        TaskVector.from_bytes(data, source="client-3.bin", template=peft_state)
    assert KEY in str(info.value) and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_values_rejected(tmp_path, peft_state, tv, meta, bad):
    tensors = {k: v.clone() for k, v in tv.items()}
    tensors[KEY][1, 2] = bad
    poisoned = TaskVector(tensors, meta)
    assert not poisoned.is_finite() and poisoned.nonfinite_keys() == [KEY]
    assert tv.is_finite() and tv.nonfinite_keys() == []
    path = tmp_path / "poisoned.safetensors"
    poisoned.save(path)
    with pytest.raises(TaskVectorError, match="poisoned.safetensors") as info:
        TaskVector.load(path, template=peft_state)
    assert KEY in str(info.value)
    with pytest.raises(TaskVectorError, match=KEY.replace(".", r"\.")):
        validate(poisoned, source="mem")


@pytest.mark.parametrize(
    "field, expected", [("base_model", "other-bert"), ("peft_config_hash", peft_config_hash(lora_config(r=8)))]
)
def test_expect_mismatch_names_field_and_values(tv, meta, field, expected):
    data = tv.to_bytes(meta)
    with pytest.raises(TaskVectorError) as info:
        TaskVector.from_bytes(data, source="c1.bin", expect={field: expected})
    message = str(info.value)
    assert "c1.bin" in message and repr(field) in message
    assert repr(expected) in message and repr(meta[field]) in message


def test_expect_compares_encoded_values(tv, meta):
    data = tv.to_bytes(meta)
    TaskVector.from_bytes(data, expect={"round": 3, "task_ids": ["sst2", "rte"], "kind": "delta"})
    with pytest.raises(TaskVectorError, match="'round'"):
        TaskVector.from_bytes(data, expect={"round": 4})


def test_atomic_save_leaves_no_temp_files(tmp_path, tv, meta):
    path = tmp_path / "out.safetensors"
    TaskVector(tv, meta).save(path)
    (tv * 2).save(path, metadata=meta)  # overwrite
    assert os.listdir(tmp_path) == ["out.safetensors"]
    assert_identical(TaskVector.load(path, template=tv), tv * 2)


def test_failed_save_leaves_existing_file_untouched(tmp_path, monkeypatch, tv, meta):
    path = tmp_path / "out.safetensors"
    TaskVector(tv, meta).save(path)
    before = path.read_bytes()

    unserializable = TaskVector({"a": torch.ones(3).to_sparse()})
    with pytest.raises((RuntimeError, ValueError)):  # safetensors stores dense tensors only
        unserializable.save(path, metadata=meta)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["out.safetensors"]

    def failing_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(taskvector_file.safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        (tv * 3).save(path, metadata=meta)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["out.safetensors"]


def test_peft_config_hash_ignores_machine_local_fields():
    base = peft_config_hash(lora_config())
    assert len(base) == 16 and int(base, 16) >= 0
    assert peft_config_hash(lora_config(base_model_name_or_path="/home/a/bert", inference_mode=True)) == base
    assert peft_config_hash(lora_config(revision="main")) == base
    assert peft_config_hash(lora_config(target_modules={"value", "query"})) == base
    assert peft_config_hash(lora_config(target_modules=["value", "query"])) == base
    assert peft_config_hash(lora_config(r=8)) != base
    assert peft_config_hash(lora_config(target_modules=["query", "key"])) != base
    assert peft_config_hash(lora_config(lora_alpha=16)) != base


def test_peft_config_hash_equal_after_save_pretrained(tmp_path):
    config = lora_config(target_modules=["value", "query", "key", "dense"], base_model_name_or_path="x")
    config.save_pretrained(tmp_path)
    as_json = json.loads((tmp_path / "adapter_config.json").read_text())
    as_json["target_modules"] = sorted(as_json["target_modules"], reverse=True)
    reloaded = peft.PeftConfig.from_pretrained(tmp_path)
    assert peft_config_hash(as_json) == peft_config_hash(reloaded) == peft_config_hash(config)


def test_make_metadata_is_str_to_str_and_validates_kind(meta):
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["task_ids"] == '["sst2", "rte"]' and meta["round"] == "3"
    assert make_metadata(
        base_model="m", base_model_revision="r", peft_config_hash="h", kind="absolute", task_ids=[],
        dtype=torch.bfloat16, lr=0.1,
    ) == {
        "format": "hf_fedtask.core.taskvector", "format_version": "1", "base_model": "m", "base_model_revision": "r",
        "peft_config_hash": "h", "kind": "absolute", "task_ids": "[]", "client_id": "", "round": "",
        "dtype": "bfloat16", "lr": "0.1",
    }
    with pytest.raises(ValueError, match="kind"):
        make_metadata(base_model="m", base_model_revision="r", peft_config_hash="h", kind="sum", task_ids=[])


def test_inspect_file_reports_keys_metadata_totals(tmp_path, tv, meta):
    path = tmp_path / "client.safetensors"
    TaskVector(tv, meta).save(path)
    report = inspect_file(path)
    for key, value in tv.items():
        line = next(line for line in report.splitlines() if line.startswith(key + " "))
        assert str(tuple(value.shape)) in line and "float32" in line and str(value.numel()) in line
    for value in meta.values():
        assert value in report
    assert f"tensors: {len(tv)}" in report and f"parameters: {tv.numel()}" in report
    assert f"file size: {path.stat().st_size} bytes" in report
    assert f"L2 norm: {tv.norm():.6g}" in report
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(TaskVectorError, match="client.safetensors"):
        inspect_file(path)
