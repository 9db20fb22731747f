"""A handler for tests/test_batching.py: records which thread ran each batch's `post`."""

from __future__ import annotations

import threading
import time
from typing import Any


class Threads:
    def __init__(self) -> None:
        self.names: list[str] = []

    def post(self, output: Any) -> Any:
        self.names.append(threading.current_thread().name)
        if float(output["total"].sum()) > 100:  # a "slow" item: 5 ms of work after the model
            time.sleep(0.005)
        return output


threads = Threads()
