"""Our figures over the peers' from one device call's results.jsonl (bench/gpu_suite.sh prints them).

    python -m bench.ratios RESULTS_JSONL

Real-time factors at the same batch size (ours through the scheduler, `bench/throughput.py`, and
the peers', each the median over reps; ours per source tree when the call timed several, see
`TREES` in gpu_suite.sh, and per `defer_audio` setting), and our graphed decode step (`bench/breakdown.py`) against each peer's
time per frame step. A peer row missing from the file is left out.
"""
from __future__ import annotations

import argparse
import json
import statistics

OURS = "qwen3-tts-server"


def _label(row: dict) -> str:
    """What tells our runs apart: the run's tag (a source tree, a setting), and its `Scheduler.defer_audio`
    where not 0 (`bench.throughput --defer-audio` runs several in one process)."""
    defer = row.get("defer_audio") or 0
    return " ".join(filter(None, [row.get("tag", ""), f"defer_audio {defer}" if defer else ""]))


def ratios(rows: list[dict]) -> list[str]:
    runs = [r for r in rows if r.get("kind") == "run"]
    ours: dict[tuple[str, int], list[dict]] = {}
    reps: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if r["peer"] == OURS and r.get("mode") == "scheduler":
            ours.setdefault((_label(r), r["batch"]), []).append(r)
        elif r["peer"] != OURS and r.get("mode", "batch") in ("single", "batch"):
            reps.setdefault((r["peer"], r["batch"]), []).append(r)
    ours_rtf = {key: statistics.median(r["rtf_aggregate"] for r in rs) for key, rs in ours.items()}
    tags = sorted({tag for tag, _ in ours})
    steps = {r["batch"]: r["step_graph_ms"] for r in rows if r.get("kind") == "breakdown" and r["peer"] == OURS}
    peers = {key: {k: statistics.median(r[k] for r in rs) if rs[0].get(k) is not None else None
                   for k in ("rtf_aggregate", "ms_per_frame_step")} for key, rs in reps.items()}
    lines = []
    for (peer, batch), r in sorted(peers.items()):
        for tag in tags:
            if (tag, batch) in ours_rtf:
                rtf = ours_rtf[(tag, batch)]
                label = f" ({tag})" if len(tags) > 1 else ""
                lines.append(f"B={batch}: {rtf:.1f}x real time{label} vs {peer} "
                             f"{r['rtf_aggregate']:.2f}x: {rtf / r['rtf_aggregate']:.2f}x")
        if batch in steps and r.get("ms_per_frame_step"):
            lines.append(f"B={batch}: decode step {steps[batch]:.2f} ms vs {peer} {r['ms_per_frame_step']:.1f} ms "
                         f"per frame step: {r['ms_per_frame_step'] / steps[batch]:.1f}x shorter")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    args = ap.parse_args()
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print("\n".join(ratios(rows)) or "no rows to compare")


if __name__ == "__main__":
    main()
