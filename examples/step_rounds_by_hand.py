"""Step a federation round by round from Python, with your own loop around `Federation.run_round`.

    python examples/step_rounds_by_hand.py                                   # FedAvg on builtin-8, up to 5 rounds
    python examples/step_rounds_by_hand.py --strategy fedprox --target 0.6 --participation 0.5
    python examples/step_rounds_by_hand.py --tasks vader_polarity first_name_gender --rounds 2 --local-steps 2

`Federation(config)` is the in-process engine without a run folder: `initial_state()` gives the server's first
`GlobalState`, `run_round(state, r)` runs round r (sample, downlink, local training, validation, aggregation,
evaluation) and returns the next state with the round's record, the line `hf-fedtask run` would append to
metrics.jsonl. Here the loop prints each record, measures how far the shared PEFT modules moved from their
seeded init, and stops early once the mean test metric (accuracy for the builtin tasks) reaches `--target`.
Nothing is written to disk; `hf_fedtask.engine.run.run(config)` makes a run folder with checkpoints and adapters.
"""

import argparse

from hf_fedtask.config import RunConfig
from hf_fedtask.engine.inprocess import Federation


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fedavg", help="fedavg, fedprox, scaffold, matu, ... (hf-fedtask run "
                        "--help lists them)")
    parser.add_argument("--tasks", nargs="+", help="task references (default: the builtin-8 suite)")
    parser.add_argument("--rounds", type=int, default=5, help="at most this many rounds")
    parser.add_argument("--target", type=float, default=None, help="stop once the mean test metric reaches this")
    parser.add_argument("--participation", type=float, default=1.0, help="share of the clients sampled each round")
    parser.add_argument("--local-steps", type=int, default=-1, help="optimizer steps per round (-1: one epoch)")
    parser.add_argument("--builtin-train-size", type=int, default=None, help="training rows per builtin task "
                        "(default 400)")
    parser.add_argument("--max-test-samples", type=int, default=None, help="score a seeded subset of each test split")
    args = parser.parse_args(argv)

    config = RunConfig(strategy=args.strategy, suite="builtin-8", tasks=args.tasks, rounds=args.rounds,
                       participation=args.participation, local_steps=args.local_steps,
                       builtin_train_size=args.builtin_train_size, max_test_samples=args.max_test_samples)
    fed = Federation(config)  # loads the tasks and the base model, partitions the data, builds the strategy
    print(f"{config.strategy}: {len(fed.tasks)} tasks on {len(fed.allocation)} clients {fed.allocation}")

    state = fed.initial_state()
    init = state.vectors["shared"]  # the seeded PEFT init every client starts from (a TaskVector)
    for r in range(1, config.rounds + 1):
        state, record = fed.run_round(state, r)
        moved = (state.vectors["shared"] - init).norm()
        print(f"round {r}: clients {record['clients']}  train_loss {record['train_loss']:.4f}  "
              f"mean metric {record['mean_metric']:.3f}  bytes up {record['bytes_uplink']:,} "
              f"down {record['bytes_downlink']:,}  |shared - init| {moved:.4f}  {record['seconds']:.1f} s")
        if args.target is not None and record["mean_metric"] >= args.target:
            print(f"reached the target {args.target} after round {r}: stopping")
            break

    final = fed.evaluate(state)  # {task: {"accuracy": ..., "num_examples": ...}}
    for task in fed.tasks:
        scores = final[task.name]
        print(f"{task.name}: {task.metric} {scores[task.metric]:.3f} on {scores['num_examples']} test examples")
    return final


if __name__ == "__main__":
    main()
