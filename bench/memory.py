"""Where the idle GPU memory goes: weights, per-slot state, each family of CUDA graphs.

Builds the engine as the server does (`--max-batch` slots, the server's warm-up kv span) and
measures PyTorch's tensors (`allocated`) and its allocator's total (`reserved`, blocks the eager
warm-up runs freed included until the last row empties the cache) after each part:
the loaded model, the scheduler's buffers, then the vocoder, decode-step and prefill graphs captured
one family at a time into the scheduler's one pool (what a replay's intermediates use, reserved for
as long as the graphs live). Each row also has the device's own count.

    python -m bench.memory --model-dir /tmp/rand06b --max-batch 256 --vocoder-batch 64
"""
from __future__ import annotations

import argparse

import torch

from app.service import WARMUP_KV_KEYS
from engine.loader import load_model
from engine.scheduler import VOCODER_BATCH, Scheduler
from bench.results import emit


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--vocoder-batch", type=int, default=VOCODER_BATCH,
                    help="most streams one vocoder graph replay decodes")
    ap.add_argument("--out", default=None, help="append JSON rows to this file")
    ap.add_argument("--tag", default="", help="a label for the rows (e.g. the environment setting measured)")
    args = ap.parse_args()

    last = {"alloc": 0, "reserved": 0}

    def row(part: str) -> None:
        torch.cuda.synchronize()
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        free, total = torch.cuda.mem_get_info()
        emit(dict(peer="qwen3-tts-server", kind="memory_part", tag=args.tag, part=part, max_batch=args.max_batch,
                  vocoder_batch=args.vocoder_batch,
                  alloc_gib=gib(alloc), reserved_gib=gib(reserved),
                  alloc_added_gib=gib(alloc - last["alloc"]), reserved_added_gib=gib(reserved - last["reserved"]),
                  device_used_gib=gib(total - free)), args.out)
        last.update(alloc=alloc, reserved=reserved)

    model = load_model(args.model_dir, device="cuda", dtype=torch.bfloat16)
    row("model")
    scheduler = Scheduler(model, max_batch=args.max_batch, vocoder_batch=args.vocoder_batch)
    row("scheduler buffers")
    runner, vocoder = scheduler.runner, scheduler.vocoder      # in `Scheduler.warmup`'s order
    with torch.no_grad():
        vocoder.capture()
        row(f"vocoder graphs ({len(vocoder.graphs.graphs)})")
        runner.graphs.capture(WARMUP_KV_KEYS)
        row(f"decode-step graphs ({len(runner.graphs.graphs)})")
        runner.prefill_graphs.capture()
        row(f"prefill graphs ({len(runner.prefill_graphs.graphs)})")
    torch.cuda.empty_cache()               # what stays is held by live tensors or the graphs' pool
    row("all, cache emptied")
    pools: dict = {}                                # the allocator's segments by pool: sizes and use
    for seg in torch.cuda.memory_snapshot():
        p = pools.setdefault(str(seg.get("segment_pool_id")), {"segments": 0, "total": 0, "allocated": 0, "largest": []})
        p["segments"] += 1
        p["total"] += seg["total_size"]
        p["allocated"] += seg["allocated_size"]
        p["largest"] = sorted(p["largest"] + [seg["total_size"] >> 20], reverse=True)[:8]
    for pool, p in pools.items():
        print(f"pool {pool}: {p['segments']} segments, {gib(p['total'])} GiB, {gib(p['allocated'])} GiB in use "
              f"now, largest segments (MiB) {p['largest']}", flush=True)


if __name__ == "__main__":
    main()
