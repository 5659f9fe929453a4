"""Merge the task vectors of separately trained adapters in Python (TIES, task arithmetic) and save PEFT adapters.

    python examples/merge_task_vectors.py                                   # two tasks, 3 rounds each
    python examples/merge_task_vectors.py --tasks vader_polarity kaomoji_valence --density 0.5 --scale 0.7
    python examples/merge_task_vectors.py --rounds 1 --local-steps 2 --builtin-train-size 64   # a quick check

1. One small FedAvg federation per task (`hf_fedtask.engine.run.run`), all from the same seed, so every adapter
   starts from the same seeded PEFT init θ_p (`Federation(config).origin`).
2. Each adapter's task vector τ = θ_task − θ_p over the shared PEFT modules (LoRA A and B), saved as a task-vector
   file (safetensors with a typed header) and loaded back with `TaskVector.load`, which checks its keys, shapes,
   base model and PEFT config hash before use.
3. `hf_fedtask.merge.ties` and `task_arithmetic` merge the τ's; θ_p + merged, with each task's own classification
   head, is written as a stock PEFT adapter folder per task and method, and scored with stock PEFT
   (`hf_fedtask.export.standalone.evaluate_adapter`, what `hf-fedtask evaluate` does) beside the task's own adapter.

`hf-fedtask merge` does the same from the command line on adapter folders (see docs/how-to/merge-adapters.md).
"""

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from hf_fedtask.config import RunConfig
from hf_fedtask.core.config_hash import peft_config_hash
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.core.taskvector_file import make_metadata
from hf_fedtask.engine.inprocess import Federation
from hf_fedtask.engine.run import run
from hf_fedtask.export.standalone import evaluate_adapter
from hf_fedtask.merge import task_arithmetic, ties

WEIGHTS = "adapter_model.safetensors"


def train_one_task_each(args) -> tuple[dict[str, Path], TaskVector]:
    """Per task, a finished run's adapter folder; and the PEFT init θ_p they all started from."""
    adapters, configs = {}, []
    for task in args.tasks:
        config = RunConfig(strategy="fedavg", tasks=[task], num_clients=2, rounds=args.rounds,
                           local_steps=args.local_steps, builtin_train_size=args.builtin_train_size,
                           max_test_samples=args.max_test_samples, seed=0,
                           output_dir=str(args.work_dir / "runs" / task))
        run(config, overwrite=True)
        adapters[task] = Path(config.output_dir) / "adapters" / task
        configs.append(config)
    return adapters, Federation(configs[0]).origin  # θ_p: a function of the seed and the PEFT config


def write_merged_adapter(source: Path, out: Path, state: dict, method: str) -> Path:
    """`source`'s adapter folder (config, tokenizer, label names) with the merged weights in place of its own."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "README.md").write_text(f"# {out.name}\n\nShared PEFT modules merged by {method} "
                                   "(examples/merge_task_vectors.py); the classification head is this task's own.\n")
    meta = json.loads((out / "hf_fedtask.json").read_text())  # what `hf-fedtask evaluate` reads: task, test subset
    meta["evaluation"] = {k: v for k, v in meta["evaluation"].items() if k in ("split", "max_test_samples")}
    (out / "hf_fedtask.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["vader_polarity", "first_name_gender"])
    parser.add_argument("--density", type=float, default=0.2, help="TIES: share of each τ's entries kept")
    parser.add_argument("--scale", type=float, default=1.0, help="the weight λ of every τ (both methods)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=-1, help="optimizer steps per round (-1: one epoch)")
    parser.add_argument("--builtin-train-size", type=int, default=None, help="training rows per builtin task")
    parser.add_argument("--max-test-samples", type=int, default=None, help="score a seeded subset of each test split")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/merge-example"))
    args = parser.parse_args(argv)

    adapters, init = train_one_task_each(args)

    # task vectors: τ = θ_task − θ_p on the shared modules, saved and loaded back as checked task-vector files
    taus, heads = [], {}
    for task, folder in adapters.items():
        trained = TaskVector(load_file(str(folder / WEIGHTS)))
        heads[task] = trained.filter(lambda k: k not in init)  # the task's own classification head
        meta = json.loads((folder / "hf_fedtask.json").read_text())
        header = {"base_model": meta["base_model"], "base_model_revision": meta["base_model_revision"],
                  "peft_config_hash": peft_config_hash(json.loads((folder / "adapter_config.json").read_text()))}
        path = args.work_dir / "task_vectors" / f"{task}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        (trained.filter(lambda k: k in init) - init).save(path, make_metadata(**header, kind="delta",
                                                                              task_ids=[task]))
        taus.append(TaskVector.load(path, template=init, expect=header))  # refused if keys or header differ
        print(f"{task}: τ saved to {path}  (|τ| = {taus[-1].norm():.4f}, {taus[-1].numel():,} parameters)")

    weights = [args.scale] * len(taus)
    merged = {"ties": ties(taus, weights=weights, density=args.density),
              "task_arithmetic": task_arithmetic(taus, weights=weights)}

    scores = {task: {"alone": evaluate_adapter(folder, progress=False)["accuracy"]}  # each task's own adapter
              for task, folder in adapters.items()}
    for method, tau in merged.items():
        for task, folder in adapters.items():
            state = {**(init + tau), **heads[task]}  # θ_p + merged τ, and this task's head
            out = write_merged_adapter(folder, args.work_dir / f"merged-{method}" / task, state, method)
            scores[task][method] = evaluate_adapter(out, progress=False)["accuracy"]
        print(f"{method}: adapters in {args.work_dir / f'merged-{method}'}/<task>")

    print(f"{'accuracy':20s} {'alone':>8s} {'ties':>8s} {'task_arithmetic':>16s}")
    for task, s in scores.items():
        print(f"{task:20s} {s['alone']:8.3f} {s['ties']:8.3f} {s['task_arithmetic']:16.3f}")
    return scores


if __name__ == "__main__":
    main()
