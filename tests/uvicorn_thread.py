"""An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread, for test servers."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from tests.backend.server.conftest import free_port


class UvicornThread:
    """``start()`` returns once the server listens (or fails after 10 s); ``stop()`` asks
    it to exit and joins its thread."""

    def __init__(self, app: Any, what: str = "the test server") -> None:
        self.what = what
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, f"{self.what} did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
