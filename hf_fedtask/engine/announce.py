"""What `hf-fedtask run` says around a run, so that a setting the user asked for is seen to be on.

At the start, a few lines: the strategy and its options, the clients and how many take part each round,
the model, device, precision (bf16 on a CPU: native or emulated), processes and torch threads, and the
client-level DP settings. At the end, beside the results table (`hf_fedtask.report.run_report`): the
generation exact match and the privacy spent (ε at δ), read from the results (results.json's entries).
Plain ASCII (epsilon, sigma), since a console may not encode Greek letters.
"""

from __future__ import annotations

import math

from hf_fedtask.config import RunConfig
from hf_fedtask.data.builtin_tasks import SUITES


def _g(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def privacy_settings_line(config: RunConfig, privacy=None) -> str | None:
    """The client-level DP the run asked for, in one line (None when DP is off). `privacy`: the run's
    resolved settings (`Server.privacy`: σ calibrated where a target ε was given), read defensively."""
    if config.dp_clip is None:
        return None
    sigma = getattr(privacy, "noise_multiplier", config.dp_noise_multiplier)
    if config.dp_epsilon is not None:
        noise = f"target epsilon = {_g(config.dp_epsilon)}" + (f", calibrated noise multiplier sigma = {sigma:.4g}"
                                                               if isinstance(sigma, (int, float)) else "")
    else:
        noise = f"noise multiplier sigma = {_g(sigma)}"
        try:
            planned = privacy.epsilon(config.rounds) if privacy is not None else None
        except Exception:  # noqa: BLE001  (an estimate for the start line; results.json reports what was spent)
            planned = None
        if isinstance(planned, (int, float)) and math.isfinite(planned):
            noise += f" (epsilon = {planned:.3g} after {config.rounds} rounds)"
    seed = "; noise seed given: reproducible, not private" if config.dp_noise_seed is not None else ""
    return (f"privacy: client-level DP, clip C = {_g(config.dp_clip)}, {noise}, delta = {_g(config.dp_delta)}, "
            f"noise drawn on the {config.dp_noise}{seed}")


def start_lines(config: RunConfig, *, device: str, precision: str, processes: int, threads: str,
                privacy=None) -> list[str]:
    """The settings of a run as it starts: strategy, clients, model, where and how it computes, DP."""
    tasks = config.tasks or SUITES[config.suite]
    which = f"{len(tasks)} tasks of {config.suite}" if not config.tasks else f"{len(tasks)} tasks"
    clients = config.client_count
    eligible = clients - len(set(config.exclude_clients))
    per_round = min(eligible, max(1, math.ceil(config.participation * clients - 1e-9)))
    lines = [f"run: {config.strategy} on {which}, {clients} clients, {per_round} per round (participation "
             f"{_g(config.participation)}), {config.rounds} rounds -> {config.output_dir}"]
    if config.strategy_options:
        lines.append("strategy options: " + ", ".join(f"{k} = {_g(v)}" for k, v in config.strategy_options.items()))
    peft = f"{config.peft_method} r = {config.lora_r}" if config.peft_method == "lora" else config.peft_method
    lines.append(f"model: {config.base_model} ({peft}); device {device}; precision {precision}; "
                 f"{processes} process{'es' if processes > 1 else ''}; torch threads {threads}")
    line = privacy_settings_line(config, privacy)
    if line:
        lines.append(line)
    return lines


def announce_start(env, server, threads: str) -> str:
    """`start_lines` of a run whose checks passed (`run(..., on_start=...)`): its host's device and
    precision, the launch's processes, the resolved DP settings."""
    from hf_fedtask.model.device import launch, precision_in_words

    device = env.host.device
    return "\n".join(start_lines(env.config, device=str(device),
                                 precision=precision_in_words(env.config.mixed_precision, device),
                                 processes=launch().world_size, threads=threads, privacy=server.privacy))


def end_lines(results: dict) -> list[str]:
    """The headline results the table does not show: generation exact match or ROUGE-L (per task and mean) and the
    privacy spent. Read defensively: a key a run does not have is left out."""
    lines = []
    for key, name in (("exact_match", "exact match"), ("rougeL", "ROUGE-L")):
        if f"mean_{key}" in results:
            per_task = ", ".join(f"{task} {r[key]:.4f}" for task, r in results.get("tasks", {}).items()
                                 if isinstance(r.get(key), (int, float)))
            lines.append(f"generation {name}: mean {results[f'mean_{key}']:.4f}"
                         + (f" ({per_task})" if per_task else ""))
    privacy = results.get("privacy")
    if isinstance(privacy, dict) and "epsilon" in privacy:
        epsilon = privacy["epsilon"]
        spent = "infinite (no noise)" if epsilon is None else f"{epsilon:.3g}"
        delta = f" at delta = {_g(privacy['delta'])}" if privacy.get("delta") is not None else ""
        rounds = f" after {privacy['rounds']} rounds" if privacy.get("rounds") is not None else ""
        details = [f"{k} = {_g(privacy[v])}" for k, v in (("sigma", "noise_multiplier"), ("clip C", "clip"))
                   if privacy.get(v) is not None]
        lines.append(f"privacy spent: epsilon = {spent}{delta}{rounds} (client-level"
                     + (f"; {', '.join(details)}" if details else "") + ")")
    return lines
