"""MaTU: the strategy against an independent re-implementation of the paper's client and server steps
(Tsouvalas, Ozcelebi and Meratnia, 2025, arXiv:2502.06376, §3.2, Eqs. 3-7) written with flat tensors,
the wire format's byte count, statelessness of the server, and an end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_fedtask.core.state import MATU_WIRE, matu_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate
from hf_fedtask.engine import run as federation
from hf_fedtask.engine.run_folder import restore
from hf_fedtask.errors import TaskVectorError
from hf_fedtask.merge import sign_similarity
from hf_fedtask.merge.bitmask import unpack_bits
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import SHARED, head_name
from hf_fedtask.strategies.matu import decode_heads, decode_task, encode_wire, wire_tasks

SHAPES = {"a.lora_A.weight": (4, 6), "a.lora_B.weight": (6, 4), "b.lora_A.weight": (3, 5)}
HEAD = {"classifier.modules_to_save.default.weight": (2, 4), "classifier.modules_to_save.default.bias": (2,)}


def random_tv(gen, shapes=SHAPES, scale=1.0):
    return TaskVector({k: torch.randn(s, generator=gen) * scale for k, s in shapes.items()})


# -- an independent reference, on flat tensors, straight from the paper's equations --------------
def ref_unify(taus: list[torch.Tensor]):
    sign = torch.stack(taus).sum(0).sign()
    stacked = torch.stack(taus)
    agree = (stacked.sign() == sign) & (sign != 0)
    tau = sign * (stacked.abs() * agree).max(0).values
    masks = [(t * tau) > 0 for t in taus]
    lams = [float(t.abs().sum() / (m * tau).abs().sum()) if (m * tau).abs().sum() > 0 else 0.0
            for t, m in zip(taus, masks)]
    return tau, masks, lams


def ref_server(uploads, stored, rho, kappa, eps, combine, vectors="cumulative", neighbours="round", include_self=False):
    """uploads: list of (num_samples{t: n}, tau_flat, masks{t: bool flat}, lams{t: float}); stored: {t: τ^t flat}."""
    hat, soft = {}, {}
    for t in sorted({t for u in uploads for t in u[0]}):
        holders = [u for u in uploads if t in u[0]]
        total = sum(u[0][t] for u in holders)
        recon = [u[2][t] * u[1] for u in holders]
        alpha = torch.stack([r.sign() for r in recon]).mean(0).abs()
        soft[t] = torch.where(alpha >= rho, torch.ones_like(alpha), alpha)
        hat[t] = soft[t] * sum(u[0][t] / total * u[3][t] * r for u, r in zip(holders, recon))
    if neighbours == "round":  # compared by, and adding, this round's τ̂
        names, compared, added = list(hat), hat, hat
    else:  # every task; under delta a carried-forward task is compared by its τ^t but has no increment to add
        names = sorted(stored)
        compared = {t: (stored[t] + hat[t] if vectors == "delta" else hat[t]) if t in hat else stored[t] for t in names}
        added = {t: hat[t] if t in hat else None if vectors == "delta" else stored[t] for t in names}
    new = dict(stored)
    for t in hat:
        sims = {t2: 0.5 * (float((compared[t].sign() * compared[t2].sign()).mean()) + 1) for t2 in names}
        cands = sorted((t2 for t2 in names if sims[t2] > eps and (include_self or t2 != t) and added[t2] is not None),
                       key=lambda x: -sims[x])[:kappa]
        cross = sum((sims[t2] * soft[t] * added[t2] for t2 in cands), torch.zeros_like(hat[t]))
        if combine == "sum" or not cands:
            step = hat[t] + cross
        elif combine == "mean":
            step = 0.5 * (hat[t] + cross)
        elif combine == "s_normalized_cross":
            step = hat[t] + cross / (1 + sum(sims[t2] for t2 in cands))
        else:
            step = (hat[t] + cross) / (1 + sum(sims[t2] for t2 in cands))
        new[t] = stored[t] + step if vectors == "delta" else step
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
    assert list(wire) == ["tasks", "unified", "masks", "rescalers", "heads"]  # five tensors whatever the task count
    assert wire_tasks(wire) == list(vectors)  # the slot order travels with the wire
    tau, masks, lams = ref_unify([v.flatten() for v in vectors.values()])
    torch.testing.assert_close(wire["unified"], tau)
    for i, t in enumerate(vectors):
        assert torch.equal(unpack_bits(wire["masks"][i], tau.numel()), masks[i])
        assert float(wire["rescalers"][i]) == pytest.approx(lams[i], rel=1e-6)
        torch.testing.assert_close(decode_task(wire, t, vectors[t]).flatten(), lams[i] * masks[i] * tau)
    for t, h in decode_heads(wire, heads).items():
        assert all(torch.equal(h[k], heads[t][k]) for k in h)


@pytest.mark.parametrize("neighbours", ["round", "all"])
@pytest.mark.parametrize("vectors", ["cumulative", "delta"])
@pytest.mark.parametrize("combine", ["sum", "mean", "s_normalized", "s_normalized_cross"])
def test_server_aggregation_matches_the_reference(combine, vectors, neighbours):
    """Three participating clients over tasks t0-t2 (t3 has none: carried forward, and close to them)."""
    allocation = {0: ["t0", "t1"], 1: ["t1", "t2"], 2: ["t0"], 3: ["t3"]}
    strategy = build_strategy("matu", {"combine": combine, "kappa": 2, "epsilon": 0.5, "rho": 0.4,
                                       "vectors": vectors, "neighbours": neighbours})
    state = make_state(strategy, allocation)
    gen = torch.Generator().manual_seed(2)
    common = random_tv(gen)  # shared direction so that tasks are similar (S > ε) and neighbours exist
    for t in TASKS:  # earlier rounds' vectors; t3's is a close neighbour of every task
        state.vectors[matu_task_vector_name(t)] = common + random_tv(gen, scale=0.5 if t == "t3" else 1.5)
        state.vectors[head_name(t)] = TaskVector({k: torch.randn(s, generator=gen) for k, s in HEAD.items()})
    updates, uploads = [], []
    for cid in (0, 1, 2):
        uploaded = {t: common + random_tv(gen, scale=0.7) for t in allocation[cid]}
        heads = {t: TaskVector({k: torch.randn(s, generator=gen) for k, s in HEAD.items()}) for t in uploaded}
        samples = {t: 10 + 7 * cid + i for i, t in enumerate(uploaded)}
        updates.append(ClientUpdate(cid, 1, {MATU_WIRE: encode_wire(uploaded, "global_sum", heads=heads)}, samples))
        tau, masks, lams = ref_unify([v.flatten() for v in uploaded.values()])
        uploads.append((samples, tau, dict(zip(uploaded, masks)), dict(zip(uploaded, lams))))
    stored = {t: state.vectors[matu_task_vector_name(t)].flatten() for t in TASKS}
    expected = ref_server(uploads, stored, 0.4, 2, 0.5, combine, vectors, neighbours)
    new = strategy.server_aggregate(state, updates)
    for t in TASKS:
        torch.testing.assert_close(new.vectors[matu_task_vector_name(t)].flatten(), expected[t], rtol=1e-5, atol=1e-6)
    # heads: sample-weighted mean of the holders' changes
    h = [(u.num_samples["t0"],
          decode_heads(u.vectors[MATU_WIRE], {t: state.vectors[head_name(t)] for t in sorted(u.num_samples)})["t0"])
         for u in updates if "t0" in u.num_samples]
    mean = sum((n * v for n, v in h), h[0][1].zeros_like()) / sum(n for n, _ in h)
    torch.testing.assert_close(new.vectors[head_name("t0")].flatten(),
                               (state.vectors[head_name("t0")] + mean).flatten())
    origin = state.vectors[SHARED].flatten()
    tau, masks, lams = ref_unify([expected[t] for t in TASKS])
    for i, t in enumerate(TASKS):
        head = new.vectors[head_name(t)]
        # each task is evaluated and exported from θ_p + τ^t, plus its head
        params = strategy.task_parameters(new, t)
        torch.testing.assert_close(params.filter(lambda k: k in SHARED_KEYS).flatten(), origin + expected[t],
                                   rtol=1e-5, atol=1e-6)
        assert all(torch.equal(params[k], head[k]) for k in head)
        # the compact form decodes the unification of all four task vectors, τ stored in float16 (export_dtype)
        compact = strategy.compact_task_parameters(new, t)
        torch.testing.assert_close(compact.filter(lambda k: k in SHARED_KEYS).flatten(),
                                   origin + lams[i] * masks[i] * tau.half().float(), rtol=1e-5, atol=1e-6)
        assert all(torch.equal(compact[k], head[k]) for k in head)


SHARED_KEYS = set(SHAPES)


def test_neighbours_exclude_self_and_respect_epsilon_and_kappa():
    strategy = build_strategy("matu", {"kappa": 2, "epsilon": 0.5})
    s = torch.tensor([[1.0, 0.9, 0.6, 0.4], [0.9, 1.0, 0.7, 0.8], [0.6, 0.7, 1.0, 0.5], [0.4, 0.8, 0.5, 1.0]])
    assert strategy.neighbours(s, 0) == [1, 2]
    assert strategy.neighbours(s, 2) == [1, 0]  # 3 has S = 0.5, not > ε
    assert build_strategy("matu", {"kappa": 2, "include_self": True}).neighbours(s, 0) == [0, 1]
    assert build_strategy("matu", {"kappa": 0}).neighbours(s, 0) == []


def single_task_uploads(uploaded: dict[int, tuple[str, TaskVector]]) -> list[ClientUpdate]:
    """One task per client (client -> (task, vector)): unification is exact, so τ̂^t is the vector itself."""
    heads = {k: torch.zeros(s) for k, s in HEAD.items()}
    return [ClientUpdate(c, 1, {MATU_WIRE: encode_wire({t: v}, "global_sum", heads={t: TaskVector(heads)})}, {t: 10})
            for c, (t, v) in uploaded.items()]


def test_carried_forward_tasks_are_neighbours_only_with_neighbours_all():
    """t1 has no participant this round but a stored τ^{t1} close to t0's upload. Cumulative: `all` mixes
    τ^{t1} into t0 (Eq. 6), `round` does not. Delta: t1 has no increment to add, so it is no candidate;
    t2's increment is mixed in, weighted by the similarity of the whole vectors under `all` and of the
    increments under `round`."""
    allocation = {0: ["t0"], 1: ["t1"], 2: ["t2"], 3: ["t3"]}
    gen = torch.Generator().manual_seed(5)
    common = random_tv(gen)
    upload = 0.1 * (common + random_tv(gen, scale=0.3))

    def new_vector(options, stored, uploaded):
        strategy = build_strategy("matu", {"kappa": 1, **options})
        state = make_state(strategy, allocation)
        for t, v in stored.items():
            state.vectors[matu_task_vector_name(t)] = v
        new = strategy.server_aggregate(state, single_task_uploads(uploaded))
        assert torch.equal(new.vectors[matu_task_vector_name("t1")].flatten(),
                           stored["t1"].flatten())  # no participant: kept
        return new.vectors[matu_task_vector_name("t0")]

    stored = {"t1": common + random_tv(gen, scale=0.1)}
    for neighbours in ("round", "all"):
        got = new_vector({"vectors": "cumulative", "neighbours": neighbours}, stored, {0: ("t0", upload)})
        if neighbours == "round":
            expected = upload
        else:
            s = float(sign_similarity([upload, stored["t1"]])[0, 1])
            assert s > 0.5
            expected = (1 / (1 + s)) * (upload + s * stored["t1"])
        torch.testing.assert_close(got.flatten(), expected.flatten())

    stored = {"t0": common, "t1": common + random_tv(gen, scale=0.1), "t2": common + random_tv(gen, scale=1.0)}
    increment_t2 = 0.1 * (common + random_tv(gen, scale=0.3))
    for neighbours in ("round", "all"):
        got = new_vector({"vectors": "delta", "neighbours": neighbours}, stored,
                                {0: ("t0", upload), 2: ("t2", increment_t2)})
        if neighbours == "round":
            s = float(sign_similarity([upload, increment_t2])[0, 1])
            assert s > 0.5
            expected = stored["t0"] + (1 / (1 + s)) * (upload + s * increment_t2)
        else:  # t1 has nothing to add and is skipped; t2 is compared by its whole vector τ^{t2} + increment
            s = float(sign_similarity([stored["t0"] + upload, stored["t1"], stored["t2"] + increment_t2])[0, 2])
            expected = ((stored["t0"] + (1 / (1 + s)) * (upload + s * increment_t2)) if s > 0.5
                        else stored["t0"] + upload)
        torch.testing.assert_close(got.flatten(), expected.flatten())


def test_bad_matu_options_are_config_errors():
    from hf_fedtask.errors import ConfigError

    for option, value in (("combine", "avg"), ("rescaler", "l2"), ("vectors", "increments"), ("neighbours", "some")):
        with pytest.raises(ConfigError, match=option):
            build_strategy("matu", {option: value})


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
        assert ((run_dir / "payloads" / "round_1" / f"client_{cid}.uplink.safetensors").stat().st_size
                == traffic["uplink"])
        assert ((run_dir / "payloads" / "round_1" / f"client_{cid}.downlink.safetensors").stat().st_size
                == traffic["downlink"])
    assert record["bytes_uplink"] == sum(t["uplink"] for t in record["bytes_per_client"].values())


def test_bfloat16_wire_halves_the_unified_vector_and_decodes_close():
    gen = torch.Generator().manual_seed(4)
    vectors = {t: random_tv(gen, {"w": (64, 64)}) for t in ("a", "b")}
    f32, bf16 = encode_wire(vectors, "global_sum"), encode_wire(vectors, "global_sum", "bfloat16")
    assert bf16["unified"].dtype == torch.bfloat16

    def size(w):  # the data section: the header's JSON length varies with its (unordered) metadata and padding
        payload = ClientUpdate(0, 1, {MATU_WIRE: w}, {"a": 1, "b": 1}).to_bytes(
            base_model="m", base_model_revision="r", peft_config_hash="h")
        return len(payload) - 8 - int.from_bytes(payload[:8], "little")
    assert size(f32) - size(bf16) == 2 * 64 * 64
    torch.testing.assert_close(decode_task(bf16, "a", vectors["a"])["w"], decode_task(f32, "a", vectors["a"])["w"],
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
    heads = {t: TaskVector({"classifier.weight": torch.randn(6, 384), "classifier.bias": torch.randn(6)})
             for t in names}
    vectors = {t: random_tv(gen, shapes) for t in names}
    update = ClientUpdate(7, 12, {MATU_WIRE: encode_wire(vectors, "global_sum", heads=heads)}, {t: 133 for t in names},
                          {f"{t}/train_loss": 0.123456789 for t in names})
    size = len(update.to_bytes(base_model="sentence-transformers/all-MiniLM-L6-v2",
                               base_model_revision="sha256:" + "0" * 64, peft_config_hash="0" * 64))
    head_bytes = 4 * sum(h.flatten().numel() for h in heads.values())
    assert size - head_bytes <= 1.01 * (4 * d + k * (d / 8 + 4)), (k, size - head_bytes)


def test_matu_runs_end_to_end_and_exports_adapters(matu_config):
    """The stock adapter is the task from the server's τ^t (`task_parameters`), the compact export its
    decoding from the all-task unification (`compact_task_parameters`); both load as PEFT models."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_fedtask import load_task_adapter
    from hf_fedtask.export.compact import task_state

    results = federation.run(matu_config)
    assert results["strategy"] == "matu" and results["rounds"] == 2
    run_dir = Path(matu_config.output_dir)
    fed = federation.Federation(matu_config)
    final, _, _ = restore(fed.env, run_dir, matu_config.fingerprint())
    stock_weights = load_file(run_dir / "adapters" / "colors" / "adapter_model.safetensors")
    expected = fed.strategy.task_parameters(final, "colors")
    assert stock_weights.keys() == set(expected) and all(torch.equal(stock_weights[k], expected[k]) for k in expected)
    compact_weights = task_state(run_dir / "compact", "colors")
    expected = fed.strategy.compact_task_parameters(final, "colors")
    assert set(compact_weights) == set(expected)
    for k in expected:
        torch.testing.assert_close(compact_weights[k], expected[k])
    base = AutoModelForSequenceClassification.from_pretrained(matu_config.base_model, num_labels=3)
    stock = PeftModel.from_pretrained(base, run_dir / "adapters" / "colors").eval()
    compact = load_task_adapter(run_dir / "compact", "colors", base_model=matu_config.base_model)
    batch = AutoTokenizer.from_pretrained(matu_config.base_model)(["red apple 3", "blue sky 4"], padding=True,
                                                                  return_tensors="pt")
    with torch.no_grad():
        assert stock(**batch).logits.shape == compact(**batch).logits.shape == (2, 3)
    # the compact form's accuracy is reported on its own, equal to evaluating its decoding
    from hf_fedtask.client.evaluation import evaluate as evaluate_params

    for task in ("colors",):
        own = evaluate_params(fed.env.host, fed.strategy.compact_task_parameters(final, task), fed.env.test_data(task))
        assert results["tasks"][task]["accuracy_compact"] == own["accuracy"]
    assert results["mean_metric_compact"] == pytest.approx(
        sum(r["accuracy_compact"] for r in results["tasks"].values()) / len(results["tasks"]))
    storage = results["compact_storage"]  # 2 tasks: no saving yet (θ_p and τ cost two adapters)
    on_disk = sum(p.stat().st_size for p in (run_dir / "compact").iterdir() if p.is_file() and p.name != "README.md")
    assert storage["tasks"] == 2 and storage["compact_bytes"] == on_disk


