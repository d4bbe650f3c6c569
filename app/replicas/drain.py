"""uvicorn that drains on SIGTERM: what a replica behind a load balancer, and the router, need.

Plain uvicorn, on SIGTERM, stops listening and closes every open WebSocket with 1012 at once: each
live call is cut mid-sentence. Here the first SIGTERM/SIGINT only calls `begin_drain()` (the app then
answers /ready with 503 and refuses new sessions, so load balancers and the router send them
elsewhere) and the server keeps running until `open_sessions()` is 0 or `drain_timeout` seconds have
passed; then it shuts down as usual. A second signal shuts down at once.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import uvicorn

log = logging.getLogger("qwen3_tts.drain")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[], None],
                 open_sessions: Callable[[], int], drain_timeout: float):
        super().__init__(config)
        self.begin_drain = begin_drain
        self.open_sessions = open_sessions
        self.drain_timeout = drain_timeout
        self.deadline: float | None = None

    def handle_exit(self, sig, frame):
        if self.deadline is None and self.drain_timeout > 0 and not self.should_exit:
            self.deadline = time.monotonic() + self.drain_timeout
            self.begin_drain()
            log.info("draining: %d open sessions, at most %.0f s", self.open_sessions(), self.drain_timeout)
        else:
            self.force_exit = self.should_exit
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and (self.open_sessions() == 0 or time.monotonic() >= self.deadline):
            self.should_exit = True
        return await super().on_tick(counter)
