"""The trust boundary (`hf_fedtask.engine.trust`): every bad reply a malicious but authenticated client can
send (`tests/malicious.py`) is refused with one line naming the client, round and field; the server lives
on; the round equals the round in which that client was silent, so no other client's state and no server
state is changed by it. Through the in-process engine, Flower's real ServerApp/ClientApp (InProcessGrid)
and torchrun ranks; the DP re-clip bypass and MaT-FL's per-client overwrite as regression tests."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import make_config, read_records, tensors_equal
from malicious import ATTACKS, AdversarialTransport, MaliciousRuntime

from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
from hf_fedtask.core.state import model_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine import run as federation
from hf_fedtask.engine.trust import accept_update
from hf_fedtask.errors import UntrustedUpload

# the field each attack is refused by
REFUSED_FIELD = {
    "another_clients_id": "client_id", "the_sums_id": "client_id", "a_past_round": "round",
    "a_future_round": "round", "a_task_it_does_not_hold": "num_samples", "a_count_of_zero": "num_samples.",
    "a_negative_count": "num_samples.", "a_fractional_count": "num_samples.", "an_inflated_count": "num_samples.",
    "nan": "NaN or Inf", "inf": "NaN or Inf", "a_wrong_shape": "has shape", "a_wrong_dtype": "has dtype",
    "truncated_safetensors": "cannot read", "an_oversized_header_length": "cannot read", "empty_bytes": "cannot read",
    "counts_as_a_json_list": "num_samples", "counts_not_json": "not JSON", "metrics_as_a_json_string": "metrics",
    "a_nan_metric": "metrics.train_loss", "round_null": "round", "client_id_missing": "client_id",
    "another_base_model": "base_model",
}


def flat(state) -> dict[str, torch.Tensor]:
    """A state's tensors, one dict."""
    return {f"{name}::{k}": t for name, tv in state.vectors.items() for k, t in tv.items()}


def test_every_attack_has_its_expected_refusal():
    assert sorted(REFUSED_FIELD) == sorted(ATTACKS)


@pytest.fixture(scope="module")
def fed(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory):
    """One in-process federation (4 clients, one local step), shared: each test steps one round from the start."""
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path_factory.mktemp("trust") / "run")
    fed = federation.Federation(config)
    fed.start = fed.initial_state()  # built once: a later `initial_state()` reads the host's trained LoRA init
    return fed


def _round(fed, transport):
    return fed.server.round(copy.deepcopy(fed.start), 1, transport)


@pytest.fixture(scope="module")
def silent_round(fed):
    """Round 1 with client 1 silent: what every refused reply of client 1 must leave behind."""
    MaliciousRuntime.arm(None)
    return _round(fed, AdversarialTransport(fed.env, silent={1}))


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_bad_upload_is_refused_and_the_round_equals_the_clients_dropout(attack, fed, silent_round, caplog):
    MaliciousRuntime.arm(attack, target=1)
    with caplog.at_level(logging.WARNING, logger="hf_fedtask.engine.server"):
        state, record = _round(fed, AdversarialTransport(fed.env))
    reference, expected = silent_round
    assert record["clients"] == [0, 2, 3]
    why = record["failed_clients"]["1"]
    assert why.startswith("refused: client 1, round 1: refused upload") and "\n" not in why
    assert REFUSED_FIELD[attack] in why, why
    assert tensors_equal(flat(state), flat(reference))
    assert record["train_loss"] == expected["train_loss"] and record["eval"] == expected["eval"]
    assert any("client 1 is left out of this round" in r.getMessage() for r in caplog.records)


def test_an_honest_round_passes_the_boundary_untouched(fed, silent_round):
    MaliciousRuntime.arm(None)
    state, record = _round(fed, AdversarialTransport(fed.env))
    assert record["clients"] == [0, 1, 2, 3] and "failed_clients" not in record
    assert not tensors_equal(flat(state), flat(silent_round[0]))


