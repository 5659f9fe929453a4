"""Where the host model runs and in which precision: the one place that decides the device.

`resolve_device(config.device)` picks it once per process (Accelerate's own choice by default; this
rank's GPU under a multi-process launch); every batch then goes to `PeftHost.device`, and everything
that leaves the model (task vectors, uploads, checkpoints, exports, predictions) is a CPU tensor in
its declared dtype, so the server, the wire format and the numba merge kernels never see a device.

`Launch` reads the ranks of a multi-process launch (`torchrun`, `accelerate launch --multi_gpu`)
from the launcher's environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

from hf_fedtask.core.names import MIXED_PRECISIONS
from hf_fedtask.errors import ConfigError

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# what torchrun / accelerate launch / MPI launchers set, and what makes Accelerate (and so every
# Trainer) enter a distributed mode with DDP and sharded data loaders
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class Launch:
    """This process's place in a multi-process launch (a single process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def multi_process(self) -> bool:
        return self.world_size > 1


@lru_cache(maxsize=1)
def launch() -> Launch:
    """The launch this process belongs to, read once from the launcher's variables (torchrun and
    `accelerate launch` set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Launch()
    rank = int(env.get("RANK", "0"))
    local = int(env.get("LOCAL_RANK", str(rank)))
    return Launch(rank, world, local, int(env.get("LOCAL_WORLD_SIZE", str(world))))


def hide_launch_from_trainers() -> None:
    """Remove the launcher's rank variables from this process's environment (after `launch()` has read
    them): the federation owns the ranks, and each rank's Trainer must stay a single-process loop on
    its own device, training its own clients, instead of joining a DDP group that averages gradients
    over ranks training different clients (Accelerate enters one even for a single process whenever
    LOCAL_RANK is set, as `torchrun --nproc_per_node 1` sets it, and then shards the data loader)."""
    launch()
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto`: under a multi-process launch this rank's GPU (`cuda:LOCAL_RANK`) or the CPU; else
    Accelerate's own choice (`PartialState().device`: the GPU when one is visible, the CPU under
    `accelerate launch --cpu`). `cpu`, `cuda` (the current CUDA device; this rank's under a launch) or
    `cuda:N` as given, refused with one line when that device does not exist."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        here = launch()
        if here.multi_process:
            if not torch.cuda.is_available():
                return torch.device("cpu")
            return torch.device("cuda", here.local_rank % torch.cuda.device_count())
        from accelerate import PartialState

        device = PartialState().device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if not spec.startswith("cuda"):
        raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r}: torch sees no CUDA device here (torch {torch.__version__}); "
                          "use --device cpu or auto")
    device = torch.device(spec)
    count = torch.cuda.device_count()
    if device.index is None:  # under a multi-process launch, this rank's GPU
        index = launch().local_rank % count if launch().multi_process else torch.cuda.current_device()
        return torch.device("cuda", index)
    if device.index >= count:
        raise ConfigError(f"device {spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """Refuse, in one line, a precision the device cannot run (fp16 autocast needs a GPU; bf16 on a
    GPU needs one that supports it)."""
    if mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"mixed_precision: must be one of {', '.join(MIXED_PRECISIONS)}, got {mixed_precision!r}")
    if mixed_precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"mixed_precision fp16 needs a CUDA device (the model is on {device}); use bf16 on a CPU")
    if mixed_precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"mixed_precision bf16: {torch.cuda.get_device_name(device)} does not support bfloat16; "
                          "use fp16")


# bfloat16 arithmetic in hardware, by `torch.cpu.get_capabilities()`'s names: AVX512-BF16, AMX-BF16 or
# AVX-NE-CONVERT on x86, the BF16 / SVE-BF16 extensions on Arm
BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16", "sve_bf16")


def cpu_bf16_features() -> list[str]:
    """The bfloat16 instructions this CPU has (`BF16_CPU_FEATURES`, from `torch.cpu.get_capabilities`);
    empty where it has none, so that bf16 autocast on it is emulated through fp32 and runs slower."""
    capabilities = torch.cpu.get_capabilities()
    return [name for name in BF16_CPU_FEATURES if capabilities.get(name) is True]


def precision_in_words(mixed_precision: str, device: torch.device) -> str:
    """The precision a run computes in, as the run's start says it: fp32, or the autocast dtype with,
    on a CPU, whether bf16 is native (its instructions named) or emulated."""
    if mixed_precision == "no":
        return "fp32"
    words = f"{mixed_precision} autocast (task vectors, server state and aggregation stay fp32)"
    if device.type == "cpu" and mixed_precision == "bf16":
        native = cpu_bf16_features()
        words += (f"; native on this CPU ({', '.join(native)})" if native else
                  "; emulated on this CPU (no AVX512-BF16, AMX or Arm BF16 instructions): slower than fp32")
    return words


def autocast(device: torch.device, mixed_precision: str = "no") -> contextlib.AbstractContextManager:
    """torch's autocast for `mixed_precision` on `device` (a no-op context for "no"): what Accelerate
    wraps a Trainer's forward in, used for evaluation so it runs in the precision training did."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[mixed_precision])


def peak_gpu_memory() -> int | None:
    """Peak bytes allocated by torch on this process's CUDA devices (`torch.cuda.max_memory_allocated`),
    None where CUDA was never used."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))


def model_device(module: torch.nn.Module) -> torch.device:
    """The device of `module`'s parameters (its first one; the CPU for a module without any)."""
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def to_device(batch: Mapping, device: torch.device) -> dict:
    """`batch` with every tensor moved to `device` (the same tensors where they are there already, so
    a CPU run computes exactly what it did before devices existed)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of `tensor`, in its dtype (a clone on the CPU, a transfer from a device)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()
