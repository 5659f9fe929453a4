"""Where the time of a simulated FedAvg round goes: the in-process engine with each client loop (the
Trainer's, the lean one) against a plain PyTorch loop doing the same optimizer steps on the same data, in the
same run.

Configurations (FedAvg, every client sampled every round):

* mlp-Nc / cnn-Nc: `hf-fedtask/small-mlp` / `hf-fedtask/small-cnn` (`peft_method: full`) on Fashion-MNIST
  (the Debian idx files), N = 10 and 100 clients (--quick: the MLP alone, 3 clients, 3 steps), iid
  partition of a seeded train subset of N * steps * batch rows (one epoch of `local_steps` batches each).
* minilm-lora-2t: the default MiniLM with LoRA r=8 on two builtin-8 tasks (one client per task).

Paths (each a function `(Bench) -> seconds of one round`, see PATHS):

* trainer: `Federation(config).run_round(state, r)` with `client_loop: trainer`: the server packs each
  client's downlink, the in-process transport hands it to the client runtime, which trains through
  `LocalTrainer.train` (a
  `transformers.Trainer` per (client, task): TrainingArguments, Accelerator, AdamW, linear schedule,
  DataLoader + collator over the client's prepared `datasets.Dataset`, clipping at max_grad_norm), the
  server unpacks and averages the replies and evaluates every task's test split (eval_batch_size).
* lean: the same round with `client_loop: lean` (`hf_fedtask.client.lean`): the same optimizer steps bit for bit,
  over each task's rows collated once and batched by index, without the Trainer's per-call setup.
* batched: the lean loop with `batch_clients: auto` (`hf_fedtask.client.batched`): the round's clients trained
  together, K copies of the model in one vmapped step (where the step has no randomness; MiniLM's dropout
  falls back to the lean loop, one client at a time).
* plain: on the same model object (`fed.host.model`, the PEFT model: the same class and init, loaded
  with `host.load_state`), for each (client, task): `torch.optim.AdamW` with the same lr, betas, eps
  and weight decay, the same linear LambdaLR schedule and `clip_grad_norm_(max_grad_norm)`, the same
  number of steps (`local_steps`) of the same batch size, over the client's same rows held as one
  tensor per input (collated once, untimed) and batched by index (a seeded permutation per epoch;
  text batches are cut to their longest row, as the Trainer's dynamic padding does); then a FedAvg
  (sample-weighted mean of the shared parameters, each task's head over its holders) and an
  evaluation (accuracy) of each task's same test split in batches of eval_batch_size, with no_grad.

All paths start from the same initial state and keep their own global state across rounds; the
draws of the batches differ (the Trainer's sampler vs a torch permutation), the amount of work does
not. Rounds alternate trainer, lean, plain, trainer, ... after one untimed warm-up round of each; the
seconds per round is the median over --repeats rounds, a ratio X/plain is the ratio of the medians. Threads:
torch.set_num_threads(--threads) (default 1: the benchmark box has 2 shared cores).

Where the trainer path's time goes: light wrappers (a perf_counter pair per call) around `Server.evaluate`,
`LocalTrainer.train`, the `_HostDeviceArguments` and `Trainer` constructors, `Trainer.train`,
`Trainer.get_batch_samples` (DataLoader: dataset reads + collation), `Trainer.training_step`
(forward + backward), `Trainer._clip_grad_norm` + `_get_grad_norm`, `AcceleratedOptimizer.step`,
accelerate's `clear_device_cache` (the full `gc.collect()` of `free_memory()` that ends every Trainer.train),
`PeftHost.load_state` / `PeftHost.state`; "Trainer.train other" is Trainer.train minus the parts inside
it (setup, callbacks, scheduler, the gc of accelerate's free_memory, ...) and "server+protocol" is the
round minus local training and evaluation (packing, unpacking, aggregation, records). The gc.collect
part depends on what the process allocated since the last `gc.freeze()` (LocalTrainer's construction):
in the first configuration the objects of the first evaluation (e.g. the `evaluate` import) stay
unfrozen and every client call pays for scanning them (about 40 ms on the MLP), as in a real run; a
later configuration's LocalTrainer freezes them, so its gc share is small. The box load
(os.getloadavg) is printed at the start and after each configuration.

    python benchmarks/simulation_speed.py --quick     # MLP, 3 clients, seconds
    python benchmarks/simulation_speed.py             # MLP and CNN at 10 and 100 clients, MiniLM+LoRA
    python benchmarks/simulation_speed.py --results-page docs/results/benchmarks.md   # and record the table
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
               "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script beside the other benchmarks
from client_overhead import Attribution  # noqa: E402

TEXT_TASKS = ("vader_polarity", "langid_romance")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


# -- attribution of the trainer path's time: client_overhead.py's `Attribution` (wall time in wrapped callables) ---
ATTR = Attribution()
PARTS = ("trainer construction", "data load+collate", "forward+backward", "clip+optimizer step",
         "gc.collect (free_memory)", "Trainer.train other", "host load/read state", "evaluation", "server+protocol")


def install_probes() -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import memory
    from transformers import Trainer

    from hf_fedtask.client import trainer as client_trainer
    from hf_fedtask.engine.server import Server
    from hf_fedtask.model.host import PeftHost

    ATTR.wrap(Server, "evaluate", "evaluation")
    ATTR.wrap(client_trainer.LocalTrainer, "train", "LocalTrainer.train")
    ATTR.wrap(client_trainer._HostDeviceArguments, "__init__", "args")
    ATTR.wrap(client_trainer._ObjectiveTrainer, "__init__", "trainer")
    ATTR.wrap(Trainer, "train", "Trainer.train")
    ATTR.wrap(Trainer, "get_batch_samples", "data load+collate")
    ATTR.wrap(Trainer, "training_step", "forward+backward")
    ATTR.wrap(Trainer, "_clip_grad_norm", "clip")
    ATTR.wrap(Trainer, "_get_grad_norm", "grad norm")
    ATTR.wrap(AcceleratedOptimizer, "step", "optimizer step")
    ATTR.wrap(memory, "clear_device_cache", "gc")  # accelerate's free_memory() at Trainer.train's end: gc.collect()
    ATTR.wrap(PeftHost, "load_state", "load_state")
    ATTR.wrap(PeftHost, "state", "state")


def breakdown(raw: dict[str, float], round_seconds: float) -> dict[str, float]:
    """The wrapped times, grouped into PARTS that sum to the round (nested calls subtracted)."""
    g = raw.get
    step = g("clip", 0.0) + g("grad norm", 0.0) + g("optimizer step", 0.0)
    inside = g("data load+collate", 0.0) + g("forward+backward", 0.0) + step + g("gc", 0.0)
    construction = g("args", 0.0) + g("trainer", 0.0)
    return {
        "trainer construction": construction,
        "data load+collate": g("data load+collate", 0.0),
        "forward+backward": g("forward+backward", 0.0),
        "clip+optimizer step": step,
        "gc.collect (free_memory)": g("gc", 0.0),
        "Trainer.train other": g("Trainer.train", 0.0) - inside,
        # LocalTrainer.train = load_state + construction + Trainer.train + state (+ a few dict ops)
        "host load/read state": g("LocalTrainer.train", 0.0) - construction - g("Trainer.train", 0.0),
        "evaluation": g("evaluation", 0.0),
        "server+protocol": round_seconds - g("LocalTrainer.train", 0.0) - g("evaluation", 0.0),
    }


# -- the benchmark's setup ---------------------------------------------------------------------------------
@dataclass
class Bench:
    """One configuration: a federation per client loop (the Trainer's, the lean one) and the same data as
    tensors (the plain path)."""

    name: str
    config: object  # RunConfig
    feds: dict = field(default_factory=dict)  # client_loop -> Federation
    states: dict = field(default_factory=dict)  # client_loop -> its GlobalState
    rounds: dict = field(default_factory=dict)  # client_loop -> rounds run
    plain_global: dict = field(default_factory=dict)  # the plain path's shared params and per-task heads
    train: dict = field(default_factory=dict)  # (client, task) -> tensors
    test: dict = field(default_factory=dict)  # task -> tensors
    parts: list = field(default_factory=list)  # the trainer path's breakdown per timed round
    plain_parts: list = field(default_factory=list)

    @property
    def fed(self):
        return self.feds["trainer"]

    def setup(self) -> None:
        import dataclasses

        from hf_fedtask.engine.inprocess import Federation

        for loop in LOOPS:
            options = {"client_loop": "lean" if loop == "batched" else loop,
                       "batch_clients": "auto" if loop == "batched" else "off"}
            self.feds[loop] = Federation(dataclasses.replace(self.config, **options))
            self.states[loop], self.rounds[loop] = self.feds[loop].initial_state(), 0
        collate = self.fed.host.inputs.collator
        for c, tasks in self.fed.allocation.items():
            data = self.fed.client_data(c)
            for t in tasks:
                self.train[c, t] = collate([data[t][i] for i in range(len(data[t]))])
        for task in self.fed.tasks:
            test = self.fed.test_data(task.name)
            self.test[task.name] = collate([test[i] for i in range(len(test))])
        origin = self.fed.origin
        self.plain_global = {"shared": {k: v.clone() for k, v in origin.items()},
                             "heads": {t: {k: v.clone() for k, v in h.items()}
                                       for t, h in self.fed.initial_heads.items()}}


def take(tensors: dict, idx: torch.Tensor) -> dict:
    """Rows `idx` of every input; token inputs cut to the batch's longest row (dynamic padding)."""
    batch = {k: v[idx] for k, v in tensors.items()}
    mask = batch.get("attention_mask")
    if mask is not None:
        longest = int(mask.sum(1).max())
        batch = {k: v[:, :longest] if v.dim() == 2 and k != "labels" else v for k, v in batch.items()}
    return batch


# -- paths: each runs one round of `bench` and returns its wall seconds -------------------------------------
LOOPS = ("trainer", "lean", "batched")


def federation_round(bench: Bench, loop: str) -> float:
    """One round of `hf_fedtask.engine.inprocess.Federation` with `client_loop: loop` (batched: the lean loop
    with `batch_clients: auto`)."""
    bench.rounds[loop] += 1
    ATTR.seconds, ATTR.enabled = {}, loop == "trainer"
    t0 = time.perf_counter()
    bench.states[loop], _ = bench.feds[loop].run_round(bench.states[loop], bench.rounds[loop])
    seconds = time.perf_counter() - t0
    ATTR.enabled = False
    if loop == "trainer":
        bench.parts.append(breakdown(ATTR.seconds, seconds))
    return seconds


def trainer(bench: Bench) -> float:
    return federation_round(bench, "trainer")


def lean(bench: Bench) -> float:
    return federation_round(bench, "lean")


def batched(bench: Bench) -> float:
    return federation_round(bench, "batched")


def plain(bench: Bench) -> float:
    from hf_fedtask.core.taskvector import TaskVector

    cfg, host = bench.config, bench.fed.host
    model = host.model
    t0 = time.perf_counter()
    sums, counts, head_sums, head_counts = {}, 0, {}, {}
    for (c, task), tensors in bench.train.items():
        host.load_state(TaskVector({**bench.plain_global["shared"], **bench.plain_global["heads"][task]}))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=cfg.weight_decay)
        steps = cfg.local_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s, n=steps: max(0.0, (n - s) / n))
        n = len(tensors["labels"])
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + len(bench.plain_parts) * 1009 + c)
        order = torch.randperm(n, generator=gen)
        pos = 0
        for _ in range(steps):
            if pos >= n:  # a new epoch (the Trainer keeps the last, partial batch too)
                order, pos = torch.randperm(n, generator=gen), 0
            idx = order[pos:pos + cfg.batch_size]
            pos += cfg.batch_size
            loss = model(**take(tensors, idx)).loss
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            sched.step()
            model.zero_grad(set_to_none=True)
        trained = host.state()
        for k in host.shared_keys:
            sums[k] = sums.get(k, 0.0) + n * trained[k]
        counts += n
        heads = head_sums.setdefault(task, {})
        for k in host.head_keys:
            heads[k] = heads.get(k, 0.0) + n * trained[k]
        head_counts[task] = head_counts.get(task, 0) + n
    bench.plain_global["shared"] = {k: v / counts for k, v in sums.items()}
    for task, heads in head_sums.items():
        bench.plain_global["heads"][task] = {k: v / head_counts[task] for k, v in heads.items()}
    t1 = time.perf_counter()
    model.eval()
    with torch.no_grad():
        for task, tensors in bench.test.items():
            host.load_state(TaskVector({**bench.plain_global["shared"], **bench.plain_global["heads"][task]}))
            n, right = len(tensors["labels"]), 0
            for start in range(0, n, cfg.eval_batch_size):
                batch = take(tensors, torch.arange(start, min(n, start + cfg.eval_batch_size)))
                labels = batch.pop("labels")
                right += int((model(**batch).logits.argmax(-1) == labels).sum())
    t2 = time.perf_counter()
    bench.plain_parts.append({"train+aggregate": t1 - t0, "evaluation": t2 - t1})
    return t2 - t0


