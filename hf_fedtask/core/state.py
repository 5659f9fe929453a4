"""The server's state between rounds, a client's private store, and the name of everything either holds.

A state is named task vectors (e.g. `shared` PEFT modules and one `head/<task>` per task) plus
JSON-able scalars (the task allocation, a strategy's phase). A strategy may change the names it
keeps from one phase to the next; checkpoints record the names they hold.

Every name a state, a store, a downlink or an upload uses is defined below, for every strategy, and
nowhere else. Checkpoints and run folders pin these strings: a new name may be added, none changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_fedtask.core.taskvector import TaskVector

# -- every strategy ------------------------------------------------------------------------------------
SHARED = "shared"  # the PEFT modules shared by the tasks (absent where nothing is shared)
HEAD = "head/"


def head_name(task: str) -> str:
    """Name of the vector holding `task`'s classification head in states and updates."""
    return f"{HEAD}{task}"


# -- linearized strategies (ntkfedavg, ntkfedprox, f2l2) ------------------------------------------------
POINT = "linearized_at/"


def point_name(name: str) -> str:
    """Name of the linearization point's copy of state vector `name` (`shared` or a head)."""
    return f"{POINT}{name}"


# -- the FedAvg family (fedavg, fedprox, ntkfedavg, ntkfedprox) ------------------------------------------
TRACKED_TASK_VECTOR = "task_vector/"


def tracked_task_vector_name(task: str) -> str:
    """`track_task_vectors`: `task`'s accumulated share of the shared modules' movement (the vector a
    one-shot negation subtracts)."""
    return f"{TRACKED_TASK_VECTOR}{task}"


# -- MaTU --------------------------------------------------------------------------------------------------
MATU_TASK_VECTOR = "task/"
MATU_WIRE = "matu"  # the one vector of a MaTU downlink or upload: the unified wire form of its tasks
MATU_EXPORT = "export"  # all tasks unified, as the compact export writes them


def matu_task_vector_name(task: str) -> str:
    """The server's task vector τ^t of `task` in a MaTU state."""
    return f"{MATU_TASK_VECTOR}{task}"


# -- MaT-FL ------------------------------------------------------------------------------------------------
MODEL = "model/"


def model_name(client_id: int) -> str:
    """A client's own shared modules in a MaT-FL state."""
    return f"{MODEL}{client_id}"


# -- SCAFFOLD ----------------------------------------------------------------------------------------------
CONTROL = "control/"


def control_name(name: str) -> str:
    """The control variate of state vector `name` (`shared` or `head/<task>`): the server's c in the state
    and the downlink, the client's c_i in its store, Δc_i in its upload."""
    return f"{CONTROL}{name}"


# -- FedPer ------------------------------------------------------------------------------------------------
PERSONAL = "personal"  # store: the client's personal layers (its heads are stored under `head_name`)

# -- FedYolo -----------------------------------------------------------------------------------------------
MODULE = "module/"
COUNTS = "counts"  # the secure variant's upload: each task's weight (and the shared part's)


def module_name(task: str) -> str:
    """Name of the vector holding `task`'s own PEFT modules in FedYolo states and updates."""
    return f"{MODULE}{task}"


# -- TCT ---------------------------------------------------------------------------------------------------
TCT_POINT = "tct/point"  # store: the client's copy of θ_{T₁} (shared modules), kept from the normalization round
TCT_MOMENTS = "moments/"
TCT_NORM = "entk/"
TCT_LINEAR = "linear/"


def moments_name(task: str) -> str:
    """Upload of the normalization round: Σz, Σz² and n of `task`'s features."""
    return f"{TCT_MOMENTS}{task}"


def norm_name(task: str) -> str:
    """μ and σ of `task`'s features in the stage-2 state."""
    return f"{TCT_NORM}{task}"


def linear_name(task: str) -> str:
    """W and b of `task`'s stage-2 model."""
    return f"{TCT_LINEAR}{task}"


def tct_lr_name(task: str) -> str:
    """Store: the client's stage-2 step size η_k for `task`."""
    return f"tct/lr/{task}"


def tct_last_name(task: str) -> str:
    """Store: the client's last stage-2 model θ̂_k of `task`."""
    return f"tct/last/{task}"


def tct_h_name(task: str) -> str:
    """Store: the client's stage-2 correction h_k of `task`."""
    return f"tct/h/{task}"


# -- F²L² --------------------------------------------------------------------------------------------------
GRADIENT = "gradient"  # the gradient round's upload: g_k over the shared modules and the head


def gradient_name(client: int) -> str:
    """Client `client`'s last-round gradient g_k (shared modules and head) in the final state."""
    return f"gradient/client{client}"


CURVATURE = "curvature"  # the gradient round's upload with `curvature_rank` > 0: the client's curvature factor


def curvature_name(client: int) -> str:
    """Client `client`'s curvature factor F_k (FᵀF ≈ its data term's Hessian at w₀) in the final state."""
    return f"curvature/client{client}"


CURVATURE_GRAM = "curvature/gram"  # F²L²: the Gram of the clients' factors at unit weights, formed when they arrive
SERVER_CURVATURE = "curvature/server"  # F²L²'s own factor of H_s (`server_curvature_rank`), kept with the run


@dataclass
class GlobalState:
    """Server state after `round` finished rounds."""

    round: int
    vectors: dict[str, TaskVector]
    scalars: dict = field(default_factory=dict)

    @property
    def allocation(self) -> dict[int, list[str]]:
        """Client id -> the tasks it holds."""
        return {int(c): tasks for c, tasks in self.scalars["allocation"].items()}

    @property
    def tasks(self) -> list[str]:
        """Every task some client holds, in name order."""
        return sorted({t for tasks in self.allocation.values() for t in tasks})

    def holders(self, task: str) -> list[int]:
        return [c for c, tasks in self.allocation.items() if task in tasks]

    def heads(self, tasks: list[str]) -> dict[str, TaskVector]:
        """The `head/<task>` vectors of `tasks`."""
        return {head_name(t): self.vectors[head_name(t)] for t in tasks}

    def next(self, vectors: dict[str, TaskVector], **scalars) -> GlobalState:
        """The state of the following round: `vectors` replace this state's of the same name; `scalars` update."""
        return GlobalState(round=self.round + 1, vectors={**self.vectors, **vectors},
                           scalars={**self.scalars, **scalars})


ClientStore = dict[str, TaskVector]
"""A client's private, persistent tensors (e.g. FedPer's personal layers, SCAFFOLD's control variate).
They never travel; the engine that hosts the client keeps them (the in-process engine checkpoints
them with the server state, as the clients' own disks; a Flower client keeps them in its node state)."""
