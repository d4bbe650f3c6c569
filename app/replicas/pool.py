"""The replicas a router can send work to, and how loaded each one is.

Each replica reports its own load on `/health` (`active_sessions`, `queue_depth`, `max_batch`) and its
willingness to take work on `/ready` (503 while loading or draining). The pool polls both every
`interval` seconds and places new work on the ready replica with the smallest load relative to its
batch size. Between two polls the reported numbers lag behind what this router just placed, so the
load also counts sessions routed since the last poll and those this router holds open right now:
two sessions opened in the same instant go to two different replicas.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("qwen3_tts.replicas")


@dataclass(eq=False)
class Replica:
    """One server process, known by its base URL (`http://host:port`)."""

    url: str
    ready: bool = False
    active_sessions: int = 0
    queue_depth: int = 0
    max_batch: int = 1
    model: str | None = None
    last_ok: float = float("-inf")  # monotonic time of the last successful poll
    open: int = 0                   # sessions and requests this router proxies to it now
    routed_since_poll: int = 0      # placed here after the last poll was sent
    last_picked: int = 0            # pick counter when it last got work (tie-break: least recent)
    routed: dict = field(default_factory=lambda: {"ws": 0, "http": 0})

    def load(self) -> float:
        reported = self.active_sessions + self.queue_depth + self.routed_since_poll
        return max(reported, self.open) / max(1, self.max_batch)

    def describe(self) -> dict:
        return {"url": self.url, "ready": self.ready, "active_sessions": self.active_sessions,
                "queue_depth": self.queue_depth, "max_batch": self.max_batch, "open": self.open,
                "load": round(self.load(), 4)}


class Pool:
    """Replica state kept fresh by `run()`; `pick`/`acquire`/`release` place work on it.

    `urls` are fixed replicas; `discover` names `host:port` pairs whose DNS records are the replicas
    (a Kubernetes headless Service), re-resolved every `resolve_every` seconds.
    """

    def __init__(self, urls=(), discover=(), interval: float = 0.5, timeout: float = 2.0,
                 api_key: str | None = None, resolve_every: float = 5.0):
        self.replicas: dict[str, Replica] = {u.rstrip("/"): Replica(u.rstrip("/")) for u in urls}
        self.discover = [_split_host_port(d) for d in discover]
        self.interval = interval
        self.timeout = timeout
        self.stale_after = max(3 * interval, 2 * timeout)
        self.resolve_every = resolve_every
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.rejected = {"ws": 0, "http": 0}
        self.open_total = 0  # also counts replicas that have left discovery with sessions still open
        self.polled = asyncio.Event()  # set after every completed poll round
        self._picks = 0

    # -- placement -------------------------------------------------------------------------------

    def routable(self, replica: Replica, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return replica.ready and now - replica.last_ok <= self.stale_after

    def pick(self, exclude=()) -> Replica | None:
        """The least-loaded routable replica not in `exclude` (URLs), or None."""
        now = time.monotonic()
        candidates = [r for r in self.replicas.values() if r.url not in exclude and self.routable(r, now)]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.load(), r.last_picked))

    def acquire(self, replica: Replica, kind: str) -> None:
        self._picks += 1
        replica.last_picked = self._picks
        replica.open += 1
        self.open_total += 1
        replica.routed_since_poll += 1
        replica.routed[kind] += 1

    def release(self, replica: Replica) -> None:
        replica.open -= 1
        self.open_total -= 1

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Stop routing to it until a poll finds it ready again (a connect to it just failed)."""
        if replica.ready:
            log.warning("replica %s marked down: %s", replica.url, reason)
        replica.ready = False

    def totals(self) -> dict:
        ready = [r for r in self.replicas.values() if self.routable(r)]
        return {"ready_replicas": len(ready), "active_sessions": sum(r.active_sessions for r in self.replicas.values()),
                "queue_depth": sum(r.queue_depth for r in self.replicas.values()),
                "max_batch": sum(r.max_batch for r in ready)}

    # -- polling ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        next_resolve = 0.0
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            while True:
                if self.discover and time.monotonic() >= next_resolve:
                    await self._resolve()
                    next_resolve = time.monotonic() + self.resolve_every
                await asyncio.gather(*(self._poll(client, r) for r in list(self.replicas.values())))
                self.polled.set()
                self.polled.clear()
                await asyncio.sleep(self.interval)

    async def wait_polled(self, rounds: int = 1) -> None:
        """Return after `rounds` more poll rounds have completed (for tests and startup)."""
        for _ in range(rounds):
            await self.polled.wait()

    async def _poll(self, client: httpx.AsyncClient, replica: Replica) -> None:
        placed = replica.routed_since_poll
        try:
            health, ready = await asyncio.gather(client.get(replica.url + "/health"),
                                                 client.get(replica.url + "/ready"))
            info = health.json()
            replica.active_sessions = int(info.get("active_sessions", 0))
            replica.queue_depth = int(info.get("queue_depth", 0))
            replica.max_batch = max(1, int(info.get("max_batch") or 1))
            replica.model = info.get("model")
            now_ready = health.status_code == 200 and info.get("status") == "ok" and ready.status_code == 200
            if now_ready != replica.ready:
                log.info("replica %s %s", replica.url, "ready" if now_ready else f"not ready ({ready.status_code})")
            replica.ready = now_ready
            replica.last_ok = time.monotonic()
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:
            if replica.ready:
                log.warning("replica %s failed its health poll: %r", replica.url, e)
            replica.ready = False
        replica.routed_since_poll = max(0, replica.routed_since_poll - placed)

    async def _resolve(self) -> None:
        """Make the replica set equal to what the discovery names resolve to now."""
        loop = asyncio.get_running_loop()
        found: set[str] = set()
        for host, port in self.discover:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("cannot resolve %s: %s", host, e)
                return  # keep the current set rather than dropping every replica on a DNS hiccup
            for family, _, _, _, addr in infos:
                ip = f"[{addr[0]}]" if family == socket.AF_INET6 else addr[0]
                found.add(f"http://{ip}:{addr[1]}")
        for url in found - self.replicas.keys():
            log.info("discovered replica %s", url)
            self.replicas[url] = Replica(url)
        for url in self.replicas.keys() - found:
            log.info("replica %s left discovery", url)
            del self.replicas[url]  # sessions already proxied to it keep their own connections


def _split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)
