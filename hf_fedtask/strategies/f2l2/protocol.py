"""F²L²'s round protocol: the phases a run goes through (`F2L2.phase`), the queries its rounds ask the
clients, and the names its state and downlink carry beyond the model. The strategy (`strategy.py`), its
federated conjugate gradient (`cg.py`) and its removal (`removal.py`) all read them."""

PRETRAIN, LINEAR, GRADIENTS, DONE = "pretrain", "linear", "gradients", "done"
GRADIENT_QUERY = "data_gradient"
# linear_solver cg: its value, its first round's query, then each later training round's
CG, CG_START, CG_PRODUCT = "cg", "cg_gradient", "hessian_product"
CG_DIRECTION, CG_RESIDUAL = "f2l2_cg/direction", "f2l2_cg/residual"  # its p and r, kept in the state
PRODUCT = "hessian_product"  # a client's answer to CG_PRODUCT: H_k·p
RIDGE = "f2l2_ridge"  # the downlink's λ_r (one number; clients cannot compute it: D_s is the server's)
