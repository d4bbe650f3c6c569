"""bench/ratios.py: our figures over the peers' from one results file."""
from bench.ratios import ratios

ROWS = [
    {"peer": "qwen3-tts-server", "kind": "run", "mode": "scheduler", "batch": 1, "rtf_aggregate": 10.0},
    {"peer": "qwen3-tts-server", "kind": "breakdown", "batch": 1, "step_graph_ms": 4.0},
    {"peer": "qwen3-tts-server", "kind": "precision"},
    {"peer": "faster-qwen3-tts", "kind": "run", "mode": "single", "batch": 1, "rtf_aggregate": 3.0, "ms_per_frame_step": 20.0},
    {"peer": "faster-qwen3-tts", "kind": "run", "mode": "single", "batch": 1, "rtf_aggregate": 5.0, "ms_per_frame_step": 16.0},
    {"peer": "faster-qwen3-tts", "kind": "run", "mode": "single", "batch": 1, "rtf_aggregate": 4.0, "ms_per_frame_step": 18.0},
    {"peer": "faster-qwen3-tts", "kind": "run", "mode": "stream", "batch": 1, "rtf_aggregate": 1.0},
    {"peer": "qwen-tts", "kind": "run", "batch": 64, "rtf_aggregate": 30.0, "ms_per_frame_step": 300.0},
]


def test_ratios_use_the_peer_median_at_the_same_batch():
    assert ratios(ROWS) == [
        "B=1: 10.0x real time vs faster-qwen3-tts 4.00x: 2.50x",
        "B=1: decode step 4.00 ms vs faster-qwen3-tts 18.0 ms per frame step: 4.5x shorter",
    ]


def test_no_peer_no_lines():
    assert ratios(ROWS[:3]) == []


def test_our_reps_give_their_median_per_source_tree():
    ours = [{"peer": "qwen3-tts-server", "kind": "run", "mode": "scheduler", "batch": 1, "tag": tag, "rtf_aggregate": x}
            for tag, x in ((".", 12.0), (".", 20.0), (".", 16.0), (".device/old", 8.0))]
    assert ratios(ours + ROWS[3:6]) == [
        "B=1: 16.0x real time (.) vs faster-qwen3-tts 4.00x: 4.00x",
        "B=1: 8.0x real time (.device/old) vs faster-qwen3-tts 4.00x: 2.00x",
    ]


def test_our_runs_with_defer_audio_are_told_apart():
    ours = [{"peer": "qwen3-tts-server", "kind": "run", "mode": "scheduler", "batch": 1, "tag": ".", "defer_audio": d,
             "rtf_aggregate": x} for d, x in ((0, 12.0), (4, 14.0), (0, 16.0))]
    assert ratios(ours + ROWS[3:6]) == [
        "B=1: 14.0x real time (.) vs faster-qwen3-tts 4.00x: 3.50x",
        "B=1: 14.0x real time (. defer_audio 4) vs faster-qwen3-tts 4.00x: 3.50x",
    ]
