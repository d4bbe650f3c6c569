"""One server per GPU on this host, with the router in front of them on one port.

    python -m app.replicas.launcher --gpus all --port 8090 --base-port 8091 --model-dir models/0.6b-base
    python -m app.replicas.launcher --replicas 2 --device cpu --demo

Replica i listens on `--replica-host`:(`--base-port` + i) and sees only its own GPU: its
CUDA_VISIBLE_DEVICES is that one entry of the launcher's (which it honours, UUIDs and MIG ids
included), so its CUDA context, its memory-sized batch and its CUDA graphs belong to that GPU alone.
The router listens on `--host`:`--port`. Flags the launcher does not know go to every server as given.

SIGTERM or SIGINT goes to every child at once: each replica stops as the server does on SIGTERM,
the router stops placing new sessions and waits for those it proxies to end; a second signal (a
second or more after the first) kills them all. The launcher restarts nothing (leave that to
systemd or Kubernetes): a replica that dies leaves the rotation, since the router stops routing to
it; when every replica or the router is gone, the rest are stopped and the launcher exits non-zero.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("qwen3_tts.launcher")
REPEAT_S = 1.0  # a signal this soon after the first is the same one again (sent to the process group too)


def visible_gpus() -> list[str]:
    """The devices this process may use, as CUDA_VISIBLE_DEVICES entries."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    entries = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry or entry.startswith("-"):
            break  # CUDA ignores everything from the first invalid entry on
        entries.append(entry)
    return entries


def plan(args, server_args: list[str]) -> list[tuple[list[str], dict]]:
    """(command, environment) of each replica."""
    if args.device == "cpu":
        devices = [None] * (args.replicas or 1)
    else:
        gpus = visible_gpus()
        if args.gpus != "all":
            if int(args.gpus) > len(gpus):
                raise SystemExit(f"--gpus {args.gpus}: only {len(gpus)} visible ({','.join(gpus) or 'none'})")
            gpus = gpus[:int(args.gpus)]
        if not gpus:
            raise SystemExit("no GPU visible; use --device cpu --replicas N to run on the CPU")
        devices = gpus
    threads = str(max(1, (os.cpu_count() or 1) // len(devices)))
    out = []
    for i, gpu in enumerate(devices):
        env = dict(os.environ)
        if gpu is None:
            env.setdefault("OMP_NUM_THREADS", threads)  # N processes share the cores
        else:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "app", "--host", args.replica_host, "--port", str(args.base_port + i),
               "--device", "cpu" if gpu is None else "cuda:0", *server_args]
        out.append((cmd, env))
    return out


def _die_with_parent() -> None:
    """In the child: get SIGTERM (and so drain) if the launcher itself dies without forwarding it."""
    libc = ctypes.util.find_library("c")
    if libc and sys.platform.startswith("linux"):
        ctypes.CDLL(libc).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(cmd: list[str], env: dict) -> subprocess.Popen:
    # Own process group: a Ctrl-C in the terminal reaches the launcher only, which then stops the
    # children in order instead of all of them getting SIGINT at the same instant.
    return subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=_die_with_parent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.replicas.launcher", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False,  # a server flag must never be taken for an abbreviation
                                epilog="Other flags (--model-dir, --max-batch, --demo, ...) go to every server.")
    p.add_argument("--gpus", default="all", help="'all' visible GPUs or the first N of them")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (one replica per GPU; the default when a GPU is visible) or cpu")
    p.add_argument("--replicas", type=int, default=None, help="with --device cpu: how many replicas")
    p.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"), help="router address")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8090)), help="router port")
    p.add_argument("--base-port", type=int, default=8091, help="replica i listens on base-port + i")
    p.add_argument("--replica-host", default="127.0.0.1", help="replica address (the router is the front door)")
    p.add_argument("--api-key", default=os.environ.get("API_KEY"), help="given to the servers and the router")
    p.add_argument("--drain-timeout", type=float, default=float(os.environ.get("DRAIN_TIMEOUT", 30)),
                   help="router: seconds to let proxied sessions finish after SIGTERM")
    args, server_args = p.parse_known_args(argv)
    if args.device is None:
        args.device = "cpu" if args.replicas else "cuda" if visible_gpus() else "cpu"
    if args.replicas and args.device != "cpu":
        p.error("--replicas is for --device cpu; on GPUs there is one replica per GPU (--gpus)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    env = dict(os.environ)
    if args.api_key:
        env["API_KEY"] = args.api_key  # by environment, so it does not show in `ps`
    replicas = []
    for i, (cmd, replica_env) in enumerate(plan(args, server_args)):
        if args.api_key:
            replica_env["API_KEY"] = args.api_key
        replicas.append(_spawn(cmd, replica_env))
        log.info("replica %d: pid %d, %s, http://%s:%d", i, replicas[-1].pid,
                 f"GPU {replica_env['CUDA_VISIBLE_DEVICES']}" if args.device != "cpu" else "cpu",
                 args.replica_host, args.base_port + i)
    urls = [f"http://{args.replica_host}:{args.base_port + i}" for i in range(len(replicas))]
    router = _spawn([sys.executable, "-m", "app.replicas.router", "--host", args.host, "--port", str(args.port),
                     "--drain-timeout", str(args.drain_timeout), *(a for u in urls for a in ("--replica", u))], env)
    log.info("router: pid %d, http://%s:%d", router.pid, args.host, args.port)
    return supervise(replicas, router)


def supervise(replicas: list[subprocess.Popen], router: subprocess.Popen) -> int:
    """Forward signals, report deaths, and return once every child has exited."""
    children = [*replicas, router]
    state = {"first_signal": None, "killing": False, "failed": False}

    def stop_all(sig=signal.SIGTERM):
        for child in children:
            if child.poll() is None:
                child.send_signal(sig)

    def on_signal(sig, frame):
        now = time.monotonic()
        if state["first_signal"] is None:
            state["first_signal"] = now
            log.info("signal %d: draining", sig)
            stop_all()
        elif now - state["first_signal"] > REPEAT_S and not state["killing"]:
            state["killing"] = True
            log.info("signal %d again: killing", sig)
            stop_all(signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reported = set()
    while True:
        for i, child in enumerate(children):
            if child.poll() is not None and i not in reported:
                reported.add(i)
                name = "router" if child is router else f"replica {i}"
                (log.info if state["first_signal"] else log.error)("%s exited with status %d", name, child.returncode)
        if len(reported) == len(children):
            return 1 if state["failed"] else 0
        if state["first_signal"] is None and not state["failed"] and (
                router.poll() is not None or all(r.poll() is not None for r in replicas)):
            state["failed"] = True
            log.error("nothing left to serve with: stopping")
            stop_all()
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
