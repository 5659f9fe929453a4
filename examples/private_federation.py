"""Train with client-level differential privacy and read the privacy spent from results.json.

    python examples/private_federation.py                                   # ε = 8 at δ = 1e-5, 16 clients
    python examples/private_federation.py --epsilon 2 --rounds 10 --output-dir runs/dp2
    python examples/private_federation.py --rounds 1 --local-steps 1 --builtin-train-size 64   # a quick check

Client-level DP (McMahan et al., ICLR 2018): each sampled client's whole upload is clipped to L2 norm `--clip`,
Gaussian noise of std σ·clip goes on every aggregated sum, and Google's dp-accounting gives ε at δ. With
`dp_epsilon` the noise multiplier σ is calibrated before training so that the whole run (its rounds and its
client sampling) spends the target ε. The noise and the sample come from secret os.urandom keys, so two runs
differ. The script prints the σ used, the ε spent and the accuracy, as results.json records them; every adapter's
model card carries the same in a "Differential privacy" section.
"""

import argparse
import json
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.engine.run import run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0, help="the target ε (dp_epsilon)")
    parser.add_argument("--delta", type=float, default=1e-5, help="the δ of (ε, δ) (dp_delta)")
    parser.add_argument("--clip", type=float, default=1.0, help="L2 norm each client's upload is clipped to (dp_clip)")
    parser.add_argument("--tasks", nargs="+", default=["vader_polarity", "first_name_gender"])
    parser.add_argument("--num-clients", type=int, default=16, help="clients; the tasks are spread over them")
    parser.add_argument("--participation", type=float, default=0.5, help="share of the clients sampled each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=-1, help="optimizer steps per round (-1: one epoch)")
    parser.add_argument("--builtin-train-size", type=int, default=None, help="training rows per builtin task")
    parser.add_argument("--max-test-samples", type=int, default=None, help="score a seeded subset of each test split")
    parser.add_argument("--output-dir", default="runs/private")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    args = parser.parse_args(argv)

    config = RunConfig(strategy="fedavg", tasks=args.tasks, num_clients=args.num_clients,
                       participation=args.participation, rounds=args.rounds, local_steps=args.local_steps,
                       builtin_train_size=args.builtin_train_size, max_test_samples=args.max_test_samples,
                       dp_clip=args.clip, dp_epsilon=args.epsilon, dp_delta=args.delta, output_dir=args.output_dir)
    run(config, overwrite=args.overwrite)

    results = json.loads((Path(args.output_dir) / "results.json").read_text())
    privacy = results["privacy"]
    print(f"noise multiplier σ {privacy['noise_multiplier']:.4f} (calibrated to target ε {args.epsilon:g}), "
          f"clip {privacy['clip']:g}, noise drawn on the {privacy['noise']}")
    print(f"privacy spent: ε = {privacy['epsilon']:.3f} at δ = {privacy['delta']:g} after {privacy['rounds']} rounds")
    clipped = privacy["mean_clipped_fraction"]
    print(f"mean accuracy {results['mean_metric']:.3f}; uploads clipped: "
          f"{'not reported' if clipped is None else f'{clipped:.0%}'}")
    print("sampling:", privacy["sampling"])
    print("published outside ε:", "; ".join(privacy["outside_epsilon"]))
    return results


if __name__ == "__main__":
    main()
