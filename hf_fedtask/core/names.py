"""The names that settings used across layers may take (partitions, output spaces, mixed precisions,
linearizations, rescalers). They live in this module, which imports nothing, so that `RunConfig`, the strategy
configs and `hf-fedtask --help` can check and document them without importing torch, datasets or
transformers. The modules that implement them import them from here."""

PARTITIONS = ("iid", "dirichlet", "classes")  # hf_fedtask.data.partition
PER_TASK, MAX, UNION = "per_task", "max", "union"
OUTPUT_SPACES = (PER_TASK, MAX, UNION)  # hf_fedtask.model.output_space
MIXED_PRECISIONS = ("no", "bf16", "fp16")  # Accelerate's names (hf_fedtask.model.device)
BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")  # bitsandbytes 4-bit data types (BitsAndBytesConfig.bnb_4bit_quant_type)
LINEARIZATIONS = ("network", "lora_layers")  # hf_fedtask.model.linearize.MODES
RESCALERS = ("global_sum", "per_tensor_mean")  # hf_fedtask.merge.unify
BAD_UPLOADS = ("drop", "stop")  # hf_fedtask.engine.trust: what a round does with a refused reply
# Accelerate's trackers (`accelerate.utils.LoggerType`) and the packages each needs, so `report_to` is checked
# before torch is imported (tests/test_first_hour.py holds both to Accelerate's own lists)
TRACKER_PACKAGES = {"aim": ("aim",), "tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",),
                    "trackio": ("trackio",), "comet_ml": ("comet_ml",), "mlflow": ("mlflow",),
                    "clearml": ("clearml",), "dvclive": ("dvclive",), "swanlab": ("swanlab",)}
