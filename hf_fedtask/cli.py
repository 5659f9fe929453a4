"""`hf-fedtask`: run, inspect, export, evaluate, push, suite export, merge, unlearn, flower.

Every failure on bad input is one line on stderr and a non-zero exit; nothing on disk is replaced.
Nothing heavy (torch, datasets, transformers, peft) is imported at module level: each command imports
what it needs inside its function, so `--help` is quick (`tests/test_cli_startup.py`)."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field

from hf_fedtask.config import add_config_arguments, config_from_args
from hf_fedtask.data.builtin_tasks import SUITES
from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.strategies.configs import GRADIENT_FORMS, HESSIANS


def _run(args) -> int:
    from hf_fedtask.engine.preflight import preflight

    config = config_from_args(args)
    # what needs no model, data or torch is refused before the engine's imports (seconds): a typo answers at once
    preflight(config, resume=args.resume, overwrite=args.overwrite)
    from hf_fedtask.engine.announce import announce_start, end_lines
    from hf_fedtask.engine.run import run
    from hf_fedtask.model.device import launch
    from hf_fedtask.report import run_report

    threads = _set_threads(args.threads)
    results = run(config, resume=args.resume, overwrite=args.overwrite,
                  on_start=lambda env, server: print(announce_start(env, server, threads), flush=True))
    if launch().rank == 0:  # under a multi-process launch the other ranks only trained
        print("\n".join([run_report(config, results), *end_lines(results)]))
    return 0


def _set_threads(requested: int | None) -> str:
    """torch's CPU threads as the recipes set them (`hf_fedtask.workflows.recipe.set_threads`: --threads,
    else OMP_NUM_THREADS, else every core this process may use), and where the number came from."""
    from hf_fedtask.workflows.recipe import set_threads

    return set_threads(requested)


def _threads(value: str) -> int:
    """`--threads`: a count of at least 1 (argparse's one-line error otherwise, before torch is imported)."""
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a number of threads >= 1, got {value!r}")
    return count


THREADS_HELP = ("torch CPU threads of this process (default: OMP_NUM_THREADS when set, else every core this process "
                "may use, shared among a launch's processes on this machine, as the recipes do); on a busy machine "
                "fewer threads, even 1, can be several times faster")


def _flower_run(args) -> int:
    from hf_fedtask.engine.flower.launch import launch

    config = config_from_args(args)
    federation = {}
    for item in args.federation_config or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--federation-config {item!r}: expected KEY=VALUE, e.g. num-supernodes=4")
        federation[key] = _typed(value)
    run_id = launch(config, args.connection, app_dir=args.app_dir, resume=args.resume, overwrite=args.overwrite,
                    timeout=args.timeout, wait=args.wait, federation_config=federation or None)
    print(f"Flower run {run_id} finished; results in {config.output_dir}")
    return 0


def _typed(value: str) -> bool | int | float | str:
    """A `--federation-config` value as TOML would type it: client-resources-num-gpus=0.25 is a number."""
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _flower_worker(args) -> int:
    from hf_fedtask.engine.flower.worker import serve

    serve(args.socket, threads=args.threads, authkey_file=args.authkey_file, request_timeout=args.request_timeout,
          max_frame=int(args.max_frame_gib * (1 << 30)))
    return 0


def _flower_credentials(args) -> int:
    from hf_fedtask.engine.flower import credentials

    return credentials.main(args)


def _flower_app(args) -> int:
    from hf_fedtask.engine.flower.manifest import write_app_dir

    print(write_app_dir(args.folder))
    return 0


@dataclass(frozen=True)
class _UnlearnMode:
    """One way `hf-fedtask unlearn` removes something. The flag checks, their error lines and the call
    of the workflow are all made from these declarations (`_UNLEARN_MODES`)."""

    label: str  # how error lines name the mode
    method: str  # the --method value that picks it
    targets: tuple[str, ...]  # what it removes: --task, --client, or either (passed as task=, client=)
    workflow: str  # the function of hf_fedtask.workflows.unlearn that does it
    flags: dict[str, str] = field(default_factory=dict)  # further flags it takes -> keyword of `workflow`
    required: tuple[str, ...] = ()  # of `flags`, those it cannot run without
    selector: str | None = None  # a flag that picks it among the modes of the same --method
    fixed: dict[str, str] = field(default_factory=dict)  # keywords of `workflow` it always passes
    note: str = ""  # why the other modes' flags do not apply here (appended to their error lines)

    def takes(self, flag: str) -> bool:
        return flag in self.targets or flag in self.options

    @property
    def options(self) -> tuple[str, ...]:
        """The flags it takes besides its targets."""
        return (self.selector, *self.flags) if self.selector else tuple(self.flags)


_UNLEARN_MODES = (
    _UnlearnMode(label="federated unlearning", method="negate", targets=("--task", "--client"), workflow="unlearn",
                 flags={"--rounds": "rounds", "--resume": "resume"}, required=("--rounds",)),
    _UnlearnMode(label="--one-shot", method="negate", selector="--one-shot", targets=("--task",),
                 workflow="negate_task", flags={"--scale": "scale", "--task-vector": "task_vector"},
                 note=" (one subtraction of the task's vector: no rounds, nothing to resume)"),
    _UnlearnMode(label="--method f2l2", method="f2l2", targets=("--client",), workflow="remove_client",
                 fixed={"method": "f2l2"}, flags={"--rho": "rho", "--l2": "l2", "--gradient": "gradient",
                                                  "--cg-iterations": "iterations", "--cg-tolerance": "tolerance",
                                                  "--trust-radius": "trust_radius", "--hessian": "hessian"},
                 note=" (one Newton step on the server: no rounds)"),
    _UnlearnMode(label="--method sga", method="sga", targets=("--client",), workflow="remove_client",
                 fixed={"method": "sga"}, flags={"--sga-epochs": "sga_epochs", "--sga-lr": "sga_lr"},
                 note=" (one step of gradient ascent on the client: no rounds)"),
)
_UNLEARN_METHODS = tuple(dict.fromkeys(m.method for m in _UNLEARN_MODES))
_UNLEARN_FLAGS = tuple(dict.fromkeys(flag for m in _UNLEARN_MODES for flag in m.options))
_METAVARS = {"--task": "T", "--client": "K", "--rounds": "R"}
_TARGET_NOUNS = {"--task": "a task", "--client": "a client"}


def _flag_value(args, flag: str):
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


def _given(args, flag: str) -> bool:
    value = _flag_value(args, flag)
    return value is not None and value is not False  # identity: --client 0 and --scale 0 are given


def _for(flag: str) -> str:
    """The modes that take `flag`, as error lines name them."""
    labels = [m.label for m in _UNLEARN_MODES if m.takes(flag)]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} or {labels[-1]}"


