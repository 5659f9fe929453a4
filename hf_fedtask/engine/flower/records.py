"""How an `Instruction` and its reply travel inside Flower messages.

The payload (safetensors bytes) goes as ONE uint8 `Array` with stype `application/safetensors` in an
`ArrayRecord`: Flower chunks arrays for transfer and never pickles them, and the bytes arrive exactly
as sent (bfloat16 included), so the server validates them as it validates any upload. The
instruction's kind, round, client id and JSON config go in a `ConfigRecord`.
"""

from __future__ import annotations

import json

from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType, RecordDict

from hf_fedtask.core.kinds import EVALUATE, QUERY, TRAIN
from hf_fedtask.engine.messages import Instruction
from hf_fedtask.errors import ProtocolError

PAYLOAD = "payload"  # the ArrayRecord (and its one Array) holding the bytes
INSTRUCTION = "instruction"  # the ConfigRecord describing the instruction
SAFETENSORS = "application/safetensors"

MESSAGE_TYPES = {TRAIN: MessageType.TRAIN, QUERY: MessageType.QUERY, EVALUATE: MessageType.EVALUATE}
"""Instruction kind -> Flower message type."""

DISCOVER = f"{MessageType.QUERY}.discover"
"""The message type asking a node which client (partition id) it holds."""


def payload_record(data: bytes) -> ArrayRecord:
    """`data` as a one-array ArrayRecord."""
    return ArrayRecord({PAYLOAD: Array(dtype="uint8", shape=(len(data),), stype=SAFETENSORS, data=bytes(data))})


def read_payload(content: RecordDict, source: str, key: str = PAYLOAD) -> bytes:
    """The bytes `payload_record` put in `content[key]`; a ProtocolError naming `source` if missing."""
    record = content.array_records.get(key)
    array = record.get(PAYLOAD) if record is not None else None
    if array is None or array.stype != SAFETENSORS or array.dtype != "uint8":
        raise ProtocolError(f"{source}: the message carries no {SAFETENSORS} payload")
    return bytes(array.data)


def instruction_content(ins: Instruction) -> RecordDict:
    """A fresh RecordDict for one instruction (never shared between messages)."""
    meta = ConfigRecord({"kind": ins.kind, "round": ins.round, "client_id": ins.client_id, "config": ins.config_json()})
    return RecordDict({INSTRUCTION: meta, PAYLOAD: payload_record(ins.payload)})


def read_instruction(content: RecordDict, source: str) -> Instruction:
    """The Instruction `instruction_content` encoded."""
    meta = content.config_records.get(INSTRUCTION)
    if meta is None:
        raise ProtocolError(f"{source}: the message carries no {INSTRUCTION!r} record")
    try:
        config = json.loads(meta["config"])
        return Instruction(str(meta["kind"]), int(meta["round"]), int(meta["client_id"]),
                           read_payload(content, source), config)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"{source}: malformed {INSTRUCTION!r} record ({type(e).__name__}: {e})") from None


def reply_content(data: bytes) -> RecordDict:
    """A client's reply bytes as message content."""
    return RecordDict({PAYLOAD: payload_record(data)})