def test_the_boundary_takes_the_sender_not_the_header(fed):
    """`accept_update` returns the transport's sender as the id, its own counts, and refuses a header that differs."""
    MaliciousRuntime.arm(None)
    state, header = copy.deepcopy(fed.start), fed.env.header()
    replies = AdversarialTransport(fed.env).exchange(_instructions(fed, state, [1]))
    templates = fed.strategy.update_templates(state, 1, state.allocation[1])
    counts = fed.server.sample_counts(1, state.allocation[1])
    update = accept_update(replies[1], sender=1, round_=1, templates=templates, header=header, counts=counts)
    assert update.client_id == 1 and update.num_samples == counts
    with pytest.raises(UntrustedUpload, match=r"^client 2, round 1: refused upload: header 'client_id' is '1'") as e:
        accept_update(replies[1], sender=2, round_=1, templates=templates, header=header, counts=counts)
    assert (e.value.client, e.value.round, e.value.field) == (2, 1, "client_id")


def _instructions(fed, state, clients):
    from hf_fedtask.core.wire import pack_vectors
    from hf_fedtask.engine.messages import Instruction

    return [Instruction("train", 1, c, pack_vectors(fed.strategy.downlink(state, c, state.allocation[c])).to_bytes())
            for c in clients]


def test_a_replayed_upload_of_an_earlier_round_is_refused(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", rounds=2)
    MaliciousRuntime.arm("a_past_round", target=2, from_round=2)
    federation.run(config, engine=lambda env: AdversarialTransport(env))
    first, second = read_records(tmp_path / "run")
    assert first["clients"] == [0, 1, 2, 3]
    assert "header 'round' is '1', the current round is 2" in second["failed_clients"]["2"]


def test_bad_uploads_stop_ends_the_run_before_the_round_is_written(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", rounds=2, bad_uploads="stop")
    MaliciousRuntime.arm("another_clients_id", target=3, from_round=2)
    with pytest.raises(UntrustedUpload, match=r"^client 3, round 2: refused upload: header 'client_id' is '0'") as e:
        federation.run(config, engine=lambda env: AdversarialTransport(env))
    assert e.value.field == "client_id"
    assert [r["round"] for r in read_records(tmp_path / "run")] == [1]
    assert TaskVector.load(tmp_path / "run" / CHECKPOINT_FILE).metadata["round"] == 1


# -- regressions: the attacks the boundary was built against -------------------------------------------------

def _state_distance(a, b) -> float:
    fa, fb = flat(a), flat(b)
    return float(sum(torch.sum((fa[k].double() - fb[k].double()) ** 2) for k in fa)) ** 0.5


@pytest.mark.parametrize("attack", [None, "the_sums_id"])
def test_a_huge_upload_cannot_skip_the_dp_reclip(attack, tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """Client 1 uploads 1,000 times its clipped update, under its own id (the server re-clips it to C) or
    under the secure-aggregation sum's id -1 (refused): either way its effect stays within the clip norm."""
    clip = 0.05
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", dp_clip=clip, dp_noise_multiplier=0.0)
    fed = federation.Federation(config)
    start = fed.initial_state()
    MaliciousRuntime.arm(None)
    silent, _ = fed.server.round(copy.deepcopy(start), 1, AdversarialTransport(fed.env, silent={1}))
    MaliciousRuntime.arm(attack, target=1, scale=1000.0)
    state, record = fed.server.round(copy.deepcopy(start), 1, AdversarialTransport(fed.env))
    refused = record["private"].get("failed_clients", {})  # under DP the ids stay in the server's own log
    assert ("1" in refused) == (attack is not None)
    assert _state_distance(state, silent) <= 2 * clip * (1 + 1e-4)
    assert _state_distance(state, start) <= 4 * clip * (1 + 1e-4)


def test_mat_fl_keeps_each_clients_model_from_another_client(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """Client 1 claims to be client 0: MaT-FL would have moved client 0's per-client model by client 1's
    update; it is refused, and client 0's model is the one its own update gave."""
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run", strategy="matfl")
    fed = federation.Federation(config)
    start = fed.initial_state()
    MaliciousRuntime.arm(None)
    silent, _ = fed.server.round(copy.deepcopy(start), 1, AdversarialTransport(fed.env, silent={1}))
    MaliciousRuntime.arm("another_clients_id", target=1, other=0)
    state, record = fed.server.round(copy.deepcopy(start), 1, AdversarialTransport(fed.env))
    assert "header 'client_id' is '0'" in record["failed_clients"]["1"]
    for c in (0, 2, 3):
        assert tensors_equal(dict(state.vectors[model_name(c)]), dict(silent.vectors[model_name(c)]))
    assert tensors_equal(dict(state.vectors[model_name(1)]), dict(start.vectors[model_name(1)]))


# -- the other engines: Flower's apps over an InProcessGrid, and torchrun ranks -------------------------------

@pytest.mark.parametrize("attack", ["another_clients_id", "truncated_safetensors", "a_task_it_does_not_hold"])
def test_flower_refuses_a_bad_upload_and_equals_the_clients_dropout(attack, tiny_bert_dir, tiny_tasks_dir,
                                                                     tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from test_flower import drive, records, tiny

    from hf_fedtask.engine.flower import handler as flower_handler

    MaliciousRuntime.arm(None)
    drive(tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "silent", rounds=1, save_payloads=False), silent={1})
    monkeypatch.setattr(flower_handler, "ClientRuntime", MaliciousRuntime)
    MaliciousRuntime.arm(attack, target=1)
    drive(tiny(tiny_bert_dir, tiny_tasks_dir, tmp_path / "attacked", rounds=1, save_payloads=False))
    (silent,), (attacked,) = records(tmp_path / "silent"), records(tmp_path / "attacked")
    why = attacked.pop("failed_clients")["1"]
    assert why.startswith("refused: client 1, round 1: refused upload") and REFUSED_FIELD[attack] in why
    assert silent.pop("failed_clients") == {"1": "no reply"}
    traffic = ("bytes", "params")  # the refused client's downlink and upload were sent; the silent one's upload not
    assert {k: v for k, v in attacked.items() if not k.startswith(traffic)} == \
        {k: v for k, v in silent.items() if not k.startswith(traffic)}
    a, b = (TaskVector.load(tmp_path / d / CHECKPOINT_FILE) for d in ("attacked", "silent"))
    assert tensors_equal(dict(a), dict(b))


_ATTACK_ON_RANKS = """
import sys
sys.path.insert(0, {tests!r})
from malicious import MaliciousRuntime
import hf_fedtask.engine.ranks as ranks
import hf_fedtask.engine.transport as transport

MaliciousRuntime.arm({attack!r}, target={target})
ranks.ClientRuntime = MaliciousRuntime
transport.ClientRuntime = MaliciousRuntime
"""


def test_torchrun_ranks_refuse_a_bad_upload_as_one_process_does(tiny_bert_dir, tiny_tasks_dir, tmp_path):
    """Every client a `MaliciousRuntime` on both ranks (client 3 sends another's id): the launch refuses it
    and ends with the single process's run, tensor for tensor."""
    from test_accelerators import _torchrun

    tests = str(Path(__file__).parent)
    config = make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "one")
    MaliciousRuntime.arm("another_clients_id", target=3)
    federation.run(config, engine=lambda env: AdversarialTransport(env))
    launched = dataclasses.replace(config, output_dir=str(tmp_path / "two"))
    proc = _torchrun(tmp_path, launched, prelude=_ATTACK_ON_RANKS.format(tests=tests, attack="another_clients_id",
                                                                          target=3))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (one,), (two,) = read_records(tmp_path / "one"), read_records(tmp_path / "two")
    assert "header 'client_id' is '0'" in two["failed_clients"]["3"]
    assert one["failed_clients"] == two["failed_clients"] and one["clients"] == two["clients"] == [0, 1, 2]
    a, b = (TaskVector.load(tmp_path / d / CHECKPOINT_FILE) for d in ("one", "two"))
    assert tensors_equal(dict(a), dict(b))
    assert json.loads(json.dumps(two["eval"])) == one["eval"]
