"""`hf-fedtask --help` is quick and complete. The CLI, `RunConfig` and the strategies' configs import no
torch, transformers, datasets or peft; the strategies themselves load on first use, all together; every
flag and positional of every subcommand has help text.

Start-up is checked by which modules a fresh interpreter has loaded, not by timing it: the result does
not depend on the machine's load. docs/results/benchmarks.md, "The CLI's start-up", gives the measured time."""

from __future__ import annotations

import argparse
import json
import os
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
        "forget_clients, track_task_vectors, lora_aggregation, lora_ranks",
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


# runs in a fresh interpreter: each argv through `hf_fedtask.cli.main`, its exit code, stderr, and whether torch or
# transformers had been imported when the refusal was printed
_REFUSALS_PROBE = textwrap.dedent("""
    import contextlib, io, json, sys

    from hf_fedtask.cli import main

    report = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's own errors
                code = e.code
        report.append({{"argv": argv, "code": code, "err": err.getvalue(),
                        "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}})
    print(json.dumps(report))
""")


def test_refusals_that_need_no_model_answer_before_torch_is_imported(tmp_path):
    """Typos in flags, wrong types, missing values, an unusable run folder and an unloadable base model each end
    with one line on stderr and exit 2 before torch or transformers is imported (they used to take 7-22 s: the
    engine was imported before the config was checked), and leave the working folder as it was."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    out = str(tmp_path / "out")
    cases = [  # argv, what the one line must say
        (["run", "--rounds", "-1"], "rounds: must be >= 1, got -1"),
        (["run", "--strategy", "fedsgd"], "unknown strategy 'fedsgd'"),
        (["run", "--participation", "2"], "participation: must be in (0.0, 1.0], got 2.0"),
        (["run", "--dp-delta", "1"], "dp_delta: must be in (0.0, 1.0), got 1.0"),
        (["run", "--stratgy", "fedavg"], "unrecognized arguments: --stratgy fedavg (did you mean --strategy?)"),
        (["run", "--rounds", "abc"], "argument --rounds: invalid int value: 'abc'"),
        (["run", "--participation", "x"], "argument --participation: invalid float value: 'x'"),
        (["run", "--rounds"], "argument --rounds: expected one argument"),
        (["run", "--threads", "0"], "argument --threads: expected a number of threads >= 1, got '0'"),
        (["rn"], "invalid choice: 'rn'"),
        (["run", "--base-model", "./no_such_folder"], "--base-model ./no_such_folder: no such folder"),
        (["run", "--base-model", "sentence-transformers/all-MiniLM-L6-v3"],
         "--base-model sentence-transformers/all-MiniLM-L6-v3: not in the Hub cache and HF_HUB_OFFLINE=1"),
        (["run", "--tasks", "./no_such_data"], "--tasks ./no_such_data: no such folder or file"),
        (["run", "--num-clients", "2"], "2 clients cannot cover the 8 tasks"),
        (["run", "--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["run", "--output-dir", str(a_file)], "exists and is not a directory"),
        (["run", "--output-dir", str(a_file / "sub")], f"{a_file} is a file, not a folder"),
        (["unlearn", str(tmp_path / "no_run"), "--task", "x", "--rounds", "1"], "not a finished hf_fedtask run"),
        (["unlearn", str(tmp_path / "no_run"), "--task", "x"], "federated unlearning needs --rounds R"),
        (["export", str(tmp_path / "no_run")], "not a finished hf_fedtask run"),
        (["run", "--dp-clip", "1"], "dp_clip: give dp_noise_multiplier"),
        (["run", "--dp-noise-multiplier", "1"], "dp_noise_multiplier: client-level DP needs dp_clip as well"),
        (["run", "--strategy", "matfl", "--dp-clip", "1", "--dp-epsilon", "4"], "does not support client-level DP"),
        (["run", "--dp-clip", "1", "--dp-epsilon", "4", "--dp-noise", "clients"], "clients needs secure aggregation"),
        (["run", "--report-to", "tensorbored"], "report_to: 'tensorbored' is no Accelerate tracker"),
        (["run", "--report-to", "swanlab"], "the swanlab tracker's package is not installed here"),
    ]
    if sys.platform == "linux":  # no folder can be made under /proc, even by root (whose os.access says yes)
        cases.append((["run", "--output-dir", "/proc/hf-fedtask-x"], "no folder can be made in /proc"))
    argvs = [argv if argv[0] != "run" or "--output-dir" in argv else [*argv, "--output-dir", out]
             for argv, _ in cases]
    before = sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run([sys.executable, "-c", _REFUSALS_PROBE.format(heavy=HEAVY), json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    for (argv, says), got in zip(cases, report, strict=True):
        lines = got["err"].strip().splitlines()
        assert got["code"] == 2 and len(lines) == 1 and "error" in lines[0], (argv, got)
        assert says in lines[0], (argv, lines[0])
        assert "torch" not in got["heavy"] and "transformers" not in got["heavy"], (argv, got["heavy"])
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made, not even runs/default


def test_run_help_shows_each_options_default():
    """`run --help` names the defaults a quick-tour line without the flag gets (they collided in runs/default)."""
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["run"].format_help().split())
    for says in ("(default: fedavg)", "(default: builtin-8)", "communication rounds (>= 1) (default: 3)",
                 "(default: runs/default)", "(default: sentence-transformers/all-MiniLM-L6-v2)",
                 "exports) when the run ends (default: true)", "[fedprox, ntkfedprox] (>= 0) (default: 0.01)"):
        assert says in help_text, says


def test_the_trackers_checked_before_torch_are_accelerates():
    """`report_to` is checked from `TRACKER_PACKAGES` without importing Accelerate: its names are Accelerate's
    trackers, and a tracker counts as installed exactly when Accelerate finds it available."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    from hf_fedtask.core.names import TRACKER_PACKAGES
    from hf_fedtask.engine.preflight import check_trackers
    from hf_fedtask.errors import ConfigError

    assert sorted(TRACKER_PACKAGES) == sorted(t for t in LoggerType.list() if t != "all")
    available = {str(t.value if hasattr(t, "value") else t) for t in get_available_trackers()}
    for name in TRACKER_PACKAGES:
        try:
            check_trackers([name])
            ours = True
        except ConfigError:
            ours = False
        assert ours == (name in available), name
