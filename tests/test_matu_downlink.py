"""MaTU's quantized per-task downlink (`downlink: per_task_int4 | per_task_int8`): the block quantizer against a
reference, the wire's true bytes, the client's start, error feedback (the starts average to τ^t), the options."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_fedtask.core.state import MATU_WIRE, matu_task_vector_name
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors
from hf_fedtask.errors import ConfigError
from hf_fedtask.merge import blockquant
from hf_fedtask.strategies import build_strategy
from hf_fedtask.strategies.base import SHARED, head_name
from hf_fedtask.strategies.matu import decode_task, downlink_error_name, encode_wire

SHAPES = {"a.lora_A.weight": (8, 40), "a.lora_B.weight": (40, 8), "b.lora_A.weight": (3, 7)}  # 661: no block aligns
HEAD = {"classifier.weight": (2, 4), "classifier.bias": (2,)}
TASKS = ["t0", "t1", "t2"]


class FakeHost:
    def initial_shared(self):
        gen = torch.Generator().manual_seed(0)
        return TaskVector({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()})

    def initial_head(self, num_labels, seed):
        return TaskVector({k: torch.zeros(s) for k, s in HEAD.items()})


def reference(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Block-wise absmax rounding written out entry by entry: q = round(x / s), s = max|block| / L (bfloat16)."""
    top = 2 ** (bits - 1) - 1
    out = torch.empty_like(x)
    for start in range(0, x.numel(), 64):
        block = x[start:start + 64]
        s = float((block.abs().max() / top).to(torch.bfloat16))
        out[start:start + 64] = 0.0 if s == 0 else torch.clamp(torch.round(block / s), -top, top) * s
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_block_quantizer_matches_the_reference_and_packs_tightly(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(661, generator=gen) * torch.linspace(1e-3, 3, 661)
    x[64:128] = 0  # an all-zero block
    q = blockquant.quantize(x, bits)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == -(-661 * bits // 8)
    assert q.scales.dtype == torch.bfloat16 and q.scales.numel() == 11
    decoded = blockquant.dequantize(q.codes, q.scales, bits, 661)
    assert torch.equal(decoded, reference(x, bits))
    bound = (q.scales.float() / 2).repeat_interleave(64)[:661] * 1.01
    assert ((decoded - x).abs() <= bound).all()
    assert torch.equal(blockquant.quantize(decoded, bits).codes, q.codes)  # a decoded vector is on the grid
    with pytest.raises(ValueError, match="codes must be"):
        blockquant.dequantize(q.codes[:-1], q.scales, bits, 661)


def make_state(strategy, scale=0.1, seed=6):
    gen = torch.Generator().manual_seed(seed)
    state = strategy.init_state(FakeHost(), [SimpleNamespace(name=t, num_labels=2) for t in TASKS], 0,
                                {0: TASKS, 1: ["t1"]})
    for t in TASKS:
        state.vectors[matu_task_vector_name(t)] = TaskVector(
            {k: torch.randn(s, generator=gen) * scale for k, s in SHAPES.items()})
    return state


def test_four_bit_downlink_is_under_0_15_of_float32_and_decodes_within_half_a_step():
    """Codes and scales replace the float vectors: 4.25 bits an entry (+ the 1-byte `bits`), measured on the bytes
    the engines send; each decoded start is within half a quantization step of τ^t."""
    exact, q4 = build_strategy("matu", {"downlink": "per_task"}), build_strategy(
        "matu", {"downlink": "per_task_int4"})
    state = make_state(q4)
    wire = q4.downlink(state, 0, TASKS)[MATU_WIRE]
    assert sorted(wire) == ["bits", "codes", "heads", "scales", "tasks"]
    d = sum(v.numel() for v in state.vectors[SHARED].values())
    vectors_bytes = wire["codes"].numel() + 2 * wire["scales"].numel()
    assert vectors_bytes == 3 * (-(-d // 2) + 2 * -(-d // 64))

    def data_bytes(strategy):  # the payload less its JSON header (whose length varies with padding)
        payload = pack_vectors(strategy.downlink(state, 0, TASKS)).to_bytes()
        return len(payload) - 8 - int.from_bytes(payload[:8], "little")

    assert data_bytes(exact) - data_bytes(q4) == 3 * 4 * d - vectors_bytes - 1  # float32 rows out, codes in
    assert vectors_bytes < 0.15 * 3 * 4 * d
    origin = state.vectors[SHARED]
    for i, t in enumerate(TASKS):
        tau = state.vectors[matu_task_vector_name(t)].flatten()
        start = decode_task(wire, t, origin).flatten()
        step = wire["scales"][i].float().repeat_interleave(64)[:d]
        assert ((start - tau).abs() <= 0.51 * step).all() and not torch.equal(start, tau)


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_makes_the_starts_average_to_the_task_vector(feedback):
    """τ^t held fixed (uploads of zero change) over 16 rounds: with feedback the mean of the starts the holders
    got is within 1/16 of a step of τ^t plus the initial error; without it every start is the same rounding."""
    strategy = build_strategy("matu", {"downlink": "per_task_int4", "downlink_feedback": feedback})
    state = make_state(strategy)
    origin = state.vectors[SHARED]
    assert (downlink_error_name("t0") in state.vectors) == feedback
    starts, wires = [], []
    for r in range(1, 17):
        wire = strategy.downlink(state, 0, TASKS)[MATU_WIRE]
        wires.append(wire)
        starts.append(decode_task(wire, "t0", origin).flatten())
        zero = {t: origin.zeros_like() for t in TASKS}
        heads = {t: TaskVector({k: torch.zeros(s) for k, s in HEAD.items()}) for t in TASKS}
        state = strategy.server_aggregate(state, [ClientUpdate(
            0, r, {MATU_WIRE: encode_wire(zero, "global_sum", heads=heads)}, {t: 5 for t in TASKS})])
    tau = state.vectors[matu_task_vector_name("t0")].flatten()
    assert torch.equal(tau, make_state(strategy).vectors[matu_task_vector_name("t0")].flatten())  # nothing moved τ
    step = wires[0]["scales"][0].float().repeat_interleave(64)[:tau.numel()]
    single = (starts[0] - tau).abs()
    mean = (torch.stack(starts).mean(0) - tau).abs()
    if feedback:  # Σ_r start_r = Σ_r τ + e_0 - e_16: the mean is off by at most a step over 16
        assert (mean <= step / 16 + 1e-6).all() and mean.max() < 0.2 * single.max()
        assert float(state.vectors[downlink_error_name("t0")].flatten().abs().max()) <= 0.51 * float(step.max())
    else:
        assert all(torch.equal(s, starts[0]) for s in starts) and torch.equal(mean, single)


def test_quantized_downlink_options_are_checked():
    for downlink in ("unified", "per_task"):
        with pytest.raises(ConfigError, match=f"downlink_feedback: false has no effect with downlink {downlink}"):
            build_strategy("matu", {"downlink": downlink, "downlink_feedback": False})
    with pytest.raises(ConfigError, match="downlink"):
        build_strategy("matu", {"downlink": "per_task_int2"})


def test_clients_train_from_the_decoded_start_and_heads_travel_exactly():
    """The client's step is measured from the decoded 4-bit start (what it received), and the heads are float32."""
    strategy = build_strategy("matu", {"downlink": "per_task_int4"})
    state = make_state(strategy)
    origin = state.vectors[SHARED]
    downlink = strategy.downlink(state, 0, TASKS)
    seen = {}

    class Recorder:
        def train(self, start, data, seed):
            seen[len(seen)] = start
            return start, {"train_loss": 0.0}

    from hf_fedtask.strategies.base import ClientJob

    heads = {t: state.vectors[head_name(t)] for t in TASKS}
    job = ClientJob(0, 1, {t: [0, 1] for t in TASKS}, seed=0, origin=origin, initial_heads=heads)
    strategy.client_update(downlink, job, Recorder())
    for i, t in enumerate(TASKS):
        expected = origin + decode_task(downlink[MATU_WIRE], t, origin)
        assert all(torch.equal(seen[i][k], expected[k]) for k in expected)
        assert all(torch.equal(seen[i][k], heads[t][k]) for k in heads[t])
