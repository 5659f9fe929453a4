"""The one trust boundary for what clients send: every reply any engine carries (in-process, torchrun
ranks, Flower simulation and deployment) reaches the round loop's state only through these checks.

Threat model. A client is authenticated by its engine's transport (a Flower SuperNode by its key pair and
the `partition-id` it answered discovery with, each id held once; a rank or an in-process client by the
launch itself), so the server knows who sent each reply. Such a client may still send anything in its
reply. What the server already knows it checks before use, and refuses a reply that disagrees:

    identity   the header's `client_id` is the sender the transport knows (so no client can act as
               another: overwrite MaT-FL's per-client model, F²L²'s gradients, or pose as the
               secure-aggregation sum to skip the DP re-clip)
    freshness  the header's `round` is the current round (no replay of an earlier upload)
    holdings   the header's tasks and sample counts are exactly the client's allocation, each count a
               positive integer equal to the client's partition size (1 per task under DP)
    tensors    keys, shapes and dtypes the strategy expects of that client this round, every value finite,
               base model and PEFT config matching (`hf_fedtask.core.taskvector_file.validate`)
    metrics    a JSON object of finite numbers (evaluation replies: each requested task's metric)

What an authenticated client can still do, and no check here prevents: send any finite update of the
expected layout (a poisoned or backdoored one; robust aggregation is a strategy's business, and DP bounds
each client's influence by the clip norm), evaluate dishonestly on its own data (strategies with client
evaluation), stay silent (a dropout), or, in secure aggregation, reveal wrong pairwise seeds for a dropped
peer (the sum is then wrong; the masks hide which upload was). The SuperNode-to-client mapping rests on each
node's own `partition-id`: authenticated nodes are trusted to claim only their own.

A refused reply raises `UntrustedUpload` naming the client, round and field; the round loop then leaves the
client out of the round as a dropout, recorded in metrics.jsonl (`bad_uploads: drop`, the default), or stops
the run before the round is written (`bad_uploads: stop`, exit 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping

from hf_fedtask.core.names import BAD_UPLOADS
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import ClientUpdate, pack_vectors, unpack_vectors
from hf_fedtask.errors import TaskVectorError, UntrustedUpload

DROP, STOP = BAD_UPLOADS  # RunConfig.bad_uploads


def accept_update(data: bytes, *, sender: int, round_: int, templates: Mapping[str, TaskVector],
                  header: Mapping[str, str], counts: Mapping[str, int], what: str = "upload") -> ClientUpdate:
    """A train or query reply from `sender` as a `ClientUpdate`, after every check of the module docstring:
    `templates` the vectors it must hold, `counts` the tasks and sample counts the server knows it holds."""
    flat = _parse(data, sender=sender, round_=round_, template=pack_vectors(templates), header=header, what=what)
    meta = flat.raw_metadata
    num_samples = _counts(meta, sender, round_, counts, what)
    return ClientUpdate(client_id=sender, round=round_, vectors=unpack_vectors(flat), num_samples=num_samples,
                        metrics=_metrics(meta, sender, round_, what))


def accept_evaluation(data: bytes, *, sender: int, round_: int, header: Mapping[str, str],
                      counts: Mapping[str, int], metrics: Mapping[str, str]) -> dict[str, dict]:
    """An evaluation reply's metrics, {task: {metric: value, ...}}, for exactly the tasks in `metrics`
    (task -> the metric the server scores it by), each value finite."""
    flat = _parse(data, sender=sender, round_=round_, template={}, header=header, what="evaluation")
    meta = flat.raw_metadata
    _counts(meta, sender, round_, counts, "evaluation")
    values = _json_field(meta, "metrics", dict, sender, round_, "evaluation")
    if set(values) != set(metrics):
        raise _refuse(sender, round_, "evaluation", "metrics",
                      f"holds tasks {sorted(values)}, the server asked for {sorted(metrics)}")
    out = {}
    for task, metric in metrics.items():
        entry = values[task]
        if not isinstance(entry, dict):
            raise _refuse(sender, round_, "evaluation", f"metrics.{task}", f"is {type(entry).__name__}, expected "
                          "an object of numbers")
        for name, value in entry.items():
            if not _finite_number(value):
                raise _refuse(sender, round_, "evaluation", f"metrics.{task}.{name}", f"is {value!r}, expected a "
                              "finite number")
        if metric not in entry:
            raise _refuse(sender, round_, "evaluation", f"metrics.{task}", f"has no {metric!r}")
        out[task] = entry
    return out


def accept_fields(data: bytes, *, sender: int, round_: int, header: Mapping[str, str],
                  fields: Iterable[str] = (), template: Mapping | None = None, what: str) -> TaskVector:
    """A reply that carries header fields (a secure-aggregation public key or seeds) or a masked upload
    (`template`: its int64 layout): identity and round checked, `fields` present."""
    tv = _parse(data, sender=sender, round_=round_, template={} if template is None else template,
                header=header, what=what)
    for name in fields:
        if not tv.raw_metadata.get(name):
            raise _refuse(sender, round_, what, name, "is missing")
    return tv


# -- the checks ---------------------------------------------------------------------------------------

def _parse(data: bytes, *, sender: int, round_: int, template, header, what: str) -> TaskVector:
    """The reply's tensors against `template` and header against `header` (TaskVectorError becomes a
    refusal), then its identity: `client_id` the sender, `round` the current one."""
    try:
        tv = TaskVector.from_bytes(data, source=what, template=template, expect=dict(header))
    except TaskVectorError as e:  # its message starts with `what`
        raise UntrustedUpload(sender, round_, "tensors", f"refused {e}") from None
    meta = tv.raw_metadata
    claimed = meta.get("client_id", "")
    if claimed != str(sender):
        raise _refuse(sender, round_, what, "client_id", f"is {claimed!r}, but the transport delivered it from "
                      f"client {sender}")
    if meta.get("round", "") != str(round_):
        raise _refuse(sender, round_, what, "round", f"is {meta.get('round', '')!r}, the current round is {round_}")
    return tv


def _counts(meta: Mapping[str, str], sender: int, round_: int, expected: Mapping[str, int], what: str) -> dict:
    """The header's sample counts: exactly `expected` (tasks and counts), each a positive integer."""
    counts = _json_field(meta, "num_samples", dict, sender, round_, what)
    for task, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise _refuse(sender, round_, what, f"num_samples.{task}", f"is {n!r}, expected a positive integer")
    if set(counts) != set(expected):
        extra, missing = sorted(set(counts) - set(expected)), sorted(set(expected) - set(counts))
        raise _refuse(sender, round_, what, "num_samples",
                      (f"claims task {extra[0]!r}, which the client does not hold" if extra
                       else f"lacks task {missing[0]!r}, which the client holds")
                      + f" (its tasks: {', '.join(sorted(expected)) or 'none'})")
    for task, n in counts.items():
        if n != expected[task]:
            raise _refuse(sender, round_, what, f"num_samples.{task}", f"is {n}, the client holds {expected[task]}")
    task_ids = meta.get("task_ids", "")
    if task_ids != json.dumps(sorted(expected)):
        raise _refuse(sender, round_, what, "task_ids", f"is {task_ids!r}, expected {json.dumps(sorted(expected))}")
    return counts


def _metrics(meta: Mapping[str, str], sender: int, round_: int, what: str) -> dict[str, float]:
    """Training metrics: an object of finite numbers (they are only logged, averaged over clients)."""
    values = _json_field(meta, "metrics", dict, sender, round_, what) if meta.get("metrics") else {}
    for name, value in values.items():
        if not _finite_number(value):
            raise _refuse(sender, round_, what, f"metrics.{name}", f"is {value!r}, expected a finite number")
    return {k: float(v) for k, v in values.items()}


def _json_field(meta: Mapping[str, str], name: str, kind: type, sender: int, round_: int, what: str):
    raw = meta.get(name)
    if raw is None:
        raise _refuse(sender, round_, what, name, "is missing")
    try:
        value = json.loads(raw)
    except ValueError:
        raise _refuse(sender, round_, what, name, f"is not JSON: {_short(raw)}") from None
    if not isinstance(value, kind):
        raise _refuse(sender, round_, what, name, f"is a JSON {type(value).__name__}, expected an object")
    return value


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _refuse(sender: int, round_: int, what: str, field: str, why: str) -> UntrustedUpload:
    return UntrustedUpload(sender, round_, field, f"refused {what}: header {field!r} {why}")
