"""`hf-fedtask --help` is quick and complete. The CLI, `RunConfig` and the strategies' configs import no
torch, transformers, datasets or peft; the strategies themselves load on first use, all together; every
flag and positional of every subcommand has help text.

Start-up is checked by which modules a fresh interpreter has loaded, not by timing it: the result does
not depend on the machine's load. README, "Command line", gives the measured time."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from hf_fedtask.cli import build_parser
from hf_fedtask.errors import ConfigError

HEAVY = ("torch", "transformers", "datasets", "peft", "accelerate", "numba")

# runs in a fresh interpreter: builds the parser, asks every command for --help, checks configs (good
# and bad), and reports what got imported; then reads the strategy registry, which must import them all
_PROBE = textwrap.dedent("""
    import contextlib, io, json, sys

    HEAVY = {heavy!r}

    def loaded():
        return sorted(m for m in HEAVY if m in sys.modules)

    from hf_fedtask.cli import build_parser

    parser = build_parser()
    helps = {{}}
    for argv in ({commands!r}):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                parser.parse_args([*argv, "--help"])
            except SystemExit:
                pass
        helps[" ".join(argv)] = out.getvalue()

    from hf_fedtask.config import RunConfig, config_from_args
    from hf_fedtask.errors import ConfigError

    config = RunConfig.from_dict({{"strategy": "matu", "rho": 0.3, "rounds": 2}})
    flags = config_from_args(parser.parse_args(["run", "--strategy", "fedprox", "--proximal-mu", "0.1"]))
    errors = []
    for bad in ({{"strategy": "fedavg", "rho": 0.3}}, {{"strategy": "nope"}}, {{"strategy": "matu", "rho": 2}}):
        try:
            RunConfig.from_dict(bad)
        except ConfigError as e:
            errors.append(str(e))
    light = loaded()

    from hf_fedtask.strategies import STRATEGIES

    print(json.dumps({{"light": light, "helps": helps, "rho": config.strategy_config.rho,
                      "mu": flags.strategy_config.proximal_mu, "errors": errors,
                      "strategies": sorted(STRATEGIES), "tct": STRATEGIES["tct"].__name__, "heavy": loaded()}}))
""")


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of `parser`: (), ("run",), ("flower", "run"), ..."""
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*path, name))
    return out


def test_help_and_config_checks_import_no_heavy_module():
    """In a fresh interpreter, building the parser, `--help` of every command and validating configs (strategy
    options included) leave torch, transformers, datasets and peft unimported. Reading `STRATEGIES` afterwards
    imports them (so the check sees imports) and returns every strategy."""
    commands = _commands(build_parser())
    assert ("run",) in commands and ("flower", "run") in commands and ("suite", "export") in commands
    probe = _PROBE.format(heavy=HEAVY, commands=tuple(commands))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])

    assert report["light"] == [], f"imported by the CLI's parser, --help or config checks: {report['light']}"
    helps = report["helps"]
    assert set(helps) == {" ".join(c) for c in commands}
    assert "--rho" in helps["run"] and "--proximal-mu" in helps["flower run"]  # strategy options listed
    assert all(text.startswith("usage: hf-fedtask") for text in helps.values())
    assert report["rho"] == 0.3 and report["mu"] == 0.1
    assert report["errors"] == [
        "strategy 'fedavg' does not support option 'rho' (an option of matu); its options: server_lr, forget_tasks, "
        "forget_clients, track_task_vectors, lora_aggregation",
        "unknown strategy 'nope'; choose one of f2l2, fedavg, fedper, fedprox, fedyolo, matfl, matu, ntkfedavg, "
        "ntkfedprox, scaffold, tct",
        "config: strategy options: rho: must be in [0, 1], got 2.0",
    ]
    assert "torch" in report["heavy"]  # the strategies import torch: the check does see imports
    assert report["strategies"] == ["f2l2", "fedavg", "fedper", "fedprox", "fedyolo", "matfl", "matu", "ntkfedavg",
                                    "ntkfedprox", "scaffold", "tct"]
    assert report["tct"] == "TCT"


def _arguments(parser: argparse.ArgumentParser, path: str = "hf-fedtask"):
    """(where, name, help) for every subcommand and every argument of every (sub)parser but -h."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}  # the subcommands' own help
            for name, sub in action.choices.items():
                yield path, name, helps.get(name)
                yield from _arguments(sub, f"{path} {name}")
        else:
            yield path, "/".join(action.option_strings) or action.dest, action.help


def test_every_command_flag_and_positional_has_help():
    """Walks every subparser of the CLI: each subcommand, flag and positional (but -h) has help text."""
    found = list(_arguments(build_parser()))
    names = {(where, name) for where, name, _ in found}
    assert {("hf-fedtask", "run"), ("hf-fedtask run", "--rho"), ("hf-fedtask inspect", "file"),
            ("hf-fedtask suite export", "name"), ("hf-fedtask flower run", "--overwrite"),
            ("hf-fedtask merge", "--dare-variant")} <= names  # the walk reaches nested parsers and both kinds
    missing = [f"{where}: {name}" for where, name, text in found
               if not text or not text.strip() or text == argparse.SUPPRESS]
    assert not missing, "no help text:\n" + "\n".join(missing)


def test_light_registry_declares_what_the_strategies_register():
    """`BUILTIN_STRATEGIES` (what configs and the CLI read without importing the strategies) names each
    builtin's module and the config class it registers with; registering another config class for a
    builtin name is refused."""
    from hf_fedtask.strategies import STRATEGIES, FedAvg, MaTUConfig
    from hf_fedtask.strategies.registry import BUILTIN_STRATEGIES, register_strategy, strategy_configs

    assert set(BUILTIN_STRATEGIES) <= set(STRATEGIES)
    for name, (module, config_class) in BUILTIN_STRATEGIES.items():
        assert STRATEGIES[name].config_class is config_class, name
        assert STRATEGIES[name].__module__ == f"hf_fedtask.strategies.{module}", name
    assert strategy_configs() == {name: cls.config_class for name, cls in STRATEGIES.items()}

    class Impostor(FedAvg):
        config_class = MaTUConfig

    with pytest.raises(TypeError, match="declares FedAvgLoRAConfig for 'fedavg'"):
        register_strategy(Impostor)
    assert STRATEGIES["fedavg"] is FedAvg


def test_unknown_strategy_is_the_same_error_with_or_without_the_strategies():
    """The light lookup (`strategy_config_class`) and `strategy_class` refuse an unknown name alike."""
    from hf_fedtask.strategies import strategy_class
    from hf_fedtask.strategies.registry import strategy_config_class

    messages = []
    for lookup in (strategy_config_class, strategy_class):
        with pytest.raises(ConfigError) as e:
            lookup("fedsgd")
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith("unknown strategy 'fedsgd'; choose one of f2l2")
