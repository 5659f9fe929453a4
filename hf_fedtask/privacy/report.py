"""How a finished run reports the privacy it spent: results.json's `privacy` entry (from the settings and the
rounds' records) and the model card's "Differential privacy" section (from that entry)."""

from __future__ import annotations

import numpy as np

from hf_fedtask.privacy.settings import PrivacySettings

ADJACENCY = ("client-level (user-level): neighbouring federations differ in one client's whole data, replaced "
             "(the number of clients is public)")


def privacy_results(settings: PrivacySettings | None, history: list[dict]) -> dict:
    """`{"privacy": ...}` for results.json ({} when DP is off): ε after the last round (None: ∞, no noise), the
    mechanism, the sampling and the accountant."""
    records = [h["privacy"] for h in history if "privacy" in h]
    if settings is None or not records:
        return {}
    clipped = [r["clipped_fraction"] for r in records if r.get("clipped_fraction") is not None]
    return {"privacy": {"epsilon": records[-1]["epsilon"], **settings.describe(), "rounds": len(records),
                        "adjacency": ADJACENCY,
                        "mean_clipped_fraction": float(np.mean(clipped)) if clipped else None}}


def card_rows(privacy: dict) -> list[tuple[str, str]]:
    """The model card's DP table from results.json's `privacy` entry."""
    eps = privacy["epsilon"]
    return [("Guarantee", f"(ε = {'∞' if eps is None else f'{eps:.3g}'}, δ = {privacy['delta']:g}) after "
                          f"{privacy['rounds']} rounds"),
            ("Adjacency", privacy["adjacency"]),
            ("Clipping", f"each client's whole upload to L2 norm C = {privacy['clip']:g}"),
            ("Noise", f"Gaussian, std σ·C on every aggregated sum, σ = {privacy['noise_multiplier']:.4g} "
                      f"(drawn on the {privacy['noise']}; seed: {privacy['noise_seed']})"
                      + (f", calibrated to target ε = {privacy['target_epsilon']:g}"
                         if privacy.get("target_epsilon") else "")),
            ("Sampling", privacy["sampling"]),
            ("Accountant", privacy["accountant"])]