def _unlearn_mode(args) -> _UnlearnMode:
    """The mode the flags ask for, once they are checked against it (ConfigError, one line, otherwise)."""
    if _given(args, "--task") and _given(args, "--client"):
        raise ConfigError("unlearn: give --task or --client, not both")
    if not _given(args, "--task") and not _given(args, "--client"):
        raise ConfigError("unlearn: give --task T or --client K")
    candidates = [m for m in _UNLEARN_MODES if m.method == args.method]
    mode = next((m for m in candidates if m.selector and _given(args, m.selector)),
                next(m for m in candidates if not m.selector))
    for target in _TARGET_NOUNS:
        if _given(args, target) and target not in mode.targets:
            wanted = mode.targets[0]
            raise ConfigError(f"unlearn: {mode.label} removes {_TARGET_NOUNS[wanted]}: give {wanted} "
                              f"{_METAVARS[wanted]}, not {target} ({target} is for {_for(target)})")
    for flag in _UNLEARN_FLAGS:
        if _given(args, flag) and not mode.takes(flag):
            used_by = _for(flag)
            raise ConfigError(f"unlearn: {flag} does not apply to {mode.label}{mode.note}"
                              + ("" if used_by == flag else f"; it is for {used_by}"))
    for flag in mode.required:
        if not _given(args, flag):
            others = ", ".join(m.label for m in _UNLEARN_MODES if m is not mode)
            raise ConfigError(f"unlearn: {mode.label} needs {flag} {_METAVARS[flag]} "
                              f"(or unlearn another way: {others})")
    return mode


