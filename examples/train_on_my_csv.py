"""Train a federation on your own CSV file from Python, then find its adapter.

    python examples/train_on_my_csv.py                                  # writes a toy reviews.csv first
    python examples/train_on_my_csv.py --csv data/mine.csv --rounds 5 --output-dir runs/mine
    python examples/load_adapter.py runs/my-csv/adapters/reviews "a lovely phone" "a broken chair"

A CSV task needs an input column (`text`, `sentence`, `content`, `review`, `document`, `tweet`, `utterance`,
`question` or `prompt`) and a label column (`label`, `labels`, `class` or `answer`); labels may be strings. A
seeded, label-stratified 20% of the file becomes its test split, and the task is named after the file
(`reviews.csv` is the task `reviews`). Its training split is divided among `--num-clients` clients, which run
FedAvg on LoRA modules and a classification head over the default base model
(`sentence-transformers/all-MiniLM-L6-v2`, offline). The script prints each task's accuracy and where its stock
PEFT adapter is. `--rounds 1 --local-steps 1` makes a quick check run.
"""

import argparse
import csv
import random
from pathlib import Path

from hf_fedtask.config import RunConfig
from hf_fedtask.engine.run import run


def write_toy_csv(path: Path, rows: int = 200, seed: int = 0) -> Path:
    """A toy sentiment CSV: short product reviews with a `review` and a `label` column."""
    rng = random.Random(seed)
    words = {"positive": ["great", "lovely", "excellent", "superb", "wonderful", "handy"],
             "negative": ["awful", "terrible", "dull", "broken", "disappointing", "noisy"]}
    things = ["phone", "film", "meal", "hotel", "book", "game", "chair", "album"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "label"])
        for _ in range(rows):
            label = rng.choice(list(words))
            writer.writerow([f"a {rng.choice(words[label])} {rng.choice(things)}", label])
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="your CSV file (default: write a toy reviews.csv into --output-dir)")
    parser.add_argument("--output-dir", default="runs/my-csv", help="the run folder")
    parser.add_argument("--num-clients", type=int, default=4, help="clients sharing the task's training split")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=-1, help="optimizer steps per round (-1: one epoch)")
    parser.add_argument("--max-test-samples", type=int, default=None, help="score a seeded subset of the test split")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    args = parser.parse_args(argv)

    out = Path(args.output_dir)
    data = Path(args.csv) if args.csv else write_toy_csv(out.parent / f"{out.name}-data" / "reviews.csv")
    config = RunConfig(strategy="fedavg", tasks=[str(data)], num_clients=args.num_clients, rounds=args.rounds,
                       local_steps=args.local_steps, max_test_samples=args.max_test_samples,
                       output_dir=str(out))
    results = run(config, overwrite=args.overwrite)  # what `hf-fedtask run --tasks reviews.csv ...` does

    for task, r in results["tasks"].items():
        metric = r["metric"]
        print(f"{task}: {metric} {r[metric]:.3f} on {r['num_examples']} test examples (chance {r['chance']:.3f})")
        print(f"{task}: adapter {out / 'adapters' / task}  labels {', '.join(r['label_names'])}")
    print(f"mean {results['mean_metric']:.3f} after {results['rounds']} rounds; results in {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
