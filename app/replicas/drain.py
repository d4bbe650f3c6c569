"""uvicorn that drains on SIGTERM: what a replica behind a load balancer, and the router, need.

Plain uvicorn, on SIGTERM, stops listening and closes every open WebSocket with 1012 at once: each
live call is cut mid-sentence. Here the first SIGTERM/SIGINT only calls `begin_drain()` (the app then
answers /ready with 503 and refuses new sessions, so load balancers and the router send them
elsewhere) and the server keeps running until `open_sessions()` is 0 or `drain_timeout` seconds have
passed; then it shuts down as usual. A second signal shuts down at once. With `end_sessions`, the
deadline first calls it (the app closes its sessions itself, e.g. WebSockets with 1001 rather than
uvicorn's 1012) and shuts down once they are closed, or `END_GRACE_S` later.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import uvicorn

log = logging.getLogger("qwen3_tts.drain")

END_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[], None],
                 open_sessions: Callable[[], int], drain_timeout: float,
                 end_sessions: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.begin_drain = begin_drain
        self.open_sessions = open_sessions
        self.drain_timeout = drain_timeout
        self.end_sessions = end_sessions
        self.deadline: float | None = None
        self.ended_at: float | None = None

    def handle_exit(self, sig, frame):
        if self.deadline is None and (self.drain_timeout > 0 or self.end_sessions) and not self.should_exit:
            self.deadline = time.monotonic() + self.drain_timeout
            self.begin_drain()
            log.info("draining: %d open sessions, at most %.0f s", self.open_sessions(), self.drain_timeout)
        else:
            self.force_exit = self.should_exit
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        now = time.monotonic()
        if self.deadline is None or self.should_exit:
            pass
        elif self.open_sessions() == 0 or (self.ended_at is not None and now >= self.ended_at + END_GRACE_S):
            self.should_exit = True
        elif now >= self.deadline and self.ended_at is None:
            if self.end_sessions is None:
                self.should_exit = True
            else:
                log.info("drain deadline: closing %d open sessions", self.open_sessions())
                self.ended_at = now
                self.end_sessions()
        return await super().on_tick(counter)
