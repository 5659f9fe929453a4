"""Every builtin strategy's options: its config dataclass (like peft's per-method `config.py`, kept apart
from the tuner's `model.py`), typed fields with help text, and the names those options may take.

This module imports no torch, datasets or transformers (only `hf_fedtask.core.fields`), so that `RunConfig`
and `hf-fedtask --help` can check and document strategy options without importing the strategies
themselves; each strategy module (`fedavg.py`, `matu.py`, ...) imports its config class from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_fedtask.core.fields import check_fields, option
from hf_fedtask.core.names import LINEARIZATIONS, RESCALERS
from hf_fedtask.errors import ConfigError

__all__ = ["COMBINE_RULES", "DEFAULT_READING", "DOWNLINK_BITS", "DOWNLINKS", "EXPORT_DTYPE_NAMES", "FACTORS",
           "LINEARIZE_AT", "LORA_AGGREGATIONS", "NEIGHBOURHOODS", "PRODUCT", "READINGS", "SHARE_MODES",
           "WIRE_DTYPE_NAMES", "F2L2Config", "FedAvgConfig", "FedAvgLoRAConfig", "FedPerConfig", "FedProxConfig",
           "FedProxLoRAConfig", "FedYoloConfig", "MaTFLConfig", "MaTUConfig", "NTKFedAvgConfig", "NTKFedProxConfig",
           "ScaffoldConfig", "StrategyConfig", "TCTConfig"]

# FedAvg and FedProx: how LoRA's factors are aggregated
FACTORS, PRODUCT = "factors", "product"
LORA_AGGREGATIONS = (FACTORS, PRODUCT)
# NTKFedAvg: the point clients linearize around
LINEARIZE_AT = ("server", "pretrained")
# FedYolo: the modules shared by all tasks
SHARE_MODES = ("none", "half", "all")
# MaTU (see `hf_fedtask.strategies.matu`)
COMBINE_RULES = ("sum", "mean", "s_normalized", "s_normalized_cross")
READINGS = ("cumulative", "delta")  # what clients upload and Eq. 7 yields
DEFAULT_READING = "delta"
NEIGHBOURHOODS = ("round", "all")
DOWNLINKS = ("unified", "per_task", "per_task_int8", "per_task_int4")  # see `hf_fedtask.strategies.matu.encode_wire`
WIRE_DTYPE_NAMES = ("float32", "bfloat16")  # torch dtypes of the same names
EXPORT_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # the compact export's unified vector
DOWNLINK_BITS = {"per_task_int8": 8, "per_task_int4": 4}  # block-wise integers (`hf_fedtask.merge.blockquant`)


@dataclass
class StrategyConfig:
    """Base of every strategy's options (like peft's per-method configs): typed fields with help text
    (`hf_fedtask.core.fields.option`), checked on construction; `validate` adds value checks."""

    def __post_init__(self):
        check_fields(self, source="strategy options")
        self.validate()

    def validate(self) -> None:
        """Checks beyond types and choices (ranges); raise ConfigError."""


@dataclass
class FedAvgConfig(StrategyConfig):
    """The options of FedAvg's server step, shared by the family built on it (NTKFedAvg, NTKFedProx)."""

    server_lr: float = option(1.0, "server step size α: the state moves by α times the mean update")
    forget_tasks: list[str] | None = option(None, "unlearning: negate the updates of the clients holding these tasks")
    forget_clients: list[int] | None = option(None, "unlearning: negate the updates of these clients", minimum=0)
    track_task_vectors: bool = option(False, "keep each task's accumulated vector (for one-shot negation)")


@dataclass
class FedAvgLoRAConfig(FedAvgConfig):
    """FedAvg's options with the LoRA aggregation (the strategies whose model is the LoRA product itself)."""

    lora_aggregation: str = option(FACTORS, "how LoRA's A and B are aggregated: factors (each averaged on its own, "
                                   "as FedIT does) or product (the exact mean of the clients' B·A, re-factorized "
                                   "to rank r by a truncated SVD, as FlexLoRA does)", choices=LORA_AGGREGATIONS)
    lora_ranks: list[int] | None = option(None, "clients of different LoRA ranks (FlexLoRA): each client's rank, one "
                                          "per client or cycled over them (client c gets the (c mod k)-th); lora_r "
                                          "is the server's global rank, at least the largest; needs "
                                          "lora_aggregation product (default: every client at lora_r)", minimum=1)

    def validate(self) -> None:
        super().validate()
        if self.lora_aggregation == PRODUCT and self.track_task_vectors:
            raise ConfigError("strategy options: track_task_vectors needs lora_aggregation factors (product "
                              "re-factorizes the LoRA modules every round, so no task's share of their movement "
                              "adds up)")
        if self.lora_ranks is not None and not self.lora_ranks:
            raise ConfigError("strategy options: lora_ranks: give at least one rank (or leave it out: every client "
                              "at lora_r)")
        if self.lora_ranks and self.lora_aggregation != PRODUCT:
            raise ConfigError("strategy options: lora_ranks needs lora_aggregation product (clients of different "
                              "ranks are aggregated by their B·A products, re-factorized to lora_r by a truncated "
                              "SVD, as FlexLoRA does)")


