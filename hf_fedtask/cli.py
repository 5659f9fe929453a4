"""`hf-fedtask`: run, inspect, export, evaluate, push, suite export, merge, unlearn, flower.

Every failure on bad input is one line on stderr and a non-zero exit; nothing on disk is replaced.
Nothing heavy (torch, datasets, transformers, peft) is imported at module level: each command imports
what it needs inside its function, so `--help` is quick (`tests/test_cli_startup.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from hf_fedtask.config import add_config_arguments, config_from_args
from hf_fedtask.data.builtin_tasks import SUITES
from hf_fedtask.errors import ConfigError, FedTaskError
from hf_fedtask.strategies.configs import GRADIENT_FORMS, HESSIANS


def _run(args) -> int:
    from hf_fedtask.engine.run import run
    from hf_fedtask.model.device import launch
    from hf_fedtask.report import run_report

    config = config_from_args(args)
    results = run(config, resume=args.resume, overwrite=args.overwrite)
    if launch().rank == 0:  # under a multi-process launch the other ranks only trained
        print(run_report(config, results))
    return 0


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
    from hf_fedtask.report import unlearning_report
    from hf_fedtask.workflows import unlearn as workflows

    mode = _unlearn_mode(args)
    targets = {flag.removeprefix("--"): _flag_value(args, flag) for flag in mode.targets}
    options = {keyword: _flag_value(args, flag) for flag, keyword in mode.flags.items() if _given(args, flag)}
    results = getattr(workflows, mode.workflow)(args.run_dir, **targets, **mode.fixed, **options,
                                                 output_dir=args.output_dir, overwrite=args.overwrite)
    print(unlearning_report(results))
    return 0


def _inspect(args) -> int:
    from hf_fedtask.core.taskvector_file import inspect_file

    print(inspect_file(args.file))
    return 0


def _export(args) -> int:
    from hf_fedtask.workflows.export_run import export_run

    for path in export_run(args.run_dir):
        print(path)
    return 0


def _evaluate(args) -> int:
    from hf_fedtask.export.standalone import evaluate_adapter

    print(json.dumps(evaluate_adapter(args.adapter_dir, args.task, split=args.split, max_length=args.max_length)))
    return 0


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
                       overwrite=args.overwrite)
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
cross terms. The output keeps the first input's adapter_config.json. Heads (modules_to_save) are
merged when their shapes agree, else it is an error; unify keeps one head per input and writes the
compact export (hf_fedtask.load_task_adapter) plus each input's adapter under OUT/<name>/."""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-fedtask", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run (or resume) a federated job")
    add_config_arguments(p)
    p.add_argument("--resume", action="store_true", help="continue from the last finished round in --output-dir")
    p.add_argument("--overwrite", action="store_true", help="delete what --output-dir holds and start over")
    p.set_defaults(func=_run)

    p = sub.add_parser("inspect", help="print a task-vector file's metadata, keys, shapes and size")
    p.add_argument("file", help="a task-vector .safetensors file (TaskVector.save, e.g. a run's task vectors)")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("export", help="(re)write the PEFT adapters of a run from its checkpoint")
    p.add_argument("run_dir", help="a finished run's folder (the --output-dir of `hf-fedtask run`)")
    p.set_defaults(func=_export)

    p = sub.add_parser("evaluate", help="evaluate a PEFT adapter folder on a task with stock PEFT")
    p.add_argument("adapter_dir", help="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--task", required=True, help="builtin task name, local dataset path or Hub id")
    p.add_argument("--split", default="test", help="the task's split to score (default: test)")
    p.add_argument("--max-length", type=int, default=32,
                   help="tokens per text input; use the run's --max-length (default: 32)")
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
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=_merge)

    p = sub.add_parser("unlearn", help="remove a task or a client from a finished run (negation, one-shot, F²L²)",
                       description=UNLEARN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a finished run (FedAvg family: fedavg, fedprox, ntkfedavg, ntkfedprox)")
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
