"""hf_fedtask: many-task federated fine-tuning with PEFT modules."""

__version__ = "0.1.0"
__all__ = ["load_task_adapter"]


def __getattr__(name: str):
    # Imported on first use: it pulls in torch and peft, which `import hf_fedtask` should not.
    if name == "load_task_adapter":
        from .compact import load_task_adapter

        return load_task_adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
