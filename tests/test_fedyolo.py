"""FedYolo (Zhang et al., 2023, arXiv:2307.04905, Alg. 1): per-task modules in named PEFT adapters,
the share variants, the secure-aggregation privacy variant, communication accounting (T × M × P), and
the baselines (modular FedAvg = `fedavg`, full-update FedAvg = `peft_method="full"`, local-only,
FedAvg+Local).
Tiny BERT (L = 2 blocks) and tiny tasks; no network."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_fedtask.core.checkpoint import load_checkpoint
from hf_fedtask.core.secagg import SecAggClient, SecAggServer, encode_fixed_point
from hf_fedtask.core.state import COUNTS, SHARED, module_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.engine import run as federation
from hf_fedtask.engine.secure import SecureAggregation
from hf_fedtask.engine.trust import accept_fields
from hf_fedtask.errors import ConfigError, UntrustedUpload
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.fedyolo import adapter_name, block_index, shared_module_keys
from hf_fedtask.workflows.personalize import forgetting_ratio, local_only, personalize

TASKS = ("colors", "moods")


@pytest.fixture
def yolo_config(tiny_config):
    """One FedYolo round on 4 clients, one task each: 0, 2 hold colors and 1, 3 hold moods."""
    tiny_config.strategy = "fedyolo"
    tiny_config.strategy_options = {}
    tiny_config.rounds = 1
    tiny_config.save_payloads = True
    return tiny_config


def _payloads(run_dir: Path, round_: int, direction: str) -> dict[int, dict[str, TaskVector]]:
    """Client id -> the named vectors of its saved uplink or downlink payload."""
    out = {}
    for path in sorted((run_dir / "payloads" / f"round_{round_}").glob(f"*.{direction}.safetensors")):
        cid = int(path.name.split(".")[0].removeprefix("client_"))
        out[cid] = unpack_vectors(TaskVector(load_file(path)))
    return out


def _final(config):
    sim = federation.Federation(config)
    state, history, _ = load_checkpoint(Path(config.output_dir), fingerprint=config.fingerprint(),
                                        template=sim.initial_state())
    return sim, state, history


def _assert_vectors_close(a: dict, b: dict, **tol):
    assert set(a) == set(b)
    for name, vector in a.items():
        assert list(vector) == list(b[name]), name
        for k, t in vector.items():
            torch.testing.assert_close(t, b[name][k], **tol)


def test_block_index_and_the_first_half_of_the_blocks():
    bert = [f"base_model.model.bert.encoder.layer.{i}.attention.self.query.lora_A.weight" for i in range(4)]
    vit = [f"base_model.model.vit.encoder.layers.{i}.mlp.bottleneck_down.weight" for i in range(3)]
    assert [block_index(k) for k in bert] == [0, 1, 2, 3] and [block_index(k) for k in vit] == [0, 1, 2]
    assert block_index("prompt_embeddings") is None
    assert shared_module_keys(bert, "half") == bert[:2]
    assert shared_module_keys(vit, "half") == vit[:1]  # ⌊3/2⌋ = 1
    assert shared_module_keys(bert, "none") == [] and shared_module_keys(bert, "all") == bert
    with pytest.raises(ConfigError, match="share='half' needs PEFT modules inside numbered transformer blocks"):
        shared_module_keys(["prompt_embeddings"], "half")
    with pytest.raises(ConfigError, match="share: must be one of none, half, all, got 'most'"):
        build_strategy("fedyolo", {"share": "most"})


@pytest.mark.parametrize("share", ["none", "half", "all"])
def test_round_equals_hand_averaged_uploads_and_downlinks_hold_only_own_tasks(yolo_config, share):
    yolo_config.strategy_options["share"] = share
    yolo_config.participation = 0.75  # round 1 samples clients 1, 2, 3: moods twice, colors once
    results = federation.run(yolo_config)
    sim, state, history = _final(yolo_config)
    initial = sim.initial_state()
    assert history[0]["clients"] == [1, 2, 3]
    up, down = (_payloads(Path(yolo_config.output_dir), 1, "uplink"),
                _payloads(Path(yolo_config.output_dir), 1, "downlink"))
    for cid in (1, 2, 3):
        (task,) = sim.allocation[cid]
        own = {name for name in initial.vectors if name == SHARED or name.endswith(f"/{task}")}
        assert set(down[cid]) == own and set(up[cid]) == own  # never another task's module
    # by hand: each vector moves by the unweighted mean of the uploads that carry it (its task's
    # sampled holders; for the shared modules, every sampled client)
    expected = {}
    for name, start in initial.vectors.items():
        uploads = [u[name] for u in up.values() if name in u]
        expected[name] = start + sum(uploads) / len(uploads)
    _assert_vectors_close(state.vectors, expected)
    # the layout of each variant: L = 2 blocks, so share-half shares block 0
    keys = sim.host.shared_keys
    shared = list(state.vectors.get(SHARED, {}))
    assert shared == {"none": [], "half": [k for k in keys if block_index(k) == 0], "all": keys}[share]
    for task in TASKS:
        assert list(state.vectors.get(module_name(task), {})) == [k for k in keys if k not in shared]
        assert list(sim.strategy.task_parameters(state, task)) == [*keys, *sim.host.head_keys]
    assert results["shared_parameters"] == (state.vectors[SHARED].numel() if shared else 0)


def test_tasks_without_a_sampled_client_are_unchanged(yolo_config):
    yolo_config.participation = 0.5  # round 1 samples clients 1 and 3, both holding moods
    federation.run(yolo_config)
    sim, state, history = _final(yolo_config)
    initial = sim.initial_state()
    assert history[0]["clients"] == [1, 3]
    for name, start in initial.vectors.items():
        unchanged = all(torch.equal(state.vectors[name][k], t) for k, t in start.items())
        assert unchanged == name.endswith("/colors"), name


def test_each_task_trains_in_its_own_named_peft_adapter(yolo_config):
    yolo_config.zeta = 0.5  # client 2 holds both tasks and trains them in turn
    sim = federation.Federation(yolo_config)
    host, train = sim.host, sim.trainer.train
    active = []

    def spy(state, data, **kwargs):
        active.append(host.model.active_adapter)
        return train(state, data, **kwargs)

    sim.trainer.train = spy
    sim.run_round(sim.initial_state(), 1)
    assert set(host.model.peft_config) == {"default", *(adapter_name(t) for t in TASKS)}
    assert active == [adapter_name(t) for cid in range(4) for t in sim.allocation[cid]]
    assert host.model.active_adapter == "default"  # evaluation and the other strategies use it
    # state() and load_state() act on the active adapter only
    default = host.state()
    with host.adapter(adapter_name("colors")):
        ones = default.apply(torch.ones_like)
        host.load_state(ones)
        assert all(torch.equal(host.state()[k], t) for k, t in ones.items())
    assert all(torch.equal(host.state()[k], t) for k, t in default.items())


@pytest.mark.parametrize(("peft_method", "share"), [("prompt", "none"), ("bottleneck", "half")])
def test_other_module_types_train_per_task(yolo_config, peft_method, share):
    yolo_config.peft_method, yolo_config.strategy_options["share"] = peft_method, share
    sim = federation.Federation(yolo_config)
    initial = sim.initial_state()
    state, record = sim.run_round(initial, 1)
    assert set(sim.host.model.peft_config) == {"default", *(adapter_name(t) for t in TASKS)}
    for task in TASKS:
        assert (state.vectors[module_name(task)] - initial.vectors[module_name(task)]).norm() > 0
    assert record["params_uplink"] == sum(sum(v.numel() for v in sim.strategy.downlink(initial, c, sim.allocation[c])
                                              .values()) for c in record["clients"])


def test_share_half_refuses_prompt_tuning(yolo_config):
    yolo_config.peft_method, yolo_config.strategy_options["share"] = "prompt", "half"
    with pytest.raises(ConfigError, match="share='half'"):
        federation.Federation(yolo_config)


@pytest.mark.parametrize("sample_weighted", [False, True])
def test_secure_aggregation_equals_plain_and_the_server_holds_only_masked_int64(yolo_config, monkeypatch,
                                                                                sample_weighted):
    yolo_config.zeta = 0.5
    yolo_config.strategy_options.update(share="half", sample_weighted=sample_weighted)
    sim = federation.Federation(yolo_config)
    initial = sim.initial_state()
    plain, _ = sim.run_round(initial, 1)

    strategy = sim.strategy
    strategy.config.secure_aggregation = True
    slots, received, aggregated = {}, [], []
    client_update, receive, aggregate = strategy.client_update, SecAggServer.receive, strategy.server_aggregate

    def spy_client(downlink, job, trainer):
        slots[job.client_id] = client_update(downlink, job, trainer)
        return slots[job.client_id]

    def spy_receive(server, client_id, masked):
        received.append((client_id, masked))
        return receive(server, client_id, masked)

    def spy_aggregate(state, updates):
        aggregated.append(updates)
        return aggregate(state, updates)

    monkeypatch.setattr(strategy, "client_update", spy_client)
    monkeypatch.setattr(SecAggServer, "receive", spy_receive)
    monkeypatch.setattr(strategy, "server_aggregate", spy_aggregate)
    secure, record = sim.run_round(initial, 1)

    # (a) the server side holds masked int64 uploads that name no task, and aggregates their sum only
    assert [cid for cid, _ in received] == record["clients"] == [0, 1, 2, 3]
    for cid, masked in received:
        assert masked.raw_metadata["task_ids"] == "[]" and "num_samples" not in masked.raw_metadata
        encoded = encode_fixed_point(pack_vectors(slots[cid].vectors))
        assert set(masked) == set(encoded)
        for key, t in masked.items():
            assert t.dtype == torch.int64 and not torch.equal(t, encoded[key]), key
    (updates,) = aggregated
    (total,) = updates
    assert total.client_id == -1 and total.num_samples == {} and record["train_loss"] is None
    _assert_vectors_close(total.vectors, {name: sum(u.vectors[name] for u in slots.values()) for name in total.vectors},
                          atol=1e-6, rtol=0)
    # every client uploads a slot for each task, zeros for the tasks it does not hold, and the counts
    for cid, update in slots.items():
        for task in TASKS:
            held = task in sim.allocation[cid]
            assert (update.vectors[f"head/{task}"].norm() > 0) == held
        counts = [(len(sim.client_data(cid)[t]) if sample_weighted else 1.0) if t in sim.allocation[cid] else 0.0
                  for t in TASKS]
        assert update.vectors[COUNTS]["tasks"].tolist() == counts
    # (b) the same per-task means as plain FedYolo, to fixed-point precision
    _assert_vectors_close(secure.vectors, plain.vectors, atol=1e-5, rtol=0)


HEADER = {"base_model": "m", "base_model_revision": "r", "peft_config_hash": "h"}


def _masked_upload(client: SecAggClient, update: ClientUpdate, peers: dict) -> bytes:
    """What a client's half uploads: the packed update masked, under a header naming no task."""
    masked = client.mask(pack_vectors(update.vectors), update.round, peers)
    meta = make_metadata(**HEADER, kind="delta", task_ids=[], client_id=update.client_id, round=update.round)
    return masked.to_bytes(metadata={**meta, **masked.raw_metadata})


