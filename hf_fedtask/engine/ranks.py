"""The in-process engine over the processes of a multi-process launch: more hands, one federation.

    torchrun --nproc_per_node 2 recipes/matu_30task.py            # CPU: two processes
    accelerate launch --multi_gpu --num_processes 4 recipes/matu_30task.py   # one GPU each

Every rank builds the same environment from the same config (same partition, seeded init, heads).
Rank 0 runs the round loop: it samples, sends each rank its share of the round's clients, trains its
own share, aggregates the replies in client order, evaluates (the tasks shared among the ranks) and
is the one writer of the run folder. The other ranks only answer: they train the clients they are
sent on their own device and return the replies. A client's result depends only on (state, data,
seed), so the run equals the single-process run tensor for tensor at the same threads per process.

Ranks talk through the launcher's key-value store (`torch.distributed.rendezvous("env://")`: the
TCPStore torchrun and Accelerate start), in the same bytes the other engines move (safetensors
blobs, JSON headers), never pickles; no collective process group is formed, so each rank's Trainer
stays a plain single-process loop (`hf_fedtask.model.device.hide_launch_from_trainers`).

Secure aggregation (FedYolo's `secure_aggregation`): each rank draws the Diffie-Hellman secret of every
client it hosts from the OS (`secrets.token_bytes(32)`, `ClientSecrets`) and keeps it in its own process
for the run; it never travels (the client stores that do travel hold none). A round's key query, masked
upload and reveal of a client go to the same rank, so they use the same secret; the masks cancel in the
sum, so the run still equals the single-process run. Its limits: the clients rank 0 hosts share the
server's process, which could read their secrets, so only the clients of the other ranks are protected
from the server; and the single-process simulator (`InProcessTransport`) derives every secret from the
public run seed for exact repeatability, so its secure aggregation is a simulation, not a protection.
"""

from __future__ import annotations

import json
import secrets
import struct
from datetime import timedelta
from itertools import count

from hf_fedtask import errors
from hf_fedtask.core.state import ClientStore, GlobalState
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.wire import pack_vectors, unpack_vectors
from hf_fedtask.engine.client import ClientRuntime
from hf_fedtask.engine.environment import Environment
from hf_fedtask.engine.messages import SECAGG_PUBLIC_KEY, SECAGG_REVEAL, Instruction
from hf_fedtask.engine.transport import InProcessTransport
from hf_fedtask.errors import FedTaskError, ProtocolError
from hf_fedtask.model.device import Launch, hide_launch_from_trainers, launch
from hf_fedtask.strategies import QUERY, TRAIN

ACK_WAIT = timedelta(seconds=60)  # for the other ranks to read the end of a run
WAIT = timedelta(days=30)  # a rank waits as long as rank 0 evaluates or exports; the launcher ends it if rank 0 dies
# each run in this process (a recipe may run several) gets its own keys, in the same order on every rank
_sessions = count()
_store = None


def rank_store():
    """This launch's key-value store (the launcher's TCPStore), joined once per process."""
    global _store
    if _store is None:
        import torch.distributed as dist

        here = launch()
        _store, _, _ = next(dist.rendezvous("env://", rank=here.rank, world_size=here.world_size))
        _store.set_timeout(WAIT)
        hide_launch_from_trainers()
    return _store


# -- the store: values in chunks it accepts ---------------------------------------------------------
CHUNK = 4 << 20  # the TCPStore's server refuses values over 8 MiB (its libuv backend's limit)