def test_wire_slots_are_matched_by_name_not_position():
    """A wire form lists its tasks: an upload whose slots are in any order decodes to the same vectors, and
    one that lacks a task it claims is refused naming the task."""
    gen = torch.Generator().manual_seed(5)
    vectors = {t: random_tv(gen) for t in ("b", "a", "c")}  # not sorted
    heads = {t: TaskVector({k: torch.randn(s, generator=gen) for k, s in HEAD.items()}) for t in vectors}
    wire = encode_wire(vectors, "global_sum", heads=heads)
    assert wire_tasks(wire) == ["b", "a", "c"]
    ordered = encode_wire({t: vectors[t] for t in sorted(vectors)}, "global_sum",
                          heads={t: heads[t] for t in sorted(heads)})
    for t in vectors:
        torch.testing.assert_close(decode_task(wire, t, vectors[t]).flatten(),
                                   decode_task(ordered, t, vectors[t]).flatten())
        torch.testing.assert_close(decode_heads(wire, heads)[t].flatten(), heads[t].flatten())
    with pytest.raises(TaskVectorError, match="'d'"):
        decode_task(wire, "d", vectors["a"])
    with pytest.raises(TaskVectorError, match="heads of"):
        decode_heads(wire, {t: heads[t] for t in ("a", "b")})
    strategy = build_strategy("matu", {})
    state = strategy.init_state(FakeHost(gen), [SimpleNamespace(name=t, num_labels=2) for t in ("a", "b", "c", "x")],
                                0, {0: ["a", "b", "c"]})
    renamed = TaskVector({**wire, "tasks": encode_wire({"x": vectors["a"]}, "global_sum")["tasks"]})
    with pytest.raises(TaskVectorError, match=r"client 0 \(round 1\).*carries tasks \['x'\]"):
        strategy.server_aggregate(state, [ClientUpdate(0, 1, {MATU_WIRE: renamed}, {"a": 1, "b": 1, "c": 1})])