def test_secure_round_refuses_plain_uploads_and_recovers_a_dropped_client():
    layout = {"module/a": TaskVector({"w": torch.zeros(3)})}
    secure = SecureAggregation(layout, 1, HEADER)
    clients = {c: SecAggClient(c, seed=0) for c in range(3)}
    for c, client in clients.items():
        key = TaskVector({}).to_bytes(metadata=make_metadata(**HEADER, kind="delta", task_ids=[], client_id=c, round=1,
                                                             public_key=str(client.public_key)))
        secure.register(c, accept_fields(key, sender=c, round_=1, header=HEADER, fields=("public_key",),
                                         what="public key"))
    peers = {int(c): int(k) for c, k in secure.peers.items()}
    updates = {c: ClientUpdate(c, 1, {"module/a": TaskVector({"w": torch.full((3,), c + 1.0)})}, {"a": 4})
               for c in (0, 2)}

    def masked(c: int, data: bytes) -> TaskVector:  # the round loop's check of a masked upload
        return accept_fields(data, sender=c, round_=1, header=HEADER, template=secure.template, what="masked upload")

    with pytest.raises(UntrustedUpload, match="expected int64"):  # an unmasked float upload never reaches the sum
        masked(0, updates[0].to_bytes(**HEADER))
    for cid, update in updates.items():
        secure.receive(cid, masked(cid, _masked_upload(clients[cid], update, peers)))
    # client 1 registered but never uploaded: the survivors reveal their pair seeds with it
    asked = []

    def reveal(survivor, dropped):
        asked.append((survivor, dropped))
        return clients[survivor].reveal_pair_seeds(dropped, 1)

    torch.testing.assert_close(secure.finish(reveal).vectors["module/a"]["w"], torch.full((3,), 4.0))
    assert asked == [(0, [1]), (2, [1])]


