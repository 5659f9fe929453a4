"""ClientUpdate wire format: round trip, and rejection of updates for another base model or PEFT config."""

import pytest
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.errors import TaskVectorError

HEADER = {"base_model": "org/base", "base_model_revision": "sha256:abc", "peft_config_hash": "0123456789abcdef"}


def _update(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ClientUpdate(
        client_id=7,
        round=3,
        vectors={
            "shared": TaskVector({"a.lora_A.weight": torch.randn(4, 8, generator=g),
                                  "a.lora_B.weight": torch.randn(8, 4, generator=g)}),
            "head/t1": TaskVector({"classifier.weight": torch.randn(3, 8, generator=g),
                                   "classifier.bias": torch.zeros(3)}),
        },
        num_samples={"t1": 40},
        metrics={"t1/train_loss": 0.5},
    )


def _templates(u):
    return {name: tv.zeros_like() for name, tv in u.vectors.items()}


def test_round_trip_is_exact():
    u = _update()
    back = ClientUpdate.from_bytes(u.to_bytes(**HEADER), templates=_templates(u), expect=HEADER, source="client 7")
    assert (back.client_id, back.round, back.num_samples, back.metrics) == (7, 3, {"t1": 40}, {"t1/train_loss": 0.5})
    for name, tv in u.vectors.items():
        assert list(back.vectors[name]) == list(tv) and all(torch.equal(back.vectors[name][k], tv[k]) for k in tv)


@pytest.mark.parametrize("field", ["base_model", "peft_config_hash"])
def test_update_for_another_base_model_or_peft_config_is_rejected(field):
    u = _update()
    payload = u.to_bytes(**{**HEADER, field: "something-else"})
    with pytest.raises(TaskVectorError, match=rf"client 7.*{field}"):
        ClientUpdate.from_bytes(payload, templates=_templates(u), expect=HEADER, source="client 7")


def test_update_with_a_wrongly_shaped_head_names_the_key():
    u = _update()
    u.vectors["head/t1"] = TaskVector({"classifier.weight": torch.zeros(5, 8), "classifier.bias": torch.zeros(5)})
    with pytest.raises(TaskVectorError, match=r"head/t1::classifier\.(weight|bias)"):
        ClientUpdate.from_bytes(u.to_bytes(**HEADER), templates=_templates(_update()), expect=HEADER, source="client 7")


def test_pack_unpack_keeps_names_with_slashes():
    u = _update()
    back = unpack_vectors(pack_vectors(u.vectors))
    assert list(back) == ["shared", "head/t1"] and list(back["head/t1"]) == list(u.vectors["head/t1"])


def test_an_empty_vector_survives_the_wire():
    """Linear probing shares no module: the empty `shared` vector must still arrive (as an empty vector)."""
    vectors = {"shared": TaskVector({}), "head/t": TaskVector({"w": torch.ones(2, 3)})}
    back = unpack_vectors(TaskVector.from_bytes(pack_vectors(vectors).to_bytes(), source="test"))
    assert sorted(back) == ["head/t", "shared"] and len(back["shared"]) == 0
    assert torch.equal(back["head/t"]["w"], vectors["head/t"]["w"])