def test_per_task_downlink_sends_each_task_vector_and_clients_train_from_it():
    """`downlink: per_task`: the downlink carries every held τ^t as it is (one float vector per task, no masks), the
    client's step is measured from it, and the upload stays the unified form."""
    gen = torch.Generator().manual_seed(6)
    strategy = build_strategy("matu", {"downlink": "per_task"})
    tasks = ["t0", "t1", "t2"]
    state = strategy.init_state(FakeHost(gen), [SimpleNamespace(name=t, num_labels=2) for t in tasks], 0,
                                {0: tasks, 1: ["t1"]})
    for t in tasks:
        state.vectors[matu_task_vector_name(t)] = random_tv(gen, scale=0.1)
    wire = strategy.downlink(state, 0, tasks)[MATU_WIRE]
    numel = sum(v.numel() for v in state.vectors[SHARED].values())
    assert sorted(wire) == ["heads", "tasks", "vectors"] and wire["vectors"].shape == (3, numel)
    for t in tasks:
        assert torch.equal(decode_task(wire, t, state.vectors[SHARED]).flatten(),
                           state.vectors[matu_task_vector_name(t)].flatten())
    unified = build_strategy("matu", {}).downlink(state, 0, tasks)[MATU_WIRE]
    assert wire["vectors"].numel() == 3 * unified["unified"].numel()
    assert set(strategy.update_templates(state, 0, tasks)[MATU_WIRE]) == set(unified)  # uploads: the unified form
