"""Do the Flower engines give the in-process engine's run, bit for bit? FedAvg, MaTU and FedYoLo on
`builtin-8` with the real embedded MiniLM (the default `base_model`), through:

  inprocess   `run(config)`, the reference
  simulation  a Ray simulation: `flower-superlink --simulation` started by this script on a free port
              (temporary FLWR_HOME, --disable-runtime-dependency-installation), then `launch(...)` with
              `--federation-config num-supernodes=<clients>` (one simulated SuperNode per client)
  deployment  a loopback deployment: a SuperLink and one `flower-supernode` per client (>= 3), separate
              processes on 127.0.0.1, then `launch(...)` (`flwr run ... --stream` + the run's status)

The job: 4 clients at zeta 0.5 (builtin-8 has 8 tasks, so 4 clients need zeta > 0; at seed 0 the
clients hold 4, 2, 5 and 3 tasks, so MaTU's clients unify several task vectors), 2 rounds, a few local
steps per (client, task), every task's train split capped, `save_payloads=True`, export off.

For each strategy and Flower engine, against the in-process run:
  tensors   the final checkpoint's tensors: the same keys, and `torch.equal` with the same dtype on
            every key (the number of keys is shown)
  metrics   metrics.jsonl record for record, every field but `seconds`
  payloads  every round's uplink and downlink bytes (payloads/round_*/client_*.safetensors): the same
            files, and each equal by a canonical digest, sha256 of the header JSON re-dumped with
            sorted keys followed by the data section (safetensors writes its `__metadata__` map in an
            order that differs from process to process, so equal payloads differ in raw bytes)
A table and one JSON line are printed; the exit status is 1 if anything differs.

Every process runs torch with --threads threads (default 1, set as OMP_NUM_THREADS / MKL_NUM_THREADS
before torch is imported and inherited by every Flower process), so all engines compute with the same
thread count.

    python benchmarks/engine_equivalence.py            # MiniLM: several minutes
    python benchmarks/engine_equivalence.py --quick    # tiny random BERT from a temporary folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import TINY_MODEL_ID, Federation, loadavg, tiny_model  # noqa: E402  (also: offline env)

STRATEGIES = ("fedavg", "matu", "fedyolo")
FLOWER_ENGINES = ("simulation", "deployment")


def canonical_digest(data: bytes) -> str:
    """sha256 of a safetensors blob's header JSON re-dumped with sorted keys, then its data section."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + length :]).hexdigest()


def payload_digests(run_dir: Path) -> dict[str, str]:
    folder = run_dir / "payloads"
    return {str(p.relative_to(folder)): canonical_digest(p.read_bytes()) for p in sorted(folder.rglob("*.safetensors"))}


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the timings."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in lines]


def compare(reference: Path, other: Path) -> dict:
    """The three checks of the module docstring, with counts and the first differences."""
    import torch

    from hf_fedtask.core.checkpoint import CHECKPOINT_FILE
    from hf_fedtask.core.taskvector import TaskVector

    ref, got = TaskVector.load(reference / CHECKPOINT_FILE), TaskVector.load(other / CHECKPOINT_FILE)
    keys = sorted(set(ref) | set(got))
    unequal = [k for k in keys if k not in ref or k not in got or ref[k].dtype != got[k].dtype
               or not torch.equal(ref[k], got[k])]
    ref_records, got_records = records(reference), records(other)
    differ_rounds = [r.get("round") for r, g in zip(ref_records, got_records) if r != g]
    ref_payloads, got_payloads = payload_digests(reference), payload_digests(other)
    names = sorted(set(ref_payloads) | set(got_payloads))
    differ_payloads = [n for n in names if ref_payloads.get(n) != got_payloads.get(n)]
    out = {
        "tensors_equal": not unequal and bool(keys), "keys": len(keys), "unequal_keys": unequal[:5],
        "metrics_equal": ref_records == got_records and bool(ref_records), "rounds": len(ref_records),
        "differing_rounds": differ_rounds if len(ref_records) == len(got_records) else "different lengths",
        "payloads_equal": not differ_payloads and bool(names), "payloads": len(names),
        "differing_payloads": differ_payloads[:5],
    }
    out["equal"] = out["tensors_equal"] and out["metrics_equal"] and out["payloads_equal"]
    return out


