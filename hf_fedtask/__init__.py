"""hf_fedtask: many-task federated fine-tuning with PEFT modules."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from hf_fedtask.core.lazy import lazy_attributes

__version__ = "0.1.0"
__all__ = ["LinearizedModel", "load_linearized", "load_task_adapter", "load_tct", "negate_task", "unlearn"]

_LAZY = {
    "load_task_adapter": "export.compact",
    "load_linearized": "export.linearized",
    "load_tct": "export.tct",
    "LinearizedModel": "model.linearize",
    "unlearn": "workflows.unlearn",
    "negate_task": "workflows.unlearn",
}


# Imported on first use: they pull in torch and peft, which `import hf_fedtask` should not.
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


# hf_fedtask's own PEFT method (the bottleneck adapter, `hf_fedtask.model.bottleneck`) registers itself
# with peft when imported, after which stock `PeftModel.from_pretrained` loads its adapters. So that
# `import hf_fedtask` is enough without importing torch and peft here (seconds, paid by every CLI
# call), the registration runs now if peft is already loaded, else right after peft's own import.


def _register_peft_methods() -> None:
    # also the small CNN's architecture (`hf_fedtask.model.small_cnn`) with transformers' Auto classes,
    # so that its exported adapters load with stock PeftModel.from_pretrained after `import hf_fedtask`
    for module in ("model.bottleneck", "model.small_cnn"):
        try:
            importlib.import_module(f"{__name__}.{module}")
        except (ImportError, AttributeError, TypeError, KeyError, ValueError) as e:  # never break `import peft`
            warnings.warn(f"hf_fedtask could not register {module} with peft/transformers: {e!r}", stacklevel=2)


class _RegisterAfterPeftImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: finds `peft` as usual and registers hf_fedtask's methods once it has loaded."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "peft":
            return None
        sys.meta_path.remove(self)  # one shot, and the lookup below must not come back here
        spec = importlib.util.find_spec("peft")
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_module_then_register(module):
                exec_module(module)
                _register_peft_methods()

            spec.loader.exec_module = exec_module_then_register
        return spec


if "peft" in sys.modules:
    _register_peft_methods()
elif not any(type(finder).__name__ == "_RegisterAfterPeftImport" for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterPeftImport())