@dataclass
class FedProxConfig(FedAvgConfig):
    """FedProx's options beside FedAvg's step (shared with NTKFedProx)."""

    proximal_mu: float = option(0.01, "FedProx's μ: clients add (μ/2)·‖θ − θ_s‖² to their loss", minimum=0)


@dataclass
class FedProxLoRAConfig(FedAvgLoRAConfig, FedProxConfig):
    """FedProx's options with the LoRA aggregation."""


@dataclass
class NTKFedAvgConfig(FedAvgConfig):
    """NTKFedAvg's options: FedAvg's server step, and where and what the clients linearize."""

    linearize_at: str = option("server", "point clients linearize around: the server state of the round "
                               "(re-linearized every round) or the pretrained/initial one", choices=LINEARIZE_AT)
    linearization: str = option("network", "what is linearized: the whole network in the trainable parameters, "
                                "or each LoRA layer on its own (L-LoRA)", choices=LINEARIZATIONS)


@dataclass
class NTKFedProxConfig(NTKFedAvgConfig, FedProxConfig):
    """NTKFedProx's options: NTKFedAvg's and FedProx's μ."""


AUTO = "auto"
# F²L²'s forms of g₋ (`strategies.f2l2`)
GRADIENT_FORMS = (AUTO, "split", "anchored", "difference", "target", "retained")
HESSIANS = (AUTO, "server", "clients")  # where F²L²'s removal Hessian comes from (`strategies.f2l2`)