def _unlearn(args) -> int:
    from hf_fedtask.engine.preflight import check_finished_run

    mode = _unlearn_mode(args)  # flags and the run folder are checked before the engine's imports (seconds)
    check_finished_run(args.run_dir)
    from pathlib import Path

    from hf_fedtask.report import ADAPTERS_DIR, unlearning_report, where_lines
    from hf_fedtask.workflows import unlearn as workflows

    _set_threads(args.threads)
    targets = {flag.removeprefix("--"): _flag_value(args, flag) for flag in mode.targets}
    options = {keyword: _flag_value(args, flag) for flag, keyword in mode.flags.items() if _given(args, flag)}
    results = getattr(workflows, mode.workflow)(args.run_dir, **targets, **mode.fixed, **options,
                                                 output_dir=args.output_dir, overwrite=args.overwrite)
    out = Path(results["config"]["output_dir"])  # where the result went (the default is named after the run)
    print("\n".join([unlearning_report(results), "",
                     *where_lines(out, results, export=(out / ADAPTERS_DIR).is_dir())]))
    return 0


def _inspect(args) -> int:
    from hf_fedtask.core.taskvector_file import inspect_file

    print(inspect_file(args.file))
    return 0


def _export(args) -> int:
    from hf_fedtask.engine.preflight import check_finished_run

    check_finished_run(args.run_dir, results=True)  # before the engine's imports (seconds)
    from hf_fedtask.workflows.export_run import export_run

    for path in export_run(args.run_dir):
        print(path)
    return 0


_TASK_FLAGS = ("--task", "--split", "--max-length", "--max-test-samples")  # hf_fedtask's own scoring of a task
_LM_EVAL_FLAGS = ("--lm-eval-include", "--limit", "--num-fewshot", "--apply-chat-template")  # lm-eval's options


def _evaluate(args) -> int:
    lm_eval = args.lm_eval is not None
    for flag in _TASK_FLAGS if lm_eval else _LM_EVAL_FLAGS:
        if _given(args, flag):
            raise ConfigError(f"evaluate: {flag} does not apply " + (
                "with --lm-eval (lm-evaluation-harness scores its own tasks)" if lm_eval
                else "without --lm-eval (it is an lm-evaluation-harness option)"))
    if lm_eval:
        return _evaluate_lm_eval(args)
    from hf_fedtask.export.standalone import evaluate_adapter

    print(json.dumps(evaluate_adapter(args.adapter_dir, args.task, split=args.split or "test",
                                      max_length=args.max_length, max_test_samples=args.max_test_samples,
                                      base_model=args.base_model,
                                      batch_size=128 if args.batch_size is None else args.batch_size)))
    return 0


def _evaluate_lm_eval(args) -> int:
    from pathlib import Path

    from hf_fedtask.export.adapter import LM_EVAL_FILE
    from hf_fedtask.workflows.lm_harness import run_lm_eval

    results = run_lm_eval(args.adapter_dir, args.lm_eval.split(","), include=args.lm_eval_include or (),
                          limit=args.limit, num_fewshot=args.num_fewshot,
                          batch_size=8 if args.batch_size is None else args.batch_size,
                          apply_chat_template=args.apply_chat_template, base_model=args.base_model)
    from lm_eval.utils import make_table

    folder = Path(args.adapter_dir)
    print("\n".join([make_table(results), *([make_table(results, "groups")] if results.get("groups") else [])]))
    print(f"lm-eval results: {folder / LM_EVAL_FILE}")
    if (folder / "README.md").is_file():
        print(f"model card: {folder / 'README.md'} (section lm-evaluation-harness)")
    return 0


def _limit(value: str) -> int | float:
    """`--limit`: lm-eval's, examples a task: a count >= 1, or a fraction of each task in (0, 1)."""
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if number >= 1 and number == int(number):
        return int(number)
    if not 0 < number < 1:
        raise argparse.ArgumentTypeError(f"expected a count of examples >= 1 or a fraction in (0, 1), got {value!r}")
    return number