def _put(store, key: str, data: bytes) -> None:
    """`data` under `key`, in chunks; the chunk count is written last, so a reader waiting on `key`
    finds every chunk in place."""
    n = max(1, -(-len(data) // CHUNK))
    for i in range(n):
        store.set(f"{key}/{i}", data[i * CHUNK:(i + 1) * CHUNK])
    store.set(key, str(n))


def _take(store, key: str) -> bytes:
    """What `_put` wrote under `key` (waiting for it), removed from the store."""
    n = int(store.get(key))
    parts = [store.get(f"{key}/{i}") for i in range(n)]
    for name in [key, *(f"{key}/{i}" for i in range(n))]:
        store.delete_key(name)
    return b"".join(parts)


# -- framing: a JSON header and blobs, in one bytes value -------------------------------------------
def _frame(header: dict, blobs: list[bytes] = ()) -> bytes:
    head = json.dumps({**header, "sizes": [len(b) for b in blobs]}).encode()
    return b"".join([struct.pack("<Q", len(head)), head, *blobs])


def _unframe(data: bytes) -> tuple[dict, list[bytes]]:
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    blobs, at = [], 8 + n
    for size in header.pop("sizes"):
        blobs.append(data[at:at + size])
        at += size
    return header, blobs


def _store_bytes(store: ClientStore) -> bytes:
    return pack_vectors(store).to_bytes()


def _store_of(data: bytes) -> ClientStore:
    return unpack_vectors(TaskVector.from_bytes(data, source="client store"))


def _state_blobs(state: GlobalState) -> tuple[dict, list[bytes]]:
    return {"round": state.round, "scalars": state.scalars}, [pack_vectors(state.vectors).to_bytes()]


def _error(exc: BaseException) -> dict:
    """An exception as a header, re-raised on rank 0 as the same hf_fedtask error class."""
    return {"error": str(exc), "error_class": type(exc).__name__}


def _raise(header: dict, where: str) -> None:
    if header.get("error") is not None:
        cls = getattr(errors, header["error_class"], None)
        if isinstance(cls, type) and issubclass(cls, FedTaskError):
            raise cls(header["error"])
        raise FedTaskError(f"{where}: {header['error_class']}: {header['error']}")


def balance(sizes: dict, ranks: int) -> list[list]:
    """Items (by `sizes`) in `ranks` shares of about equal total size: largest first onto the least
    loaded rank (ties to the lower rank); each share keeps the items' given order."""
    loads, shares = [0] * ranks, [[] for _ in range(ranks)]
    for item in sorted(sizes, key=lambda i: -sizes[i]):
        r = min(range(ranks), key=lambda k: (loads[k], k))
        loads[r] += sizes[item] or 1
        shares[r].append(item)
    order = {item: i for i, item in enumerate(sizes)}
    return [sorted(share, key=order.get) for share in shares]


class ClientSecrets:
    """The secure-aggregation secrets of the clients this rank hosts: 32 random bytes from the OS per
    client, drawn at its first instruction and kept in this process for the run, so nothing public (the
    run seed) derives them and no other process holds them."""

    def __init__(self):
        self._secrets: dict[int, bytes] = {}

    def __getitem__(self, client_id: int) -> bytes:
        if client_id not in self._secrets:
            self._secrets[client_id] = secrets.token_bytes(32)
        return self._secrets[client_id]


def _secagg_query(ins: Instruction, query: str) -> bool:
    return ins.kind == QUERY and ins.config.get("query") == query


def _continues_secagg(ins: Instruction) -> bool:
    """A masked upload or a reveal: it needs the secret whose public key the client gave this round."""
    return (ins.kind == TRAIN and "secagg_peers" in ins.config) or _secagg_query(ins, SECAGG_REVEAL)


class RankTransport(InProcessTransport):
    """Rank 0's transport: the round's instructions shared among the launch's ranks; the clients'
    stores stay here (checkpointed with the server state) and travel with each instruction."""

    name = "in-process (ranks)"

    def __init__(self, env: Environment, here: Launch | None = None):
        super().__init__(env)
        self.here = here or launch()
        self.store = rank_store()
        self.session = next(_sessions)
        self._seq = count()
        self._closed = False
        self._secrets = ClientSecrets()  # of the clients rank 0 hosts
        self._secagg_homes: dict[tuple[int, int], int] = {}  # (round, client) -> rank of its key query

    def runtime(self, client_id: int) -> ClientRuntime:
        """A client rank 0 hosts, with its secret from this process's `ClientSecrets`, not the run seed."""
        return ClientRuntime(self.env, client_id, secagg_secret=self._secrets[client_id])

    def _shares(self, instructions: list[Instruction]) -> list[list[int]]:
        """The instructions' indices per rank, balanced by the clients' data sizes; a client's masked
        upload or reveal goes to the rank that answered its key query this round (its secret is there)."""
        pinned, sizes = {}, {}
        for i, ins in enumerate(instructions):
            home = self._secagg_homes.get((ins.round, ins.client_id)) if _continues_secagg(ins) else None
            if home is not None:
                pinned[i] = home
            else:
                sizes[i] = sum(len(d) for d in self.env.partition[ins.client_id].values())
        shares = balance(sizes, self.here.world_size)
        for i, rank in pinned.items():
            shares[rank].append(i)
        shares = [sorted(share) for share in shares]
        homes = {(instructions[i].round, instructions[i].client_id): rank for rank, share in enumerate(shares)
                 for i in share if _secagg_query(instructions[i], SECAGG_PUBLIC_KEY)}
        if homes:  # a round's key exchange: the homes of the rounds before are no longer needed
            self._secagg_homes = homes
        return shares

    def _send(self, rank: int, seq: int, header: dict, blobs: list[bytes] = ()) -> None:
        _put(self.store, f"hf_fedtask/{self.session}/{seq}/to/{rank}", _frame(
            {**header, "fingerprint": self.env.config.fingerprint(), "rounds": self.env.config.rounds}, list(blobs)))

    def _receive(self, rank: int, seq: int) -> tuple[dict, list[bytes]]:
        return _unframe(_take(self.store, f"hf_fedtask/{self.session}/{seq}/from/{rank}"))

    def _others(self) -> range:
        return range(1, self.here.world_size)

    def exchange(self, instructions: list[Instruction]) -> dict[int, bytes]:
        shares = self._shares(instructions)
        seq = next(self._seq)
        for rank in self._others():
            items = [instructions[i] for i in shares[rank]]
            blobs = [b for ins in items for b in (ins.payload, _store_bytes(self._stores.get(ins.client_id, {})))]
            self._send(rank, seq, {"op": "exchange", "items": [
                {"kind": ins.kind, "round": ins.round, "client_id": ins.client_id, "config": ins.config}
                for ins in items]}, blobs)
        replies = super().exchange([instructions[i] for i in shares[0]])
        for rank in self._others():
            header, blobs = self._receive(rank, seq)
            for i, item in enumerate(header["items"]):
                _raise(item, f"client {item['client_id']} on rank {rank}")
                replies[item["client_id"]] = blobs[2 * i]
                self._stores[item["client_id"]] = _store_of(blobs[2 * i + 1])
        return {ins.client_id: replies[ins.client_id] for ins in instructions if ins.client_id in replies}

    def evaluate(self, server, state: GlobalState, names: list[str]) -> dict[str, dict]:
        """The tasks shared among the ranks by test-split size; the metrics merged in task order."""
        sizes = {name: len(self.env.task_by_name[name].dataset["test"]) for name in names}
        shares = balance(sizes, self.here.world_size)
        seq = next(self._seq)
        header, blobs = _state_blobs(state)
        for rank in self._others():
            self._send(rank, seq, {"op": "evaluate", "tasks": shares[rank], **header}, blobs)
        out = server.evaluate_tasks(state, shares[0])
        for rank in self._others():
            reply, _ = self._receive(rank, seq)
            _raise(reply, f"evaluation on rank {rank}")
            out.update(reply["metrics"])
        return {name: out[name] for name in names}

    def finish(self, results: dict | None = None, error: BaseException | None = None) -> None:
        """Release the other ranks: they return `results` from their `run`, or raise `error`'s line
        (the run calls it once it is over, whether it finished or failed; `close` sends nothing)."""
        if self._closed:
            return
        self._closed = True
        seq = next(self._seq)
        for rank in self._others():
            self._send(rank, seq, {"op": "end", "results": results, **(_error(error) if error else {})})
        _await_acks(self.store, self.session, seq, self._others())


def _await_acks(store, session: int, seq: int, ranks: range) -> None:
    """Wait (a bounded time) until each rank has read the end of the run: a launcher ends every rank as
    soon as one exits with an error, so rank 0 exiting first would cut the others' last line."""
    for rank in ranks:
        key = f"hf_fedtask/{session}/{seq}/from/{rank}"
        try:
            store.wait([key], ACK_WAIT)
            _take(store, key)
        except Exception:  # noqa: BLE001  (a rank that is gone cannot answer; the run's outcome stands)
            return


def release_ranks(config, error: BaseException) -> None:
    """Rank 0 failed before its transport existed (e.g. a refused output folder): end the other
    ranks' session with the same error line."""
    here = launch()
    store, session = rank_store(), next(_sessions)
    for rank in range(1, here.world_size):
        _put(store, f"hf_fedtask/{session}/0/to/{rank}", _frame({"op": "end", "results": None, **_error(error),
                                                               "fingerprint": config.fingerprint(),
                                                               "rounds": config.rounds}))
    _await_acks(store, session, 0, range(1, here.world_size))


def serve(config) -> dict:
    """A rank other than 0: answer rank 0's instructions for the run of `config` until it ends the
    run; return its results (or raise its error)."""
    here, store, session = launch(), rank_store(), next(_sessions)
    env = server = None
    hosted = ClientSecrets()  # of the clients this rank is sent, for the run
    for seq in count():
        header, blobs = _unframe(_take(store, f"hf_fedtask/{session}/{seq}/to/{here.rank}"))
        # `rounds` too: lr_round_schedule cosine anneals each round's learning rate over them
        if header["fingerprint"] != config.fingerprint() or header["rounds"] != config.rounds:
            raise ProtocolError(f"rank {here.rank} was started with another config than rank 0: every rank must run "
                                "the same command")
        if header["op"] == "end":
            _put(store, f"hf_fedtask/{session}/{seq}/from/{here.rank}", _frame({"ack": True}))
            _raise(header, "rank 0")
            return header["results"]
        if env is None:
            from hf_fedtask.engine.server import Server

            env = Environment(config)
            server = Server(env)
        reply_key = f"hf_fedtask/{session}/{seq}/from/{here.rank}"
        if header["op"] == "evaluate":
            state = GlobalState(header["round"], unpack_vectors(TaskVector.from_bytes(blobs[0], source="state")),
                                header["scalars"])
            try:
                reply = _frame({"metrics": server.evaluate_tasks(state, header["tasks"])})
            except Exception as exc:  # reported to rank 0, which ends the run with it
                reply = _frame(_error(exc))
            _put(store, reply_key, reply)
            continue
        items, out = [], []
        for i, item in enumerate(header["items"]):
            ins = Instruction(item["kind"], item["round"], item["client_id"], blobs[2 * i], item["config"])
            client_store = _store_of(blobs[2 * i + 1])
            try:
                reply = ClientRuntime(env, ins.client_id, secagg_secret=hosted[ins.client_id]).handle(ins, client_store)
                items.append({"client_id": ins.client_id, "error": None})
                out += [reply, _store_bytes(client_store)]
            except Exception as exc:
                items.append({"client_id": ins.client_id, **_error(exc)})
                out += [b"", b""]
        _put(store, reply_key, _frame({"items": items}, out))