@dataclass
class F2L2Config(StrategyConfig):
    """F²L²'s options: the server's own data and pretraining, the training objective and the removal step."""

    server_fraction: float = option(0.1, "share of each task's training split the server keeps (D_s): it pretrains "
                                    "w₀ and approximates the removal Hessian on it; never sent", minimum=0.0,
                                    maximum=0.9)
    hessian_holdout: float = option(0.0, "share of the server's slice D_s kept out of pretraining w₀ and used for "
                                    "the removal's Hessian H_s (and λ_max): a Hessian on the very inputs w₀ was fit "
                                    "to can miss most of the curvature (0: D_s for both)", minimum=0.0, maximum=0.9)
    pretrain_epochs: float = option(20.0, "epochs of the server's pretraining of w₀ on D_s (cross-entropy, Adam, "
                                    "cosine schedule; 0 = w₀ is the initialization)", minimum=0.0)
    pretrain_lr: float = option(1e-3, "learning rate of the server's pretraining", minimum=0.0)
    l2: float = option(0.0, "λ of the training objective's (λ/2)·‖w‖² (the official code trains with 0)", minimum=0.0)
    ridge: float = option(0.0, "ρ of a ridge (λ_r/2)·‖w − w₀‖² added to the training objective, λ_r = "
                          "ρ·λ_max(H_s) set by the server after pretraining: the objective becomes λ_r-strongly "
                          "convex (kernel ridge regression on the linearized model), as the paper's certified "
                          "removal assumes, so training can reach the optimum the Newton step aims at (0: none)",
                          minimum=0.0)
    removal_damping: str = option("auto", "how the removal step (H_s + λI)⁻¹·g is damped: relative, λ = "
                                  "removal_rho·λ_max(H_s) (λ_max by Lanczos on the server's slice, so λ follows the "
                                  "Hessian's scale from one model to another), absolute, λ = removal_l2, "
                                  "objective, λ = l2 + λ_r: the trained objective's own Hessian (the exact Newton "
                                  "step; needs l2 or ridge > 0), or auto: objective where l2 + λ_r > 0 and either "
                                  "the clients' curvature factors are complete or, with H_s, w* is the objective's "
                                  "optimum (its gradient from the uploads at most 0.1 of the retained objective's), "
                                  "else relative",
                                  choices=("auto", "relative", "absolute", "objective"))
    removal_rho: float = option(0.002, "ρ of the relative damping λ = ρ·λ_max(H_s): a smaller ρ costs clean "
                                "accuracy, a larger one lets the backdoor survive (docs/results/f2l2.md)",
                                minimum=0.0, exclusive_minimum=True)
    removal_l2: float = option(10.0, "λ of the removal step under removal_damping absolute; equal to l2 > 0 it is "
                               "the exact Newton step of the trained objective", minimum=0.0)
    removal_trust_radius: float = option(1.0, "cap the removal step's norm at this multiple of ‖w* − w₀‖, how far "
                                         "training moved from w₀, raising λ until the step fits (0: no cap): "
                                         "retraining from w₀ for the same rounds ended 0.3-0.7 of that from w* in "
                                         "the settings of docs/results/f2l2.md, and a longer step is one the server's "
                                         "Hessian cannot vouch for", minimum=0.0)
    curvature_rank: int = option(0, "rank of the curvature factor each client uploads with its last-round "
                                 "gradient (the top eigenpairs of its data term's Gauss-Newton Hessian at w₀, by "
                                 "Lanczos; rank × the trainable parameters' floats): the removal then solves with "
                                 "the retained clients' own Hessian instead of the server's slice H_s, still with "
                                 "no message at removal time (0: none, H_s); with linear_solver cg the factors "
                                 "come with the first round's gradients instead and also precondition training",
                                 minimum=0)
    server_curvature_rank: int = option(128, "rank of the server's own curvature factor of H_s (its top eigenpairs "
                                        "at w₀, by Lanczos over its slice), computed in the gradient round and kept "
                                        "with the run (rank × the trainable parameters' floats, the rank lowered to "
                                        "fit 256 MiB): a removal takes λ_max from it and preconditions its "
                                        "conjugate-gradient solves with it, a few Hessian-vector products instead of "
                                        "hundreds, the same step (0: none; Lanczos and plain CG at removal time)",
                                        minimum=0)
    start: str = option("pretrained", "w⁰ of federated training: the pretrained w₀, or the run's fresh "
                        "initialization (the official code's)", choices=("pretrained", "random"))
    linear_solver: str = option(
        "fedavg", "how the clients train the linearized model: fedavg, local epochs of the run's optimizer averaged "
        "each round (the paper's FLT), or cg, federated conjugate gradient on the quadratic objective (the loss is "
        "squared error on a model linear in w): each round every client returns its data term's Hessian-vector "
        "product with the server's direction (one pass over its data, an upload of the model's size), "
        "preconditioned by the server's factor of H_s, so training reaches the objective's unique optimum, the "
        "point the certified removal assumes, in about as many rounds as CG iterations (with l2 = ridge = 0, "
        "unpreconditioned, the minimizer nearest w⁰, where gradient descent from w⁰ would end; the run's local "
        "training options do not apply)", choices=("fedavg", "cg"))

    def validate(self) -> None:
        if self.server_fraction <= 0:
            raise ConfigError("f2l2: server_fraction must be > 0 (the server pretrains and approximates the "
                              "Hessian on its own data)")
        if self.removal_damping == "objective" and self.l2 == 0 and self.ridge == 0:
            raise ConfigError("f2l2: removal_damping 'objective' needs l2 > 0 or ridge > 0 (with neither the "
                              "objective's Hessian H_s is singular and its Newton step undefined)")


@dataclass
class FedPerConfig(StrategyConfig):
    """FedPer's options: the personal layers kept on the clients and the server step."""

    personal_blocks: int = option(1, "last transformer blocks kept on the client (with the heads)", minimum=1)
    server_lr: float = option(1.0, "server step size α")


@dataclass
class FedYoloConfig(StrategyConfig):
    """FedYolo's options: which modules the tasks share, and its privacy variant."""

    share: str = option("none", "modules shared by all tasks: none | half (first ⌊L/2⌋ blocks) | all",
                        choices=SHARE_MODES)
    secure_aggregation: bool = option(False, "privacy variant: K-task slot uploads, masked on the clients; "
                                      "the server sees only their sum")
    sample_weighted: bool = option(False, "weight the per-task means by sample counts (the paper: unweighted)")


@dataclass
class MaTFLConfig(StrategyConfig):
    """MaTFL's options: the server step and the size of each client's aggregation group."""

    server_lr: float = option(1.0, "server step size α")
    group_size: int = option(3, "peers (self included) each client aggregates with", minimum=1)