def _count_or_all(value: str) -> int:
    """`--max-test-samples`: a count, or 0 / "all" for the whole split (0)."""
    if value.strip().lower() == "all":
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected a count of examples or 'all', got {value!r}")
    return count


def _push(args) -> int:
    from hf_fedtask.export.hub import push_to_hub

    url = push_to_hub(args.folder, args.repo_id, token=args.token, private=args.private, endpoint=args.endpoint)
    print(url)
    return 0


def _cache_backbone(args) -> int:
    from hf_fedtask.model.hub_cache import UPSTREAM_REPO, place_embedded_backbone

    placement = place_embedded_backbone(args.cache_dir)
    kept = "" if placement.added else " (already there; nothing changed)"
    print(f"{UPSTREAM_REPO}: {placement.snapshot}{kept}")
    return 0


def _suite_export(args) -> int:
    from hf_fedtask.data import export_suite

    for path in export_suite(args.name, args.out_dir, seed=args.seed):
        print(path)
    return 0


def _merge(args) -> int:
    from hf_fedtask.errors import ConfigError
    from hf_fedtask.workflows.merge_adapters import merge_inputs

    weights = None
    if args.weights is not None:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise ConfigError(f"--weights {args.weights!r}: expected comma-separated numbers, one per input") from None
    out = merge_inputs(args.inputs, args.method, out=args.output, weights=weights, density=args.density,
                       majority_sign=args.majority_sign, scope=args.scope, seed=args.seed,
                       dare_variant=args.dare_variant, rescaler=args.rescaler, base_adapter=args.base_adapter,
                       head_from=args.head_from, no_head=args.no_head, overwrite=args.overwrite)
    if args.method == "unify":
        from hf_fedtask.export.compact import storage_report

        report = storage_report(out)
        print(f"compact export: {report['compact_bytes']} bytes vs {report['separate_bytes']} bytes for "
              f"{report['tasks']} separate adapters (ratio {report['ratio']:.3f})")
    print(out)
    return 0


MERGE_HELP = """\
Task vectors are the inputs' saved PEFT tensors minus --base-adapter's (the shared PEFT init), or
minus zero when it is not given: the raw tensors are then merged, as peft's add_weighted_adapter
("linear", "ties", "dare_*") does; for LoRA, A and B are merged separately, so the merged B·A has
cross terms. The output keeps the first input's adapter_config.json.

Heads (modules_to_save) are merged only when they classify into one label set (same label names, as
an exported adapter's classifier/config.json records them, and same size). Heads of unrelated label
sets are refused unless --head-from INPUT keeps that input's head unchanged (as mergekit's
tokenizer_source picks one model's vocabulary) or --no-head writes the shared modules only. The output
loads like an exported adapter: it carries the tokenizer and classifier/config.json of the input whose
head it keeps (the first input's when heads are merged) and hf_fedtask.json with the label names.
unify keeps one head per input and writes the compact export (hf_fedtask.load_task_adapter, label names
in tasks.json) plus each input's adapter, tokenizer and classifier config under OUT/<name>/."""


EVALUATE_HELP = """\
Score an exported adapter on a task with stock PEFT + transformers, as a user without hf_fedtask's
training code would load it. What is not given is taken from the adapter folder (hf_fedtask.json,
classifier/config.json) or the run folder it sits in: the task it was trained on, the run's max_length,
the seeded test subset its card's metric was computed on (max_test_samples), the base model. A line on
stderr says which examples are scored; a progress bar shows on passes longer than a few seconds. A task
whose labels (count or names) or inputs (text, image) are not the adapter's, or a base model other than
the one it was trained on, is refused in one line naming both, exit 2.

--lm-eval TASKS scores a causal LM's adapter with lm-evaluation-harness instead (pip install
"hf-fedtask[lm-eval]"): HFLM(pretrained=<its base, found as above>, peft=ADAPTER_DIR) on lm-eval's tasks
or those of --lm-eval-include; lm-eval's output goes to ADAPTER_DIR/lm_eval.json and a table of the
scores into the adapter's README.md card (both replaced by the next --lm-eval call)."""


