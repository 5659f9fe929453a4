"""Tasks and the data layer: the builtin offline suites, loading any task reference, partitioning a
task's data among federated clients, and dataset cards/export.

The builtin tasks' declarations (`BUILTIN_TASKS`, `SUITES`) are light; the rest imports `datasets`
and is imported on first use (PEP 562 `__getattr__`), so that `RunConfig` and `hf-fedtask --help`
can name the suites without it."""

from hf_fedtask.core.lazy import lazy_attributes
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, SUITES, BuiltinTask

# name -> the module of hf_fedtask.data that defines it (imported on first use)
_LAZY = {
    "SUITE_VERSION": "builtin",
    "load_builtin_task": "builtin",
    "load_suite": "builtin",
    "build_federation": "partition",
    "classes_per_client": "partition",
    "dirichlet_classes": "partition",
    "iid": "partition",
    "task_allocation": "partition",
    "task_shares": "partition",
    "load_task": "sources",
    "export_suite": "suite_export",
    "task_card": "suite_export",
    "Task": "task",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

__all__ = ["BUILTIN_TASKS", "SUITES", "BuiltinTask", *_LAZY]