@dataclass
class MaTUConfig(StrategyConfig):
    """MaTU's options: the agreement masks, the cross-task aggregation (Eqs. 3-7) and the wire form."""

    rho: float = option(0.4, "agreement-mask threshold ρ (Eq. 3, from Gradient Masked Averaging)", minimum=0, maximum=1)
    kappa: int = option(2, "κ: at most this many neighbours per task in the cross-task aggregation "
                           "(Eq. 6; never given by the paper)", minimum=0)
    epsilon: float = option(0.5, "ε: a neighbour needs sign similarity S(t, t') > ε (Eq. 5; S ≈ 0.5 unrelated, "
                                 "> 0.5 agreeing, < 0.5 opposed)", minimum=0, maximum=1)
    combine: str = option("s_normalized", "Eq. 7: sum (literal; under cumulative it compounds, geometrically with "
                                          "short local training; under delta it adds the neighbours' increments, "
                                          "stable) | mean | s_normalized (similarity-weighted mean, t weighing 1) | "
                                          "s_normalized_cross (t's own step whole, the neighbours' weighted as "
                                          "s_normalized weighs them)",
                          choices=COMBINE_RULES)
    vectors: str = option(DEFAULT_READING, "what Eqs. 3-7 act on: cumulative (clients upload trained - θ_p, Eq. 7's "
                                           "output replaces τ^t; the literal reading, whose task vectors collapse "
                                           "with multi-task clients) | delta (clients upload the round's change, "
                                           "Eq. 7's output is added to τ^t)", choices=READINGS)
    neighbours: str = option("all", "candidates for Z^t: round (tasks with participants this round) | all (also "
                                    "tasks carried forward, compared by their server vector τ^t)",
                             choices=NEIGHBOURHOODS)
    rescaler: str = option("global_sum", "global_sum (the paper) | per_tensor_mean (EMR's code)",
                           choices=RESCALERS)
    include_self: bool = option(False, "whether t may be its own neighbour (S(t, t) = 1)")
    downlink: str = option("unified", "what a client trains each task from: unified (the paper: λ_t·(m_t ⊙ τ) "
                                      "decoded from one unified vector, 1-bit masks and rescalers) | per_task (each "
                                      "task's own τ^t, the point its step is added to; one vector per task held) | "
                                      "per_task_int8 | per_task_int4 (each τ^t in 8 or 4-bit integers, a bfloat16 "
                                      "scale per 64 entries: 0.26 or 0.13 of per_task's bytes)",
                           choices=DOWNLINKS)
    wire_dtype: str = option("float32", "dtype of the unified vector on the wire (bfloat16 halves it)",
                             choices=WIRE_DTYPE_NAMES)
    export_dtype: str = option("float16", "dtype of the compact export's unified vector (float16 halves it; the "
                                          "export's accuracy is measured from it)", choices=EXPORT_DTYPE_NAMES)
    downlink_feedback: bool = option(True, "with per_task_int8/int4: server-side error feedback, each task's "
                                           "rounding error carried into its next downlink so the starts its "
                                           "clients train from average to τ^t")

    def validate(self) -> None:
        if not self.downlink_feedback and self.downlink not in DOWNLINK_BITS:
            raise ConfigError(f"downlink_feedback: false has no effect with downlink {self.downlink} (nothing is "
                              f"rounded; only {' and '.join(DOWNLINK_BITS)} are): drop it")


@dataclass
class ScaffoldConfig(StrategyConfig):
    """SCAFFOLD's options: the global step size."""

    server_lr: float = option(1.0, "server step size η_g: x moves by η_g times the mean update", minimum=0)


@dataclass
class TCTConfig(StrategyConfig):
    """TCT's options: the two stages and the eNTK features of the convexified one."""

    stage1_rounds: int = option(20, "T₁: FedAvg rounds before the convexified stage (0 = eNTK at the init)", minimum=0)
    num_features: int = option(10000, "p: eNTK coordinates kept, a seeded subset identical on every client", minimum=1)
    stage2_steps: int = option(100, "M: full-batch gradient steps per client and stage-2 round", minimum=1)
    stage2_lr: float = option(0.0, "η of stage 2; 0 = 1/λ_max of each client's feature covariance", minimum=0)
    solver: str = option("scaffold", "stage-2 solver: scaffold (TCT) | fedavg (the ablation)",
                         choices=("scaffold", "fedavg"))
    normalize: bool = option(True, "standardize the features with the federation's mean and std")
    bias: bool = option(True, "a bias b beside W (the paper's; the official code has none)")
    feature_seed: int = option(123, "seed of the coordinate subset and of the re-initialized heads")
    feature_batch_size: int = option(64, "samples per batched eNTK computation", minimum=1)
