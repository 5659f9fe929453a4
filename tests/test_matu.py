"""MaTU: the strategy against an independent re-implementation of algorithms.md §3 written with flat
tensors, the wire format's byte count, statelessness of the server, and an end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine import run as federation
from hf_fedtask.merge.bitmask import unpack_bits
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import SHARED, head_name
from hf_fedtask.strategies.matu import (
    WIRE,
    decode_heads,
    decode_task,
    encode_wire,
    task_vector_name,
)

SHAPES = {"a.lora_A.weight": (4, 6), "a.lora_B.weight": (6, 4), "b.lora_A.weight": (3, 5)}
HEAD = {"classifier.modules_to_save.default.weight": (2, 4), "classifier.modules_to_save.default.bias": (2,)}


def random_tv(gen, shapes=SHAPES, scale=1.0):
    return TaskVector({k: torch.randn(s, generator=gen) * scale for k, s in shapes.items()})


# -- an independent reference, on flat tensors, straight from the spec ---------------------------
def ref_unify(taus: list[torch.Tensor]):
    sign = torch.stack(taus).sum(0).sign()
    stacked = torch.stack(taus)
    agree = (stacked.sign() == sign) & (sign != 0)
    tau = sign * (stacked.abs() * agree).max(0).values
    masks = [(t * tau) > 0 for t in taus]
    lams = [float(t.abs().sum() / (m * tau).abs().sum()) if (m * tau).abs().sum() > 0 else 0.0 for t, m in zip(taus, masks)]
    return tau, masks, lams


def ref_server(uploads, tasks_state, rho, kappa, eps, combine, include_self=False):
    """uploads: list of (num_samples{t: n}, tau_flat, masks{t: bool flat}, lams{t: float})."""
    hat, soft = {}, {}
    for t in sorted({t for u in uploads for t in u[0]}):
        holders = [u for u in uploads if t in u[0]]
        total = sum(u[0][t] for u in holders)
        recon = [u[2][t] * u[1] for u in holders]
        alpha = torch.stack([r.sign() for r in recon]).mean(0).abs()
        soft[t] = torch.where(alpha >= rho, torch.ones_like(alpha), alpha)
        hat[t] = soft[t] * sum(u[0][t] / total * u[3][t] * r for u, r in zip(holders, recon))
    names = list(hat)
    new = dict(tasks_state)
    for t in names:
        sims = {t2: 0.5 * (float((hat[t].sign() * hat[t2].sign()).mean()) + 1) for t2 in names}
        cands = sorted((t2 for t2 in names if sims[t2] > eps and (include_self or t2 != t)), key=lambda x: -sims[x])[:kappa]
        cross = sum((sims[t2] * soft[t] * hat[t2] for t2 in cands), torch.zeros_like(hat[t]))
        if combine == "sum" or not cands:
            new[t] = hat[t] + cross
        elif combine == "mean":
            new[t] = 0.5 * (hat[t] + cross)
        else:
            new[t] = (hat[t] + cross) / (1 + sum(sims[t2] for t2 in cands))
    return new


class FakeHost:
    def __init__(self, gen):
        self.gen = gen

    def initial_shared(self):
        return random_tv(self.gen)

    def initial_head(self, num_labels, seed):
        return TaskVector({k: torch.zeros(s) for k, s in HEAD.items()})


TASKS = ["t0", "t1", "t2", "t3"]


def make_state(strategy, allocation):
    gen = torch.Generator().manual_seed(0)
    tasks = [SimpleNamespace(name=t, num_labels=2) for t in TASKS]
    return strategy.init_state(FakeHost(gen), tasks, 0, allocation)


def test_client_unification_matches_the_reference():
    gen = torch.Generator().manual_seed(1)
    vectors = {t: random_tv(gen) for t in TASKS[:3]}
    heads = {t: TaskVector({k: torch.randn(s, generator=gen) for k, s in HEAD.items()}) for t in vectors}
    wire = encode_wire(vectors, "global_sum", heads=heads)
    assert list(wire) == ["unified", "masks", "rescalers", "heads"]  # four tensors whatever the task count
    tau, masks, lams = ref_unify([v.flatten() for v in vectors.values()])
    torch.testing.assert_close(wire["unified"], tau)
    for i, t in enumerate(vectors):
        assert torch.equal(unpack_bits(wire["masks"][i], tau.numel()), masks[i])
        assert float(wire["rescalers"][i]) == pytest.approx(lams[i], rel=1e-6)
        torch.testing.assert_close(decode_task(wire, i, vectors[t]).flatten(), lams[i] * masks[i] * tau)
    for t, h in decode_heads(wire, heads).items():
        assert all(torch.equal(h[k], heads[t][k]) for k in h)


@pytest.mark.parametrize("combine", ["sum", "mean", "s_normalized"])
def test_server_aggregation_matches_the_reference(combine):
    """Three participating clients over tasks t0-t2 (t3 has none: carried forward)."""
    allocation = {0: ["t0", "t1"], 1: ["t1", "t2"], 2: ["t0"], 3: ["t3"]}
    strategy = build_strategy("matu", {"combine": combine, "kappa": 2, "epsilon": 0.5, "rho": 0.4})
    state = make_state(strategy, allocation)
    gen = torch.Generator().manual_seed(2)
    common = random_tv(gen)  # shared direction so that tasks are similar (S > ε) and neighbours exist
    state.vectors[task_vector_name("t3")] = random_tv(gen)
    updates, uploads = [], []
    for cid in (0, 1, 2):
        vectors = {t: common + random_tv(gen, scale=0.7) for t in allocation[cid]}
        heads = {t: TaskVector({k: torch.randn(s, generator=gen) for k, s in HEAD.items()}) for t in vectors}
        samples = {t: 10 + 7 * cid + i for i, t in enumerate(vectors)}
        updates.append(ClientUpdate(cid, 1, {WIRE: encode_wire(vectors, "global_sum", heads=heads)}, samples))
        tau, masks, lams = ref_unify([v.flatten() for v in vectors.values()])
        uploads.append((samples, tau, dict(zip(vectors, masks)), dict(zip(vectors, lams))))
    carried = {t: state.vectors[task_vector_name(t)].flatten() for t in TASKS}
    expected = ref_server(uploads, carried, 0.4, 2, 0.5, combine)
    new = strategy.server_aggregate(state, updates)
    for t in TASKS:
        torch.testing.assert_close(new.vectors[task_vector_name(t)].flatten(), expected[t], rtol=1e-5, atol=1e-6)
    # heads: sample-weighted mean of the holders' changes
    h = [(u.num_samples["t0"], decode_heads(u.vectors[WIRE], {t: state.vectors[head_name(t)] for t in sorted(u.num_samples)})["t0"])
         for u in updates if "t0" in u.num_samples]
    mean = sum((n * v for n, v in h), h[0][1].zeros_like()) / sum(n for n, _ in h)
    torch.testing.assert_close(new.vectors[head_name("t0")].flatten(), (state.vectors[head_name("t0")] + mean).flatten())
    # the exported form is the unification of all four task vectors
    tau, masks, lams = ref_unify([expected[t] for t in TASKS])
    origin = state.vectors[SHARED].flatten()
    for i, t in enumerate(TASKS):
        shared = strategy.task_parameters(new, t).filter(lambda k: k in SHARED_KEYS)
        torch.testing.assert_close(shared.flatten(), origin + lams[i] * masks[i] * tau, rtol=1e-5, atol=1e-6)


SHARED_KEYS = set(SHAPES)


def test_neighbours_exclude_self_and_respect_epsilon_and_kappa():
    strategy = build_strategy("matu", {"kappa": 2, "epsilon": 0.5})
    s = torch.tensor([[1.0, 0.9, 0.6, 0.4], [0.9, 1.0, 0.7, 0.8], [0.6, 0.7, 1.0, 0.5], [0.4, 0.8, 0.5, 1.0]])
    assert strategy.neighbours(s, 0) == [1, 2]
    assert strategy.neighbours(s, 2) == [1, 0]  # 3 has S = 0.5, not > ε
    assert build_strategy("matu", {"kappa": 2, "include_self": True}).neighbours(s, 0) == [0, 1]
    assert build_strategy("matu", {"kappa": 0}).neighbours(s, 0) == []


def test_bad_matu_options_are_config_errors():
    from hf_fedtask.errors import ConfigError

    with pytest.raises(ConfigError, match="combine"):
        build_strategy("matu", {"combine": "avg"})
    with pytest.raises(ConfigError, match="rescaler"):
        build_strategy("matu", {"rescaler": "l2"})


@pytest.fixture
def matu_config(tiny_config):
    tiny_config.strategy = "matu"
    tiny_config.zeta = 0.5
    tiny_config.num_clients = 5
    return tiny_config


def test_server_keeps_only_per_task_state_and_same_tasks_get_same_downlink(matu_config):
    sim = federation.Federation(matu_config)
    state = sim.initial_state()
    names = set(state.vectors)
    for r in (1, 2):
        state, _ = sim.run_round(state, r)
        assert set(state.vectors) == names  # nothing appears per client
    tasks = {t.name for t in sim.tasks}
    assert all(n in (SHARED, "export") or n.split("/", 1)[1] in tasks
               for n in names)
    # relabelling the clients changes nothing on the server
    a = sim.strategy.downlink(state, 0, ["colors", "moods"])
    b = sim.strategy.downlink(state, 3, ["colors", "moods"])
    assert all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_uplink_bytes_meet_the_bound_and_match_the_files_on_disk(matu_config):
    """Exact wire bytes vs 4·d + k·(d/8 + 4) (+ the float32 heads, which MaTU does not unify)."""
    matu_config.save_payloads = True
    matu_config.rounds = 1
    federation.run(matu_config)
    run_dir = Path(matu_config.output_dir)
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for cid, traffic in record["bytes_per_client"].items():
        assert (run_dir / "payloads" / "round_1" / f"client_{cid}.uplink.safetensors").stat().st_size == traffic["uplink"]
        assert (run_dir / "payloads" / "round_1" / f"client_{cid}.downlink.safetensors").stat().st_size == traffic["downlink"]
    assert record["bytes_uplink"] == sum(t["uplink"] for t in record["bytes_per_client"].values())


def test_bfloat16_wire_halves_the_unified_vector_and_decodes_close():
    gen = torch.Generator().manual_seed(4)
    vectors = {t: random_tv(gen, {"w": (64, 64)}) for t in ("a", "b")}
    f32, bf16 = encode_wire(vectors, "global_sum"), encode_wire(vectors, "global_sum", "bfloat16")
    assert bf16["unified"].dtype == torch.bfloat16
    def size(w):  # the data section: the header's JSON length varies with its (unordered) metadata and padding
        payload = ClientUpdate(0, 1, {WIRE: w}, {"a": 1, "b": 1}).to_bytes(
            base_model="m", base_model_revision="r", peft_config_hash="h")
        return len(payload) - 8 - int.from_bytes(payload[:8], "little")
    assert size(f32) - size(bf16) == 2 * 64 * 64
    torch.testing.assert_close(decode_task(bf16, 0, vectors["a"])["w"], decode_task(f32, 0, vectors["a"])["w"],
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("k", [1, 3, 8, 30])
def test_uplink_bytes_within_one_percent_of_the_formula_at_minilm_size(k):
    """d = 73,728 (MiniLM, LoRA r=8 on query/value), k tasks with their train losses in the header:
    everything but the float32 heads (which MaTU does not unify) within 1% of 4·d + k·(d/8 + 4)."""
    gen = torch.Generator().manual_seed(3)
    shapes = {f"base_model.model.bert.encoder.layer.{i}.attention.self.{m}.lora_{ab}.weight":
              (8, 384) if ab == "A" else (384, 8) for i in range(6) for m in ("query", "value") for ab in "AB"}
    d = sum(a * b for a, b in shapes.values())
    names = [f"first_name_origin_{t}" for t in range(k)]  # long, realistic task names
    heads = {t: TaskVector({"classifier.weight": torch.randn(6, 384), "classifier.bias": torch.randn(6)}) for t in names}
    vectors = {t: random_tv(gen, shapes) for t in names}
    update = ClientUpdate(7, 12, {WIRE: encode_wire(vectors, "global_sum", heads=heads)}, {t: 133 for t in names},
                          {f"{t}/train_loss": 0.123456789 for t in names})
    size = len(update.to_bytes(base_model="sentence-transformers/all-MiniLM-L6-v2",
                               base_model_revision="sha256:" + "0" * 64, peft_config_hash="0" * 64))
    head_bytes = 4 * sum(h.flatten().numel() for h in heads.values())
    assert size - head_bytes <= 1.01 * (4 * d + k * (d / 8 + 4)), (k, size - head_bytes)


def test_matu_runs_end_to_end_and_exports_adapters(matu_config):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_fedtask import load_task_adapter

    results = federation.run(matu_config)
    assert results["strategy"] == "matu" and results["rounds"] == 2
    run_dir = Path(matu_config.output_dir)
    base = AutoModelForSequenceClassification.from_pretrained(matu_config.base_model, num_labels=3)
    stock = PeftModel.from_pretrained(base, run_dir / "adapters" / "colors").eval()
    compact = load_task_adapter(run_dir / "compact", "colors", base_model=matu_config.base_model)
    batch = AutoTokenizer.from_pretrained(matu_config.base_model)(["red apple 3", "blue sky 4"], padding=True,
                                                                  return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(stock(**batch).logits, compact(**batch).logits)
    storage = results["compact_storage"]  # 2 tasks: no saving yet (θ_p and τ cost two adapters)
    on_disk = sum(p.stat().st_size for p in (run_dir / "compact").iterdir() if p.is_file() and p.name != "README.md")
    assert storage["tasks"] == 2 and storage["compact_bytes"] == on_disk
