"""Tasks and the data layer: the builtin offline suites, loading any task reference, partitioning a
task's data among federated clients, and dataset cards/export."""

from hf_fedtask.data.builtin import SUITE_VERSION, load_builtin_task, load_suite
from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, SUITES, BuiltinTask
from hf_fedtask.data.partition import (
    build_federation,
    classes_per_client,
    dirichlet_classes,
    iid,
    task_allocation,
    task_shares,
)
from hf_fedtask.data.sources import load_task
from hf_fedtask.data.suite_export import export_suite, task_card
from hf_fedtask.data.task import Task

__all__ = [
    "BUILTIN_TASKS",
    "SUITES",
    "SUITE_VERSION",
    "BuiltinTask",
    "Task",
    "build_federation",
    "classes_per_client",
    "dirichlet_classes",
    "export_suite",
    "iid",
    "load_builtin_task",
    "load_suite",
    "load_task",
    "task_allocation",
    "task_card",
    "task_shares",
]