def make_config(args, strategy: str, output_dir: Path, model: dict):
    from hf_fedtask.config import RunConfig

    return RunConfig(strategy=strategy, suite="builtin-8", num_clients=args.clients, zeta=args.zeta,
                     max_train_samples=args.max_train_samples, local_steps=args.local_steps,
                     batch_size=args.batch_size, rounds=args.rounds, export=False, save_payloads=True,
                     output_dir=str(output_dir), **model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random BERT from a temporary folder")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--engines", default=",".join(FLOWER_ENGINES), help="Flower engines to compare")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--zeta", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=2, help="per (client, task)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-train-samples", type=int, default=64, help="per task")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process (0: torch's default)")
    parser.add_argument("--workdir", default=None, help="keep run folders and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    engines = [e for e in FLOWER_ENGINES if e in args.engines.split(",")]
    if args.clients < 3 and "deployment" in engines:
        parser.error("the deployment needs at least 3 SuperNodes: --clients >= 3")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    start = time.monotonic()
    load_start = loadavg()
    print(f"load average at start: {load_start} ({os.cpu_count()} CPUs)", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="engine_equivalence_") if args.workdir is None else None
    workdir = Path(args.workdir or tmp.name).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        from hf_fedtask.engine.run import run
        from hf_fedtask.model.backbone import DEFAULT_BASE_MODEL

        model = ({"base_model": tiny_model(workdir / "tiny-bert"), "base_model_id": TINY_MODEL_ID, "max_length": 16}
                 if args.quick else {})
        base = model.get("base_model_id", DEFAULT_BASE_MODEL)
        print(f"{', '.join(strategies)} on builtin-8, {base}, {args.clients} clients (zeta {args.zeta}), "
              f"{args.rounds} rounds, {args.local_steps} local steps x batch {args.batch_size} per (client, task), "
              f"max_train_samples {args.max_train_samples}, save_payloads, export off; "
              f"threads {args.threads or 'default'}",
              flush=True)
        walls: dict[tuple[str, str], float] = {}

        def timed(engine: str, strategy: str, fn) -> Path:
            config = make_config(args, strategy, workdir / f"{strategy}-{engine}", model)
            t0 = time.monotonic()
            fn(config)
            walls[strategy, engine] = time.monotonic() - t0
            print(f"  {strategy:<8} {engine:<11} {walls[strategy, engine]:7.1f} s  (load {loadavg()})", flush=True)
            return Path(config.output_dir)

        for strategy in strategies:
            timed("inprocess", strategy, run)
        federations = {}
        for engine in engines:
            with Federation(workdir / engine, args.clients, simulation=engine == "simulation") as federation:
                federations[engine] = federation.startup_s
                print(f"{engine}: SuperLink{'' if engine == 'simulation' else f' + {args.clients} SuperNodes'} "
                      f"up in {federation.startup_s:.1f} s", flush=True)
                for strategy in strategies:
                    timed(engine, strategy, federation.launch)

        results = []
        for strategy in strategies:
            for engine in engines:
                c = compare(workdir / f"{strategy}-inprocess", workdir / f"{strategy}-{engine}")
                results.append({"strategy": strategy, "engine": engine, **c,
                                "seconds": round(walls[strategy, engine], 1),
                                "inprocess_seconds": round(walls[strategy, "inprocess"], 1)})
        total = time.monotonic() - start
        load_end = loadavg()

        def yes(ok: bool, detail: str) -> str:
            return f"{'equal' if ok else 'DIFFER'} ({detail})"

        print(f"\n{'strategy':<9}{'engine':<12}{'final checkpoint tensors':<28}{'metrics.jsonl (w/o seconds)':<30}"
              f"{'payloads (canonical digest)':<30}{'wall s':>8}{'in-proc s':>10}")
        for r in results:
            tensors = yes(r["tensors_equal"], f"{r['keys']} keys")
            metrics = yes(r["metrics_equal"], f"{r['rounds']} rounds")
            payloads = yes(r["payloads_equal"], f"{r['payloads']} files")
            print(f"{r['strategy']:<9}{r['engine']:<12}{tensors:<28}{metrics:<30}{payloads:<30}{r['seconds']:>8.1f}"
                  f"{r['inprocess_seconds']:>10.1f}")
            if not r["equal"]:
                print(f"    first differences: keys {r['unequal_keys']}, rounds {r['differing_rounds']}, "
                      f"payloads {r['differing_payloads']}")
        every = all(r["equal"] for r in results)
        print(f"\nall equal: {every}; total wall time {total:.0f} s; load average at end: {load_end}")
        print(json.dumps({"benchmark": "engine_equivalence", "quick": args.quick, "base_model": base,
                          "strategies": strategies, "engines": engines,
                          "config": {k: getattr(args, k) for k in ("clients", "zeta", "rounds", "local_steps",
                                                                   "batch_size", "max_train_samples", "threads")},
                          "all_equal": every, "results": results, "federation_startup_s": federations,
                          "wall_s": round(total, 1), "load_start": load_start, "load_end": load_end}))
        return 0 if every else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
