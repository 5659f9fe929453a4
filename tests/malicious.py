"""A malicious client, for tests only: the honest `ClientRuntime`, whose train replies one client then
tampers with by a named attack, and an in-process transport that runs it (or leaves the client silent, the
reference a refused reply must equal).

Each attack takes the honest reply bytes and returns what an authenticated but dishonest client would send
instead: another client's id, the secure-aggregation sum's id, an earlier round's upload, tasks or counts it
does not hold, non-finite or mis-shaped tensors, broken safetensors framing, header fields of the wrong JSON
type. Used with the in-process, Flower (InProcessGrid) and torchrun engines.
"""

from __future__ import annotations

import json
import struct
from typing import ClassVar

import safetensors.torch
import torch

from hf_fedtask.core.kinds import TRAIN
from hf_fedtask.core.taskvector_file import read_bytes
from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.transport import InProcessTransport


def _rewrite(reply: bytes, tensors=None, **header) -> bytes:
    """`reply` with header fields replaced (values as strings) and/or its tensors edited by `tensors(dict)`."""
    loaded, meta = read_bytes(reply, source="honest reply")
    if tensors is not None:
        tensors(loaded)
    return safetensors.torch.save(loaded, metadata={**meta, **header})


def _first_float(tensors: dict) -> str:
    return next(k for k, t in tensors.items() if t.is_floating_point() and t.numel())


def _set_first(value: float):
    def edit(tensors):
        key = _first_float(tensors)
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = value
    return edit


def _reshape(tensors):
    key = _first_float(tensors)
    tensors[key] = torch.zeros(tensors[key].numel() + 1)


def _retype(tensors):
    key = _first_float(tensors)
    tensors[key] = tensors[key].double()


def _scale(factor: float):
    def edit(tensors):
        for k, t in tensors.items():
            if t.is_floating_point():
                tensors[k] = t * factor
    return edit


def _counts(edit):
    def attack(reply: bytes, ctx: dict) -> bytes:
        meta = read_bytes(reply, source="honest reply")[1]
        counts = edit(json.loads(meta["num_samples"]), ctx)
        return _rewrite(reply, num_samples=json.dumps(counts), task_ids=json.dumps(sorted(counts)))
    return attack


def _oversized_header(reply: bytes, ctx: dict) -> bytes:
    return struct.pack("<Q", 1 << 40) + reply[8:]


# attack name -> (reply bytes, {"client", "other", "round", "tasks", "foreign", "earlier"}) -> bytes
ATTACKS = {
    "another_clients_id": lambda r, ctx: _rewrite(r, client_id=str(ctx["other"])),
    "the_sums_id": lambda r, ctx: _rewrite(r, client_id="-1"),
    "a_past_round": lambda r, ctx: ctx["earlier"] or _rewrite(r, round=str(ctx["round"] - 1)),
    "a_future_round": lambda r, ctx: _rewrite(r, round=str(ctx["round"] + 1)),
    "a_task_it_does_not_hold": _counts(lambda counts, ctx: {**counts, ctx["foreign"]: 5}),
    "a_count_of_zero": _counts(lambda counts, ctx: {t: 0 for t in counts}),
    "a_negative_count": _counts(lambda counts, ctx: {t: -3 for t in counts}),
    "a_fractional_count": _counts(lambda counts, ctx: {t: n + 0.5 for t, n in counts.items()}),
    "an_inflated_count": _counts(lambda counts, ctx: {t: n * 100 for t, n in counts.items()}),
    "nan": lambda r, ctx: _rewrite(r, tensors=_set_first(float("nan"))),
    "inf": lambda r, ctx: _rewrite(r, tensors=_set_first(float("inf"))),
    "a_wrong_shape": lambda r, ctx: _rewrite(r, tensors=_reshape),
    "a_wrong_dtype": lambda r, ctx: _rewrite(r, tensors=_retype),
    "truncated_safetensors": lambda r, ctx: r[: len(r) // 2],
    "an_oversized_header_length": _oversized_header,
    "empty_bytes": lambda r, ctx: b"",
    "counts_as_a_json_list": lambda r, ctx: _rewrite(r, num_samples="[1, 2]"),
    "counts_not_json": lambda r, ctx: _rewrite(r, num_samples="{1: two"),
    "metrics_as_a_json_string": lambda r, ctx: _rewrite(r, metrics='"loss"'),
    "a_nan_metric": lambda r, ctx: _rewrite(r, metrics='{"train_loss": NaN}'),
    "round_null": lambda r, ctx: _rewrite(r, round="null"),
    "client_id_missing": lambda r, ctx: _rewrite(r, client_id=""),
    "another_base_model": lambda r, ctx: _rewrite(r, base_model="gpt2"),
}


class MaliciousRuntime(ClientRuntime):
    """`ClientRuntime` whose client `target` applies `attack` to its train replies from round `from_round`
    on (earlier replies are kept: the replay attack sends one of them again)."""

    attack: ClassVar[str | None] = None
    target: ClassVar[int] = 1
    from_round: ClassVar[int] = 1
    scale: ClassVar[float] = 1.0  # multiplies the target's honest update before the attack (a large upload)
    other: ClassVar[int | None] = None  # the client it poses as (default: the next one)
    sent: ClassVar[dict[int, bytes]] = {}  # the target's honest replies by round

    def handle(self, ins, store):
        reply = super().handle(ins, store)
        if ins.kind != TRAIN or self.client_id != self.target or self.attack is None:
            return reply
        if ins.round < self.from_round:
            type(self).sent[ins.round] = reply
            return reply
        if self.scale != 1.0:
            reply = _rewrite(reply, tensors=_scale(self.scale))
        tasks = sorted(self.env.allocation[self.client_id])
        foreign = next(t.name for t in self.env.tasks if t.name not in tasks)
        other = (self.client_id + 1) % self.env.num_clients if self.other is None else self.other
        ctx = {"client": self.client_id, "other": other, "round": ins.round,
               "tasks": tasks, "foreign": foreign, "earlier": self.sent.get(ins.round - 1)}
        return ATTACKS[self.attack](reply, ctx)

    @classmethod
    def arm(cls, attack: str | None, target: int = 1, from_round: int = 1, scale: float = 1.0,
            other: int | None = None) -> None:
        cls.attack, cls.target, cls.from_round, cls.scale, cls.other, cls.sent = \
            attack, target, from_round, scale, other, {}


class AdversarialTransport(InProcessTransport):
    """The in-process transport with every client a `MaliciousRuntime` (armed for one target), and the clients
    in `silent` never replying (a dropout: the reference a refused reply must leave the run equal to)."""

    def __init__(self, env, silent=(), stores=None):
        super().__init__(env, stores)
        self.silent = set(silent)

    def exchange(self, instructions):
        replies = {}
        for ins in instructions:
            if ins.client_id in self.silent and ins.kind == TRAIN:
                self.failures[ins.client_id] = "no reply"
                continue
            runtime = MaliciousRuntime(self.env, ins.client_id)
            replies[ins.client_id] = runtime.handle(ins, self._stores.setdefault(ins.client_id, {}))
        return replies