PATHS = {"trainer": trainer, "lean": lean, "batched": batched, "plain": plain}
"""Path name -> function running one round of a Bench and returning its seconds."""


# -- configurations ----------------------------------------------------------------------------------------
def configurations(args) -> list[Bench]:
    from hf_fedtask.config import RunConfig
    from hf_fedtask.model.small_cnn import SMALL_CNN, SMALL_MLP

    common = dict(strategy="fedavg", local_steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                  max_test_samples=args.test_samples, output_dir="/tmp/hf_fedtask_simulation_speed")

    def image(name, model, clients):
        return Bench(f"{name}-{clients}c", RunConfig(
            tasks=["fashion_mnist"], suite=None, base_model=model, peft_method="full", num_clients=clients,
            max_train_samples=clients * args.steps * args.batch_size, **common))

    if args.quick:
        return [image("mlp", SMALL_MLP, args.clients[0])]
    models = {"mlp": SMALL_MLP, "cnn": SMALL_CNN}
    benches = [image(name, models[name], n) for n in args.clients for name in args.models]
    if not args.no_text:
        benches.append(Bench(f"minilm-lora-{len(TEXT_TASKS)}t", RunConfig(tasks=list(TEXT_TASKS), suite=None,
                                                                          **common)))
    return benches


def measure(bench: Bench, repeats: int) -> dict[str, list[float]]:
    for path in PATHS.values():  # warm-up, untimed
        path(bench)
    bench.parts.clear()
    bench.plain_parts.clear()
    times = {name: [] for name in PATHS}
    for _ in range(repeats):
        for name, path in PATHS.items():  # A, B, A, B ...
            times[name].append(path(bench))
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: the MLP alone, 3 clients, 3 steps, 2 repeats")
    p.add_argument("--clients", default="10,100", help="client counts of the image configurations (10,100)")
    p.add_argument("--steps", type=int, default=10, help="local_steps per (client, task) and round (10)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--test-samples", type=int, default=1000, help="max_test_samples per task (1000)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each path, median reported (3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--models", default="mlp,cnn", help="image models of the image configurations (mlp,cnn)")
    p.add_argument("--no-text", action="store_true", help="skip the MiniLM+LoRA configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-page", help="also write the table as a section of this Markdown page "
                   "(docs/results/benchmarks.md), with the commit, hardware and command")
    args = p.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    args.models = [m for m in args.models.split(",") if m]
    if args.quick:
        args.clients, args.steps, args.repeats, args.test_samples = [3], 3, 2, 256
    torch.set_num_threads(args.threads)
    install_probes()
    print(f"start: {load()}; torch threads {args.threads}; {args.steps} local steps of batch {args.batch_size} per "
          f"(client, task); {args.test_samples} test rows per task; {args.repeats} timed rounds per path")

    results = []
    for bench in configurations(args):
        t0 = time.perf_counter()
        bench.setup()
        setup = time.perf_counter() - t0
        times = measure(bench, args.repeats)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        parts = {part: statistics.median(r[part] for r in bench.parts) for part in PARTS}
        plain_parts = {k: statistics.median(r[k] for r in bench.plain_parts) for k in bench.plain_parts[0]}
        results.append((bench, med, parts, plain_parts))
        spread = "; ".join(f"{name} " + " ".join(f"{t:.2f}" for t in ts) for name, ts in times.items())
        print(f"{bench.name}: setup {setup:.1f} s (untimed); rounds [s]: {spread}; {load()}")

    names = list(PATHS)
    print()
    print(f"{'config':16s}" + "".join(f"{n + ' s/round':>15s}" for n in names)
          + "".join(f"{loop + '/plain':>15s}" for loop in LOOPS) + f"{'plain train':>13s}{'plain eval':>12s}")
    for bench, med, _, pp in results:
        print(f"{bench.name:16s}" + "".join(f"{med[n]:15.3f}" for n in names)
              + "".join(f"{med[loop] / med['plain']:15.2f}" for loop in LOOPS)
              + f"{pp['train+aggregate']:13.3f}{pp['evaluation']:12.3f}")
    print()
    print("where the Trainer loop's round goes (median seconds per round, share of the median round):")
    print(f"{'part':24s}" + "".join(f"{b.name:>20s}" for b, *_ in results))
    for part in PARTS:
        print(f"{part:24s}" + "".join(f"{parts[part]:12.3f} ({parts[part] / med['trainer']:5.1%})"
                                      for _, med, parts, _ in results))
    print()
    for bench, med, _, _ in results:
        for loop in LOOPS:
            print(f"RATIO {bench.name} {loop}/plain seconds per round = {med[loop] / med['plain']:.3f} "
                  f"({loop} {med[loop]:.3f} s, plain {med['plain']:.3f} s)")
    print(f"end: {load()}")
    if args.results_page:
        from hf_fedtask.workflows.recipe import write_results_page

        rows = ["| config | " + " | ".join(f"{n} s/round" for n in names) + " | "
                + " | ".join(f"{loop}/plain" for loop in LOOPS) + " |",
                "|---" * (1 + len(names) + len(LOOPS)) + "|"]
        rows += [f"| {b.name} | " + " | ".join(f"{med[n]:.3f}" for n in names) + " | "
                 + " | ".join(f"{med[loop] / med['plain']:.2f}" for loop in LOOPS) + " |" for b, med, _, _ in results]
        note = (f"\nMedians of {args.repeats} alternating rounds per path after a warm-up round; torch threads "
                f"{args.threads}; {args.steps} local steps of batch {args.batch_size} per (client, task); "
                f"{args.test_samples} test rows per task; box load at the end: {load()}.\n")
        write_results_page(args.results_page, "simulation-speed", "\n".join(rows) + "\n" + note,
                           ["python", "benchmarks/simulation_speed.py", *sys.argv[1:]],
                           repo=Path(__file__).resolve().parents[1])


if __name__ == "__main__":
    main()
