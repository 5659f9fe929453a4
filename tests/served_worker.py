"""A warm client worker served on a thread of the test process, for the worker tests."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from hf_fedtask.engine.flower.worker import Worker


class ServedWorker:
    """A `Worker` serving `handle` in a thread of this process (its socket in `folder`, its log to `log`),
    recording the requests it handled."""

    def __init__(self, folder: Path, handle, log=sys.stderr, **options):
        self.path = str(folder / "w.sock")
        self.log = log
        self.worker = Worker(self.path, **options)
        self.worker.open()
        self.handle, self.requests = handle, []
        self.thread = threading.Thread(target=self.worker.serve, args=(self._counting, log), daemon=True)
        self.thread.start()

    def _counting(self, request):
        self.requests.append((request.client, request.instruction.kind, request.instruction.round))
        return self.handle(request)

    def close(self):
        self.worker.close()
        self.thread.join(5)
