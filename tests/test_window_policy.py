"""The streaming vocoder's window policy, played against a simulated listener: turns made at any speed
from real time up never leave playback empty, and windows grow to the largest size when generation is
well ahead."""
import random

import numpy as np
import pytest

from engine.streaming import WindowPolicy

FRAME_S = 0.08


def play(policy, step_times, smoothing=0.3):
    """One turn whose frames take `step_times` seconds each to make, windows closed by `policy` (the
    step time estimated as the scheduler does); a listener plays each chunk from its arrival, one
    step after its window closed (the scheduler sends a window's audio once the next step has run).
    Returns (window sizes, underruns: chunks that arrived after the audio before them had played)."""
    t, step_s = 0.0, FRAME_S
    pending = decoded = underruns = 0
    first = end = None      # when the first window closed (the scheduler's reckoning), when playback ends
    windows = []
    for i, dt in enumerate(step_times):
        t += dt
        pending += 1
        held = decoded * FRAME_S - (t - first) if first is not None else 0.0
        if policy.due(np.array([pending]), np.array([decoded]), np.array([held]), step_s)[0]:
            arrival = t + step_times[min(i + 1, len(step_times) - 1)]
            if first is None:
                first, end = t, arrival
            elif arrival > end + 1e-9:
                underruns += 1
                end = arrival
            end += pending * FRAME_S
            decoded += pending
            windows.append(pending)
            pending = 0
        step_s += smoothing * (dt - step_s)
    return windows, underruns


@pytest.mark.parametrize("speed", [1.0, 1.05, 1.3, 1.6, 2.0, 3.0, 10.0, 100.0])
def test_steady_generation_at_or_above_real_time_never_runs_dry(speed):
    windows, underruns = play(WindowPolicy(2, 8), [FRAME_S / speed] * 300)
    assert underruns == 0, windows
    assert windows[0] == 2 and set(windows) <= {2, 4, 8}
    if speed == 1.0:
        assert set(windows) == {2}                # no slack to wait for a larger window
    if speed >= 3.0:
        assert windows[-10:] == [8] * 10          # far ahead: the largest, cheapest windows


def test_jittery_generation_faster_than_real_time_never_runs_dry():
    rng = random.Random(0)
    for _ in range(50):
        times = [rng.uniform(0.3, 0.95) * FRAME_S for _ in range(300)]
        windows, underruns = play(WindowPolicy(2, 8), times)
        assert underruns == 0, windows


def test_a_slow_step_now_and_then_does_not_run_playback_dry():
    """Steps at 3-5x real time with one in twenty taking 50-100 ms (admissions, a prefill, other
    sessions' first windows): the step-time average cannot see those coming; the policy's reserve
    covers them. Without it the same turns run dry now and then."""
    rng = random.Random(0)
    turns = [[rng.uniform(0.2, 0.4) * FRAME_S if rng.random() > 0.05 else rng.uniform(0.6, 1.2) * FRAME_S
              for _ in range(150)] for _ in range(300)]
    assert sum(play(WindowPolicy(2, 8), times)[1] for times in turns) == 0
    assert sum(play(WindowPolicy(2, 8, reserve_s=0.0), times)[1] > 0 for times in turns) >= 2


def test_windows_grow_once_generation_gets_ahead():
    windows, underruns = play(WindowPolicy(2, 8), [FRAME_S] * 50 + [FRAME_S / 4] * 100)
    assert underruns == 0
    assert set(windows[:20]) == {2} and windows[-5:] == [8] * 5


def test_sizes_and_first_window():
    assert WindowPolicy(2, 8).sizes() == [2, 4, 8]
    assert WindowPolicy(1, 3).sizes() == [1, 2, 3]
    assert WindowPolicy(4, 2).sizes() == [4]
    p = WindowPolicy(2, 8)
    # the first window closes at `first` frames whatever the listener holds (nothing yet)
    assert list(p.due(np.array([1, 2, 2]), np.array([0, 0, 0]), np.array([0.0, 0.0, 5.0]), 0.01)) == [False, True, True]
    # later windows: only at a size, and at the largest whatever the buffer
    due = p.due(np.array([2, 3, 4, 8]), np.array([2, 2, 2, 2]), np.array([10.0, 0.0, 10.0, 10.0]), 0.01)
    assert list(due) == [False, False, False, True]
    with pytest.raises(ValueError):
        WindowPolicy(0, 8)
    with pytest.raises(ValueError):
        WindowPolicy(2, 8, reserve_s=-0.01)
