"""Cost of feeding image tasks to a small network: one epoch of the F²L² MLP (`hf-fedtask/small-mlp`) on
6,000 Fashion-MNIST (or, without the Debian package, scikit-learn digits) training images, batch 64, through
the data loader HF Trainer builds (with the inputs' collator), with the split prepared two ways by
`ImageInputs.prepare`:

* on access (the baseline, and still the path for splits above `PIXELS_IN_MEMORY`): every read decodes
  the PNG and runs the image processor on it;
* once (the default for small splits): processed once into a flat torch-formatted column the collator
  reshapes.

Both epochs see the same batches (the same tensors: checked) and run the same forward + backward + SGD
step; the time of the one-off processing is reported beside them. Rounds alternate the order; the ratio
is the median of per-round ratios. Goal: on access / once ≥ 2 on the whole epoch.

    python benchmarks/image_inputs.py             # 3 rounds, 2 threads
    python benchmarks/image_inputs.py --quick     # smoke run: 600 images, 1 round
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

GOAL = 2.0


def epoch(model, data, collator, batch_size: int) -> tuple[float, torch.Tensor]:
    """Seconds for one pass (forward + backward + SGD step per batch) and the first batch's pixels."""
    from torch.utils.data import DataLoader

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch_size, collate_fn=collator)
    first = None
    start = time.perf_counter()
    for batch in loader:
        first = batch["pixel_values"] if first is None else first
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 600 images, 1 round")
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    samples, rounds = (600, 1) if args.quick else (args.samples, args.rounds)
    torch.set_num_threads(args.threads)

    from hf_fedtask.data import load_task
    from hf_fedtask.data.images import fashion_mnist_available
    from hf_fedtask.model import backbone

    name = "fashion_mnist" if fashion_mnist_available() else "digits"
    task = load_task(name)
    raw = task.dataset["train"].select(range(min(samples, len(task.dataset["train"]))))
    ref = backbone.resolve_base_model("hf-fedtask/small-mlp")
    inputs = backbone.load_inputs(ref)
    began = time.perf_counter()
    once = inputs.prepare(raw, task)
    processing = time.perf_counter() - began
    limit, backbone.PIXELS_IN_MEMORY = backbone.PIXELS_IN_MEMORY, 0
    try:
        on_access = inputs.prepare(raw, task)
    finally:
        backbone.PIXELS_IN_MEMORY = limit
    assert "pixel_values" in once.features and "pixel_values" not in on_access.features
    model = backbone.load_classifier(ref, num_labels=len(task.label_names))
    ratios, times = [], {"once": [], "on access": []}
    for r in range(rounds):
        order = [("once", once), ("on access", on_access)][:: 1 if r % 2 == 0 else -1]
        seconds = {}
        firsts = {}
        for label, data in order:
            seconds[label], firsts[label] = epoch(model, data, inputs.collator, 64)
            times[label].append(seconds[label])
        assert torch.equal(firsts["once"], firsts["on access"]), "the two paths gave different pixels"
        ratios.append(seconds["on access"] / seconds["once"])
    ratio = statistics.median(ratios)
    print(f"{name}, {len(raw)} images, small-mlp, batch 64, {args.threads} threads, {rounds} round(s)")
    for label, values in times.items():
        print(f"  epoch, pixels processed {label}: median {statistics.median(values):.2f} s  {values}")
    print(f"  processing once (one-off): {processing:.2f} s")
    print(f"ratio on access / once: {ratio:.2f} (per round {[round(x, 2) for x in ratios]}); goal >= {GOAL}: "
          f"{'met' if ratio >= GOAL else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