UNLEARN_HELP = """Remove a task or a client from a finished run; the run itself is left as it is.

Federated (--rounds R): the run continues for R rounds in which the updates of the clients that hold
the task are negated before aggregation (NTKFedAvg, Alg. 1 lines 8-9); the others train as before.
It is written, checkpointed (--resume), plotted (unlearning.png) and exported like any run.
One-shot (--one-shot): θ' = θ − scale·τ_task on the merged model, τ_task being the task's share of
the run's updates (runs with track_task_vectors: true) or --task-vector.
Server-side (--client K --method f2l2, runs of strategy f2l2): one Newton step w − (H_s + λI)⁻¹·g on
the server's own data, solved by conjugate gradient; no client is contacted. --method sga is the
baseline: the client ascends its own data's loss. All print the metrics before and after, and the
exported cards say what was removed and how."""


FLOWER_HELP = """\
Run any strategy on a Flower federation: the same round loop, byte accounting, validation, metrics
and checkpoints as the in-process engine, with each client in a SuperNode (one per client id,
started with --node-config "partition-id=K num-partitions=N"). The ServerApp writes the run folder
(give an absolute --output-dir on a shared disk). `flwr run` reports success even when the ServerApp
failed; `hf-fedtask flower run` checks the run's status and exits 2 unless it completed."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: `hf-fedtask run: error: MESSAGE; see hf-fedtask run --help`,
    exit 2, instead of the usage block; a mistyped flag or command names the closest one. Subcommands'
    parsers are of this class too (`add_subparsers` makes them with the parent's class)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self.prog == _PROG and extras:  # name the subcommand whose flag is unknown, not the top-level one
            flags = [a for a in extras if a.startswith("-")]
            parser = self._command_parser(namespace)
            close = difflib.get_close_matches(flags[0].split("=")[0], parser._option_string_actions, n=1,
                                              cutoff=0.75) if flags else []
            parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {close[0]}?)" if close
                                                                           else ""))
        return namespace, extras

    def _command_parser(self, namespace) -> argparse.ArgumentParser:
        """The parser of the (sub)command `namespace` was parsed for, e.g. `hf-fedtask flower run`'s."""
        parser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None or getattr(namespace, sub.dest, None) not in sub.choices:
                return parser
            parser = sub.choices[getattr(namespace, sub.dest)]

    def error(self, message: str):
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            close = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.6)
            message += f" (did you mean {close[0]}?)" if close else ""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