def test_secure_upload_grows_to_k_task_slots(yolo_config):
    """(c) measured from the real payloads: K × (module + head) + K counts instead of module + head."""
    sim = federation.Federation(yolo_config)
    initial = sim.initial_state()
    _, plain = sim.run_round(initial, 1)
    sim.strategy.config.secure_aggregation = True
    _, secure = sim.run_round(initial, 1)
    module = initial.vectors[module_name("colors")].numel()
    heads = {t: initial.vectors[f"head/{t}"].numel() for t in TASKS}
    for cid in range(4):
        (task,) = sim.allocation[cid]
        p, s = plain["bytes_per_client"][str(cid)], secure["bytes_per_client"][str(cid)]
        assert p["params_uplink"] == module + heads[task]
        assert s["params_uplink"] == sum(module + h for h in heads.values()) + len(TASKS)
        assert s["params_downlink"] == p["params_downlink"]  # the downlink does not change
        assert s["uplink"] >= 8 * s["params_uplink"] > 2 * 4 * p["params_uplink"] * 0.95  # int64 slots


def test_bytes_and_parameter_counts_match_the_payloads_and_survive_resume(yolo_config):
    yolo_config.participation = 0.75
    federation.run(yolo_config)
    yolo_config.rounds = 2
    results = federation.run(yolo_config, resume=True)  # share="none": the state has no `shared` vector
    run_dir = Path(yolo_config.output_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        for cid, traffic in r["bytes_per_client"].items():
            for direction in ("uplink", "downlink"):
                path = run_dir / "payloads" / f"round_{r['round']}" / f"client_{cid}.{direction}.safetensors"
                assert path.stat().st_size == traffic[direction]
                assert sum(t.numel() for t in load_file(path).values()) == traffic[f"params_{direction}"]
        for direction in ("uplink", "downlink"):
            assert r[f"params_{direction}"] == sum(t[f"params_{direction}"] for t in r["bytes_per_client"].values())
    # the paper's communication cost T × M × P, totalled over the run
    assert results["params_uplink"] == sum(r["params_uplink"] for r in records) > 0
    assert results["params_downlink"] == sum(r["params_downlink"] for r in records) > 0
    assert results["shared_parameters"] == 0


def test_full_update_fedavg_sends_the_backbone_and_exports_a_stock_peft_adapter(tiny_config, tiny_bert_dir):
    """Modular FedAvg is `fedavg` (one module shared by all tasks, heads per task); full-update
    FedAvg is `fedavg` with peft_method="full". Their traffic ratio is their parameter ratio."""
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tiny_config.rounds, tiny_config.participation = 1, 0.5  # clients 1 and 3 (moods, 2 labels)
    out = tiny_config.output_dir
    modular = federation.run(tiny_config)
    tiny_config.peft_method, tiny_config.output_dir = "full", out + "-full"
    full = federation.run(tiny_config)
    backbone = sum(p.numel() for p in AutoModel.from_pretrained(tiny_bert_dir).parameters())
    head = 2 * 32 + 2
    lora = 2 * 2 * (8 * 32 + 32 * 8)  # 2 blocks × (query, value) × (A + B), r = 8, hidden 32
    for direction in ("uplink", "downlink"):
        assert modular[f"params_{direction}"] == 2 * (lora + head)
        assert full[f"params_{direction}"] == 2 * (backbone + head)
        assert full[f"params_{direction}"] / modular[f"params_{direction}"] > 100
        assert full[f"bytes_{direction}"] / modular[f"bytes_{direction}"] > 100
        # float32 parameters plus one safetensors header per payload, negligible for the full model
        assert 0 < full[f"bytes_{direction}"] - 4 * full[f"params_{direction}"] < 0.01 * full[f"bytes_{direction}"]
    # the exported full adapter loads with stock PEFT and reproduces the federated model
    sim, state, _ = _final(tiny_config)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    batch = tok(["happy day number 3", "sad night"], padding=True, return_tensors="pt")
    sim.host.load_state(sim.strategy.task_parameters(state, "moods"))
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2)
    loaded = PeftModel.from_pretrained(base, Path(tiny_config.output_dir) / "adapters" / "moods").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, sim.host.model.eval()(**batch).logits)


