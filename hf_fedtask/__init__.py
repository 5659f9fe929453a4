"""hf_fedtask: many-task federated fine-tuning with PEFT modules."""

__version__ = "0.1.0"