_PROG = "hf-fedtask"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run (or resume) a federated job")
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the last finished round in --output-dir")
    p.add_argument("--overwrite", action="store_true", help="delete what --output-dir holds and start over")
    p.add_argument("--threads", type=_threads, default=None, help=THREADS_HELP)
    p.set_defaults(func=_run)

    p = sub.add_parser("inspect", help="print a task-vector file's metadata, keys, shapes and size")
    p.add_argument("file", help="a task-vector .safetensors file (TaskVector.save, e.g. a run's task vectors)")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("export", help="(re)write the PEFT adapters of a run from its checkpoint")
    p.add_argument("run_dir", help="a finished run's folder (the --output-dir of `hf-fedtask run`)")
    p.set_defaults(func=_export)

    p = sub.add_parser("evaluate", help="evaluate a PEFT adapter folder on a task with stock PEFT",
                       description=EVALUATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter_dir", help="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--task", default=None, help="builtin task name, local dataset path or Hub id (default: the "
                   "task the adapter was trained on, as its hf_fedtask.json or its run records it)")
    p.add_argument("--split", default=None, help="the task's split to score (default: test)")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per text input (default: the run's max_length, as the adapter records it; else 32)")
    p.add_argument("--max-test-samples", type=_count_or_all, default=None, metavar="N|all",
                   help="score a seeded subset of N examples; 0 or all: the whole split (default: the subset the run "
                        "scored this task on, i.e. its max_test_samples, else the whole split)")
    p.add_argument("--base-model", default=None, help="load this base model (local folder or Hub id) instead of the "
                   "recorded one; it must be the model the adapter was trained on (default: adapter_config.json's "
                   "base_model_name_or_path, or the run's local folder when the adapter sits in its run)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per forward pass (default: 128; with --lm-eval, lm-eval's requests a pass, "
                        "default 8: their logits over the vocabulary grow with the prompt's length)")
    lm = p.add_argument_group("lm-evaluation-harness (pip install \"hf-fedtask[lm-eval]\"; causal-LM adapters)")
    lm.add_argument("--lm-eval", default=None, metavar="TASKS",
                    help="score the adapter with lm-evaluation-harness on these tasks, groups or tags "
                         "(comma-separated, globs allowed, e.g. arc_easy,mmlu) instead of --task: "
                         "HFLM(pretrained=<base>, peft=ADAPTER_DIR); writes ADAPTER_DIR/lm_eval.json and a table "
                         "into its README.md")
    lm.add_argument("--lm-eval-include", action="append", default=None, metavar="PATH",
                    help="a folder of lm-eval task definitions (YAML) of your own, searched as lm-eval's "
                         "--include_path searches it (repeatable)")
    lm.add_argument("--limit", type=_limit, default=None, metavar="N",
                    help="lm-eval: score only the first N examples of each task (a fraction in (0, 1): that share)")
    lm.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                    help="lm-eval: K examples in each prompt (default: each task's own setting)")
    lm.add_argument("--apply-chat-template", action="store_true",
                    help="lm-eval: send each prompt through the tokenizer's chat template, as hf_fedtask trains "
                         "causal LMs (default: plain text, as lm-eval's leaderboards score)")
    p.set_defaults(func=_evaluate)

    p = sub.add_parser("push", help="push an adapter folder to the Hugging Face Hub")
    p.add_argument("folder", help="the PEFT adapter folder to upload (with its README.md model card)")
    p.add_argument("--repo-id", required=True, help="the Hub model repo, created if missing, e.g. user/name")
    p.add_argument("--token", default=None,
                   help="a Hub write token (default: HF_TOKEN, else the token `hf auth login` saved)")
    p.add_argument("--private", action="store_true", help="create the repo as private (an existing one is kept)")
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.set_defaults(func=_push)

    p = sub.add_parser("merge", help="merge PEFT adapters or task vectors of one base into one adapter (one-shot)",
                       description=MERGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="PEFT adapter folders or task-vector .safetensors files")
    p.add_argument("-o", "--output", required=True, help="output adapter folder")
    p.add_argument("--method", required=True, choices=("task_arithmetic", "ties", "dare", "unify"),
                   help="task_arithmetic (weighted sum), ties (trim, elect signs, disjoint mean), dare (random "
                        "drop and rescale), unify (one unified vector with a mask and a rescaler per input)")
    p.add_argument("--weights", default=None,
                   help="comma-separated, one per input (default 1 each); "
                        "write --weights=-1,2 when the first is negative")
    p.add_argument("--density", type=float, default=None,
                   help="fraction kept: ties (default 0.2) and dare (default 0.5)")
    p.add_argument("--majority-sign", choices=("total", "frequency"), default="total", help="ties and dare ties")
    p.add_argument("--scope", choices=("tensor", "model"), default="tensor",
                   help="ties trimming: per tensor or whole vector")
    p.add_argument("--seed", type=int, default=0, help="dare's random drop")
    p.add_argument("--dare-variant", choices=("linear", "ties"), default="linear",
                   help="dare: sum the rescaled vectors (linear) or merge them with ties's sign election")
    p.add_argument("--rescaler", choices=("global_sum", "per_tensor_mean"), default="global_sum", help="unify's λ")
    p.add_argument("--base-adapter", default=None,
                   help="adapter folder holding the PEFT init the task vectors start from")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--head-from", default=None, metavar="INPUT",
                       help="keep this input's classification head (its path, folder name or task) with its label "
                            "names and tokenizer, and merge only the shared modules; needed when the inputs' heads "
                            "have different label sets")
    heads.add_argument("--no-head", action="store_true",
                       help="write the merged shared modules only, without a classification head")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=_merge)

    p = sub.add_parser("unlearn", help="remove a task or a client from a finished run (negation, one-shot, F²L²)",
                       description=UNLEARN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a finished run (FedAvg family: fedavg, fedprox, ntkfedavg, ntkfedprox)")
    p.add_argument("--threads", type=_threads, default=None, help=THREADS_HELP)
    p.add_argument("--task", default=None, help="the task to forget")
    p.add_argument("--client", type=int, default=None, help="federated: the client to forget (its updates negated)")
    p.add_argument("--rounds", type=int, default=None, help="federated: rounds of negated updates")
    p.add_argument("--one-shot", action="store_true", help="subtract the task's vector instead of running rounds")
    p.add_argument("--scale", type=float, default=None, help="one-shot: λ in θ − λ·τ_task (default 1)")
    p.add_argument("--task-vector", default=None,
                   help="one-shot: adapter folder or task-vector file (default: the run's recorded task vector)")
    p.add_argument("--output-dir", default=None, help="default: RUN_DIR-unlearn-TASK (federated), RUN_DIR-negate-TASK")
    p.add_argument("--resume", action="store_true", help="federated: continue an interrupted unlearning run")
    p.add_argument("--method", choices=_UNLEARN_METHODS, default="negate",
                   help="how a client is removed: negate (federated, --rounds), f2l2 (one Newton step on the server, "
                        "F²L² runs), sga (gradient ascent on the client's data, the baseline)")
    p.add_argument("--rho", type=float, default=None,
                   help="f2l2: damp the removal step with λ = ρ·λ_max(H_s), the server Hessian's largest eigenvalue "
                        "(default: the run's removal_damping; auto takes relative with removal_rho 0.002 unless the "
                        "objective has l2 or a ridge and the factors are complete or w* its optimum)")
    p.add_argument("--l2", type=float, default=None,
                   help="f2l2: damp the removal step with this absolute λ instead (not with --rho)")
    p.add_argument("--gradient", choices=GRADIENT_FORMS, default=None,
                   help="f2l2: g split between the retained clients' gradient where the server's Hessian has "
                        "curvature and the client's share where it has none, if the client's share fits the trust "
                        "region, else the retained clients' (auto, the default; with the clients' complete "
                        "curvature factors, anchored); split; the retained objective's Newton step damped toward "
                        "w0, not w* (anchored); the client's share (difference); from the removed client's "
                        "gradient alone (target, the paper's); or from the retained clients' (retained)")
    p.add_argument("--cg-iterations", type=int, default=None, help="f2l2: conjugate-gradient iterations at most (200)")
    p.add_argument("--cg-tolerance", type=float, default=None, help="f2l2: stop at this relative residual (1e-6)")
    p.add_argument("--trust-radius", type=float, default=None,
                   help="f2l2: cap the step's norm at this multiple of ‖w* − w₀‖, raising λ until it fits (0: no "
                        "cap; default: the run's removal_trust_radius, 1)")
    p.add_argument("--hessian", choices=HESSIANS, default=None,
                   help="f2l2: the removal's Hessian: the retained clients' own, from the curvature factors they "
                        "uploaded (clients; runs trained with curvature_rank > 0), the server's slice (server), or "
                        "the clients' where the run has them (auto, the default)")
    p.add_argument("--sga-epochs", type=float, default=None, help="sga: epochs of ascent (1)")
    p.add_argument("--sga-lr", type=float, default=None, help="sga: learning rate (1e-3)")
    p.add_argument("--overwrite", action="store_true", help="replace what --output-dir holds")
    p.set_defaults(func=_unlearn)

    p = sub.add_parser("flower", help="run on a Flower federation (pip install \"hf-fedtask[flower]\")",
                       description=FLOWER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    flower_sub = p.add_subparsers(dest="flower_command", required=True)
    f = flower_sub.add_parser("run", help="flwr run the hf_fedtask app for a RunConfig; fails unless the run completed")
    add_config_arguments(f)
    f.add_argument("--connection", required=True, help="a SuperLink connection of $FLWR_HOME/config.toml")
    f.add_argument("--app-dir", default=None, help="the Flower app folder (default: the manifest, written afresh)")
    f.add_argument("--federation-config", nargs="+", default=None, metavar="KEY=VALUE",
                   help="simulation SuperLinks: e.g. num-supernodes=4 (one SuperNode per client)")
    f.add_argument("--timeout", type=float, default=None, help="seconds to wait for one exchange's replies")
    f.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the SuperNodes to connect")
    f.add_argument("--resume", action="store_true", help="continue from the last finished round in --output-dir")
    f.add_argument("--overwrite", action="store_true", help="delete what --output-dir holds and start over")
    f.set_defaults(func=_flower_run)
    f = flower_sub.add_parser("worker", help="a warm client worker beside one SuperNode: keeps the client's model, "
                              "data and tokenized inputs across messages (start the SuperNode with --node-config "
                              "\"... worker='PATH'\")")
    f.add_argument("--socket", required=True, help="the Unix socket to listen on (created mode 0600); the same path "
                   "goes into the SuperNode's --node-config as worker='PATH'")
    f.add_argument("--threads", type=int, default=None, help="torch threads of the worker (default: torch's choice, "
                   "or OMP_NUM_THREADS)")
    f.add_argument("--authkey-file", default=None, help="where the worker writes its key (32 random bytes, mode 0600, "
                   "removed when it stops); default: the socket path + .key, where the ClientApp looks for it. "
                   "Elsewhere, give the SuperNode's --node-config worker-key='PATH' too")
    f.add_argument("--request-timeout", type=float, default=60.0, help="seconds a connection has to deliver its "
                   "request (the handling, i.e. training, is not timed); a stalled one is closed (default 60)")
    f.add_argument("--max-frame-gib", type=float, default=4.0, help="largest payload or store a request may carry, "
                   "in GiB (default 4)")
    f.set_defaults(func=_flower_worker)
    f = flower_sub.add_parser("credentials", help="a CA, the SuperLink's TLS certificate and one key pair per "
                              "SuperNode (flower-superlink --enable-supernode-auth), with where each file goes")
    f.add_argument("folder", metavar="DIR", help="the folder to write the credentials to (new or empty)")
    f.add_argument("--nodes", type=int, required=True, help="how many SuperNode key pairs to make (one per client)")
    f.add_argument("--host", action="extend", nargs="+", default=None, metavar="NAME_OR_IP",
                   help="a DNS name or IP address the SuperNodes and the flwr CLI dial the SuperLink by; the "
                        "certificate always names localhost, 127.0.0.1 and ::1 too")
    f.add_argument("--days", type=int, default=365, help="how long the certificates are valid (default 365)")
    f.add_argument("--overwrite", action="store_true", help="replace the credentials of a non-empty DIR")
    f.set_defaults(func=_flower_credentials)
    f = flower_sub.add_parser("app", help="write the Flower app folder (pyproject.toml manifest) for `flwr run`")
    f.add_argument("folder", help="the app folder to write (its name: letters, digits and hyphens, for flwr build)")
    f.set_defaults(func=_flower_app)

    p = sub.add_parser("cache-backbone", help="place the embedded all-MiniLM-L6-v2 into the Hugging Face cache "
                       "under its Hub id, so stock loaders find it offline (done on first use too)")
    p.add_argument("--cache-dir", help="a Hub cache folder (default: HF_HUB_CACHE, else HF_HOME/hub)")
    p.set_defaults(func=_cache_backbone)
    p = sub.add_parser("suite", help="builtin task suites")
    suite_sub = p.add_subparsers(dest="suite_command", required=True)
    s = suite_sub.add_parser("export", help="save each task of a suite with datasets.save_to_disk, with its card")
    s.add_argument("name", help=f"the suite: {' | '.join(SUITES)}")
    s.add_argument("out_dir", help="where to write one dataset folder per task and suite.json")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of the tasks' sampled examples and splits; a run with --seed S uses S's (default: 0)")
    s.set_defaults(func=_suite_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FedTaskError as e:
        print(f"hf-fedtask: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf-fedtask: interrupted; the last finished round is checkpointed (use --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