def test_forgetting_ratio():
    assert forgetting_ratio(0.8, 0.6) == pytest.approx(0.25)
    assert forgetting_ratio(0.5, 0.6) == pytest.approx(-0.2)  # personalizing helped
    assert forgetting_ratio(0.0, 0.3) is None


def test_fedavg_plus_local_reports_before_after_and_forgetting(tiny_config):
    tiny_config.rounds = 1
    results = federation.run(tiny_config)
    report = personalize(tiny_config.output_dir, epochs=1)
    assert set(report) == set(TASKS)
    for task, r in report.items():
        assert r["before"] == results["tasks"][task]["accuracy"] and r["clients"] == 2
        assert 0 <= r["after"] <= 1
        assert r["forgetting_ratio"] == forgetting_ratio(r["before"], r["after"])


def test_local_only_never_serializes_anything(tiny_config, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("local-only training must not serialize a payload")

    monkeypatch.setattr(TaskVector, "to_bytes", refuse)
    report = local_only(tiny_config)
    assert set(report) == set(TASKS)
    for r in report.values():
        assert len(r["per_client"]) == 2 and r["accuracy"] == pytest.approx(sum(r["per_client"]) / 2)


def test_secure_aggregation_with_one_client_per_round_is_refused_before_anything_is_written(yolo_config):
    yolo_config.strategy_options["secure_aggregation"] = True
    yolo_config.participation = 0.01
    with pytest.raises(ConfigError, match="at least 2 clients per round"):
        federation.run(yolo_config)
    assert not Path(yolo_config.output_dir).exists()
