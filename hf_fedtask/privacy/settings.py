"""A run's client-level DP options (`RunConfig.dp_*`) resolved into one `PrivacySettings`, and every refusal:
options given without `dp_clip`, both or neither of σ and a target ε, a strategy that does not declare
`Capabilities.client_dp` (one line naming it and why), noise drawn by the clients without secure aggregation,
and the strategy's own refusals (`check_private`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_fedtask.errors import ConfigError

# why the strategies that do not declare client-level DP refuse it (a strategy not listed gets the generic line)
UNSUPPORTED = {
    "tct": "its stage 2 uploads eNTK feature statistics and trains a linear model on them, not a sum of one "
           "clipped update per client",
    "f2l2": "the server trains on its own data slice and the removal step needs each client's gradients, which "
            "a noisy sum of clipped uploads does not give",
    "fedper": "its tasks are evaluated on their holders with personal layers trained on their data, and those "
              "metrics reach the server outside any noisy sum",
    "matfl": "the server keeps one model per client and moves it by similarity-weighted means of individual "
             "updates, which differential privacy does not release",
}
GENERIC = "its aggregation is not declared as a noisy sum of clipped uploads (Capabilities.client_dp)"
DP_OPTIONS = ("dp_noise_multiplier", "dp_epsilon", "dp_noise", "dp_noise_seed", "dp_delta")
DEFAULT_DELTA = 1e-5


@dataclass(frozen=True)
class PrivacySettings:
    """Client-level DP of one run: clip C, noise multiplier σ (given, or calibrated to `target_epsilon` for a run
    of `rounds` rounds from the start; a resumed run may recalibrate it, `hf_fedtask.privacy.server`), δ, where
    the noise is drawn, the seed of the noise and of the client sample (None: secret), and the sampling the
    accountant models (`sample` of `population` clients each round)."""

    clip: float
    noise_multiplier: float
    delta: float
    noise: str
    noise_seed: int | None
    population: int
    sample: int
    rounds: int
    target_epsilon: float | None = None

    def epsilon(self, rounds: int) -> float:
        from hf_fedtask.privacy.accountant import epsilon

        return epsilon(self.population, self.sample, self.noise_multiplier, rounds, self.delta)

    def describe(self) -> dict:
        """The settings as results.json and the model card report them."""
        from hf_fedtask.privacy.accountant import ACCOUNTANT

        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier, "delta": self.delta,
                "noise": self.noise, "target_epsilon": self.target_epsilon, "accountant": ACCOUNTANT,
                "sampling": self.sampling(), "secret_sample": self.secret_sample,
                "noise_seed": "given (reproducible: anyone who knows it can remove the noise)"
                              if self.noise_seed is not None else "secret (os.urandom)"}

    @property
    def secret_sample(self) -> bool | None:
        """Whether each round's client sample is secret (drawn from os.urandom); None when every client takes part."""
        return None if self.sample >= self.population else self.noise_seed is None

    def sampling(self) -> str:
        """The sampling in words, with where the sample comes from."""
        if self.sample >= self.population:
            return f"all {self.population} clients every round (no sampling, no amplification)"
        source = ("drawn secretly (os.urandom; not from the public run seed)" if self.secret_sample else
                  "drawn from dp_noise_seed (reproducible: anyone who knows it knows each round's sample)")
        return f"{self.sample} of {self.population} clients per round, without replacement, {source}"


def dp_requested(config) -> bool:
    """Whether the run asks for client-level DP (`dp_clip` set)."""
    return getattr(config, "dp_clip", None) is not None


def check_options(config, strategy: str, supported: bool, secure: bool) -> None:
    """The refusals that need the run config alone (no model, no data, no torch: `hf-fedtask run` answers them
    within a second, `hf_fedtask.engine.preflight`): `strategy` by name, whether it declares client-level DP
    (`supported`) and whether its uploads are securely aggregated (`secure`)."""
    if not dp_requested(config):
        given = [name for name in DP_OPTIONS if _non_default(config, name)]
        if given:
            raise ConfigError(f"{given[0]}: client-level DP needs dp_clip as well (the L2 norm C each client's "
                              "whole upload is clipped to)")
        return
    if not supported:
        why = UNSUPPORTED.get(strategy, GENERIC)
        raise ConfigError(f"dp_clip: strategy {strategy!r} does not support client-level DP: {why}")
    sigma, target = config.dp_noise_multiplier, config.dp_epsilon
    if sigma is None and target is None:
        raise ConfigError("dp_clip: give dp_noise_multiplier (σ; ε is reported) or dp_epsilon (a target ε; σ is "
                          "calibrated) as well")
    if sigma is not None and target is not None:
        raise ConfigError(f"dp_epsilon: {target} and dp_noise_multiplier: {sigma} exclude each other: give one")
    if not 0 < config.dp_delta < 1:
        raise ConfigError(f"dp_delta: must be in (0, 1), got {config.dp_delta!r}")
    if config.dp_noise == "clients" and not secure:
        raise ConfigError(f"dp_noise: clients needs secure aggregation, which strategy {strategy!r} does not use "
                          "here: without it the server sees each upload with its own share N(0, σ²C²/h) of the "
                          "noise only; use dp_noise server, or fedyolo with secure_aggregation")


def resolve_privacy(config, strategy, population: int, sample: int) -> PrivacySettings | None:
    """The run's `PrivacySettings` (None when DP is off), or a one-line ConfigError naming the offending option."""
    check_options(config, strategy.name, strategy.capabilities.client_dp, strategy.capabilities.secure_aggregation)
    if not dp_requested(config):
        return None
    if sample >= population and population == 1:
        raise ConfigError("dp_clip: client-level DP over a single client protects nothing: use more clients")
    strategy.check_private(config)
    sigma, target = config.dp_noise_multiplier, config.dp_epsilon
    if target is not None:
        from hf_fedtask.privacy.accountant import calibrate

        try:
            sigma = calibrate(population, sample, config.rounds, target, config.dp_delta)
        except Exception as e:  # dp-accounting's bracket search fails for targets no σ in range reaches
            raise ConfigError(f"dp_epsilon: cannot calibrate σ for ε = {target} at δ = {config.dp_delta} over "
                              f"{config.rounds} rounds ({type(e).__name__}: {e})") from None
    return PrivacySettings(clip=config.dp_clip, noise_multiplier=float(sigma), delta=config.dp_delta,
                           noise=config.dp_noise, noise_seed=config.dp_noise_seed, population=population,
                           sample=sample, rounds=config.rounds, target_epsilon=target)


def _non_default(config, name: str) -> bool:
    value = getattr(config, name, None)
    return value not in (None, "server") and not (name == "dp_delta" and value == DEFAULT_DELTA)


def json_epsilon(value: float) -> float | None:
    """ε for JSON files: None stands for ∞ (no noise)."""
    return None if math.isinf(value) else value
