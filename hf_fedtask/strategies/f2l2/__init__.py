"""F²L², Forgettable Federated Linear Learning with Certified Data Removal (Jin, Chen, Zhang and Li, 2023,
arXiv:2306.02216), one module per concern:

    strategy   the `F2L2` strategy: its phases, messages and client steps
    protocol   the phases, queries and state names the others share
    curvature  the clients' and the server's curvature factors of the Hessian
    cg         `linear_solver: cg`, training by federated conjugate gradient
    removal    the certified removal of a client (`RemovalOptions`, `RemovalResult`)

The second-order numerics (Hessian products, CG, Lanczos, low-rank inverses) are `hf_fedtask.model.newton`'s.
The measured outcomes behind the defaults: docs/results/f2l2.md.
"""

from hf_fedtask.strategies.f2l2.cg import LOCAL_TRAINING
from hf_fedtask.strategies.f2l2.curvature import client_curvature, factor_tail
from hf_fedtask.strategies.f2l2.removal import (
    CLIENTS,
    COMPLETE_TAIL,
    NO_FACTORS,
    SERVER,
    RemovalOptions,
    RemovalResult,
)
from hf_fedtask.strategies.f2l2.strategy import F2L2

# the strategy, its removal's options and result, and the names the removal workflow, the recipes and the
# benchmarks use; the rest is in the module that defines it
__all__ = ["CLIENTS", "COMPLETE_TAIL", "F2L2", "LOCAL_TRAINING", "NO_FACTORS", "SERVER", "RemovalOptions",
           "RemovalResult", "client_curvature", "factor_tail"]
