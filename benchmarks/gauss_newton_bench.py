"""F²L²'s removal solve with the Jacobian formed once (`hf_fedtask.model.newton.JacobianGaussNewton`, what
`hessian` picks when J fits its byte budget) against the matrix-free products (`GaussNewton`: a forward
pass with a jvp and a backward pass over the server's slice per product), on the same model, slice and
right-hand side, in one process; the two must agree.

    python benchmarks/gauss_newton_bench.py             # MiniLM probe and MiniLM + LoRA, 320 server texts
    python benchmarks/gauss_newton_bench.py --quick     # one repeat, fewer products

The workload is a removal's: Lanczos for λ_max (30 products at most) and one conjugate-gradient solve
of (H + λI)·x = g with λ = 0.002·λ_max (200 products at most, relative residual 1e-6). Prints, per
model: J's size, the seconds of each method (medians over alternating repeats; the Jacobian's include
forming it), the relative difference of λ_max and of the solutions, and a RATIO line (matrix-free over
Jacobian time; goal ≥ 10×). The MLP of the
paper's table (84,000 parameters, 900 server images, 10 classes: a 3 GB Jacobian) stays matrix-free.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from hf_fedtask.config import RunConfig  # noqa: E402
from hf_fedtask.core.state import SHARED  # noqa: E402
from hf_fedtask.core.taskvector import TaskVector  # noqa: E402
from hf_fedtask.engine.environment import Environment  # noqa: E402
from hf_fedtask.model.newton import (  # noqa: E402
    GaussNewton,
    JacobianGaussNewton,
    conjugate_gradient,
    hessian,
    largest_eigenvalue,
)


def workload(products, g: TaskVector, eigen_iterations: int, cg_iterations: int) -> tuple[float, TaskVector, int]:
    """λ_max by Lanczos, then the damped solve: (λ_max, x, CG iterations)."""
    lambda_max, _ = largest_eigenvalue(products, g, iterations=eigen_iterations, seed=0)
    x, info = conjugate_gradient(products, g, damping=0.002 * lambda_max, iterations=cg_iterations, tolerance=1e-6)
    return lambda_max, x, info.iterations


def measure(name: str, tag: str, peft_method: str, repeats: int, eigen_iterations: int, cg_iterations: int) -> None:
    env = Environment(RunConfig(tasks=["vader_polarity"], suite=None,
                                base_model="sentence-transformers/all-MiniLM-L6-v2", peft_method=peft_method,
                                strategy="f2l2", num_clients=3, builtin_train_size=3200, max_length=32,
                                eval_batch_size=512, seed=0))
    task = env.tasks[0].name
    gen = torch.Generator().manual_seed(0)
    start = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    point = start + TaskVector({k: 0.05 * torch.randn(t.shape, generator=gen) for k, t in start.items()})
    g = TaskVector({k: torch.randn(t.shape, generator=gen) for k, t in point.items()})
    data = env.server_data(task)
    formed = hessian(env.host, point, data, env.config.eval_batch_size)
    if not isinstance(formed, JacobianGaussNewton):
        print(f"{name}: the Jacobian does not fit the budget; nothing to compare")
        return
    times = {"matrix-free": [], "jacobian": []}
    results = {}
    for _ in range(repeats):
        for method in times:
            begin = time.perf_counter()
            operator = (GaussNewton(env.host, point, data, env.config.eval_batch_size) if method == "matrix-free"
                        else JacobianGaussNewton(env.host, point, data, formed.outputs))
            with operator as products:
                results[method] = workload(products, g, eigen_iterations, cg_iterations)
            times[method].append(time.perf_counter() - begin)
    (lam_free, x_free, it_free), (lam_jac, x_jac, it_jac) = results["matrix-free"], results["jacobian"]
    free, jac = statistics.median(times["matrix-free"]), statistics.median(times["jacobian"])
    parameters = sum(t.numel() for t in point.values())
    print(f"{name}: {len(data)} server texts × {formed.outputs} classes × {parameters:,} parameters "
          f"(J {len(data) * formed.outputs * parameters * 4 / 2**20:.0f} MiB); matrix-free {free:.2f} s "
          f"({it_free} CG iterations), Jacobian {jac:.2f} s ({it_jac}): {free / jac:.1f}× faster; "
          f"λ_max differs by {abs(lam_free - lam_jac) / lam_free:.1e}, the solutions by "
          f"{(x_free - x_jac).norm() / x_free.norm():.1e} (relative)")
    print(f"RATIO {tag} matrix-free/jacobian removal time = {free / jac:.2f} (goal >= 10)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, 10 Lanczos and 50 CG products at most")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    repeats, eigen, cg = (1, 10, 50) if args.quick else (3, 30, 200)
    print(f"torch threads: {torch.get_num_threads()}; {repeats} repeat(s), medians")
    for name, tag, method in (("MiniLM probe", "minilm-probe", "probe"), ("MiniLM + LoRA", "minilm-lora", "lora")):
        measure(name, tag, method, repeats, eigen, cg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
