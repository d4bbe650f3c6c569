"""Launching and tuning the Triton kernels, for every module of this package: Triton itself (None
on CPU-only installs), programmatic dependent launch, and the timing that picks each kernel's launch
config on the device it runs on.

Even at 5 kernels a layer a one-row decode step is ~550 kernels of a few microseconds, each paying a
launch gap after the one before. On Hopper and later the decode path's kernels are launched as
programmatic dependents (`PDL`): the GPU starts each while the one before still runs, and it waits
(griddepcontrol.wait, `dependent_launch_start`) before reading or writing anything. A code-predictor
step is such a chain from end to end: its layers, output head, and sampling (which writes the next
token's embedding as it picks). What a kernel reads that the kernel before does not write (weights,
older keys and values) it may ask L2 for before it waits (`prefetch_rows_l2`): their read from memory
overlaps the kernel before instead of following it. It may also load before its wait what was
written two or more kernels back (the older keys `decode_attention` may preload): the kernel before
let it launch only after its own wait, when the one before that had completed.

Launch configs are timed once per key (the kernel's shapes) on the GPU (`fastest`), as a CUDA graph
replays calls over copies of what the kernel streams from memory (`graph_time`): as a decode step's
graph runs them. Elsewhere the first config (or one given for Triton's interpreter) is taken. The
picks are kept on disk (`TuningCache`): a later process on the same GPU model, with the same kernels
and versions, takes them instead of timing again (a server's restart, the next benchmark).
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:      # CPU-only installs
    triton = tl = None

compiles = 0             # Triton kernel variants this process compiled (or loaded from the disk cache)


def _count_compiles() -> None:
    """Count each kernel variant Triton builds on first use: a variant first met while serving stalls
    the engine for as long as its compile takes (the scheduler logs the count with a slow iteration)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        return
    chained = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        global compiles
        compiles += 1
        return chained(**kwargs) if chained is not None else None
    knobs.runtime.jit_post_compile_hook = hook


if triton is not None:
    _count_compiles()

# Programmatic dependent launch of the decode path's kernels (above); QWEN3_TTS_PDL=0 turns it off.
PDL = os.environ.get("QWEN3_TTS_PDL", "1") != "0"
# With PDL, `linear` and `decode_attention` may ask L2 for their weights / older keys and values before
# they wait (see `prefetch_rows_l2`); QWEN3_TTS_PREFETCH=0: they never do.
PREFETCH = os.environ.get("QWEN3_TTS_PREFETCH", "1") != "0"


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(x: torch.Tensor, prefetch: bool | None = None) -> dict:
    """Launch options of a decode-path kernel for data on x's device: the `PDL` constexpr (the kernel
    waits for its predecessor first) and Triton's `launch_pdl`, on a GPU that has them; for a kernel
    with a `PREFETCH` constexpr (`prefetch` not None: whether that kernel wants it), that too: it asks L2
    for its data while it waits."""
    on = PDL and x.is_cuda and _pdl_capable(x.device)
    options = dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)
    return options if prefetch is None else dict(options, PREFETCH=on and PREFETCH and prefetch)

fastest_configs: dict = {}
fastest_times: dict = {}       # key -> milliseconds of its `fastest_configs` (timed keys only)
log = logging.getLogger(__name__)

# The configs `fastest` is about to time are first compiled side by side in threads (Triton releases
# the GIL while it compiles): on a fresh machine, most of the server's warm-up went to compiling them
# one after the other (~1.7 s each). QWEN3_TTS_PARALLEL_COMPILE=0 compiles each at its first launch.
PARALLEL_COMPILE = os.environ.get("QWEN3_TTS_PARALLEL_COMPILE", "1") != "0"


class TuningCache:
    """`fastest`'s picks on disk: one JSON file per GPU model, kernel sources (this package's files, where the
    configs are listed), Triton and PyTorch versions and QWEN3_TTS_* settings (`PDL` and the like change
    what is timed), so that any change starts a new file. A pick is taken only while it is still one of its
    key's configs. Each new pick is merged into the file, which is then replaced whole: processes sharing it
    lose at most a race's entry."""

    def __init__(self, folder: str):
        self.folder = folder
        self._path: str | None = None
        self._picks: dict | None = None
        self._write_failed = False

    def get(self, key) -> tuple[dict, float] | None:
        """(config, milliseconds) picked for `key` by an earlier timing, or None."""
        if self._picks is None:
            self._picks = self._read()
        entry = self._picks.get(repr(key))
        return (entry["config"], entry["ms"]) if entry is not None else None

    def put(self, key, config: dict, ms: float) -> None:
        self._picks = {**self._read(), repr(key): {"config": config, "ms": ms}}   # others' picks since kept too
        try:
            os.makedirs(self.folder, exist_ok=True)
            part = f"{self.path()}.{os.getpid()}"
            with open(part, "w") as f:
                json.dump(self._picks, f)
            os.replace(part, self.path())
        except OSError as e:
            if not self._write_failed:
                log.warning("launch configs are not kept for the next start: %s", e)
            self._write_failed = True

    def path(self) -> str:
        if self._path is None:
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            settings = sorted((k, v) for k, v in os.environ.items()
                              if k.startswith("QWEN3_TTS_") and k != "QWEN3_TTS_TUNING_CACHE")
            digest = hashlib.sha256(f"{props.name} sm{props.major}{props.minor} torch {torch.__version__} "
                                    f"triton {triton.__version__} {settings}".encode())
            for source in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.py"))):
                with open(source, "rb") as f:
                    digest.update(f.read())
            self._path = os.path.join(self.folder, f"launch-configs-{digest.hexdigest()[:16]}.json")
        return self._path

    def _read(self) -> dict:
        try:
            with open(self.path()) as f:
                picks = json.load(f)
            return picks if isinstance(picks, dict) else {}
        except (OSError, ValueError):
            return {}


def _tuning_cache() -> TuningCache | None:
    """QWEN3_TTS_TUNING_CACHE: the folder of the picks kept on disk (default: qwen3-tts-server in the
    user's cache folder); "0": none, every process times its configs."""
    folder = os.environ.get("QWEN3_TTS_TUNING_CACHE")
    if folder == "0":
        return None
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen3-tts-server")
    return TuningCache(folder or default)


tuning_cache = _tuning_cache()


def fastest(key, configs: list[dict], launch, copies=None, off_gpu: dict | None = None) -> dict:
    """The fastest launch config of a kernel for `key` (its shapes), timed once on the GPU (or picked by an
    earlier process: `tuning_cache`); the first config while a CUDA graph is being captured, and elsewhere
    (`off_gpu` where given: in Triton's interpreter, which runs a grid's programs one after another in
    Python, the fewer the better). launch(config, compile_only=False): runs the kernel with that config, or
    only compiles it. copies(): launch functions like `launch` over copies of what the kernel streams from
    memory (its weights, a cache's layers), together more than L2 holds: with them the configs are timed as
    a CUDA graph replays calls over the copies one after the other (`graph_time`), as a decode step's graph
    runs a layer's kernel after the one before, each on data not in L2. Without, each is timed eagerly by
    `triton.testing.do_bench`, which flushes L2 between runs."""
    best = fastest_configs.get(key)
    if best is None:
        if not torch.cuda.is_available():
            return off_gpu or configs[0]
        stored = tuning_cache.get(key) if tuning_cache is not None else None
        if stored is not None and stored[0] in configs:
            fastest_times[key] = stored[1]
            best = fastest_configs[key] = configs[configs.index(stored[0])]
            return best
        if torch.cuda.is_current_stream_capturing():
            return configs[0]
        compile_candidates(configs, launch)
        if copies is None:
            time = lambda c: triton.testing.do_bench(lambda: launch(c), warmup=2, rep=10)  # noqa: E731
        else:
            launches = copies()
            time = lambda c: graph_time(launches, c)  # noqa: E731
        times = [timed(time, c) for c in configs]
        fastest_times[key] = min(times)
        best = fastest_configs[key] = configs[times.index(fastest_times[key])]
        if tuning_cache is not None and math.isfinite(fastest_times[key]):
            tuning_cache.put(key, best, fastest_times[key])
    return best


def copies_beyond_l2(nbytes: int, device: torch.device, most: int = 64) -> int:
    """How many copies of `nbytes` of data together hold twice the GPU's L2 (at least 1, at most `most`)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, min(most, -(-2 * l2 // nbytes)))


GRAPH_TIMING_CALLS = 64      # calls a timing graph replays (cycling the copies): a replay of ~0.3 ms


def graph_time(launches: list, config: dict, replays: int = 7) -> float:
    """Milliseconds a call takes as a CUDA graph replays GRAPH_TIMING_CALLS calls with `config`, the
    functions of `launches` in turn (the median of `replays`). Dependent launches overlap each call
    with the one before, as in a decode step; launched from Python instead, calls of a few
    microseconds would be timed at the host's pace. Captured on a stream of the timing's own, errors
    local to this thread."""
    calls = [functools.partial(f, config) for f in launches] * -(-GRAPH_TIMING_CALLS // len(launches))
    for call in calls[:len(launches)]:      # compiles, and a config that does not build fails here
        call()
    stream = _timing_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for call in calls:
                call()
        finally:
            graph.capture_end()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
    torch.cuda.current_stream().wait_stream(stream)
    stream.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2] / len(calls)


@functools.cache
def _timing_stream(device: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


@functools.cache
def _compile_pool() -> ThreadPoolExecutor:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=min(32, cpus), thread_name_prefix="triton-compile")


def compile_candidates(configs: list[dict], launch) -> None:
    """Compile every config's kernel variant at once on a thread pool and wait for them all (Triton's
    `AsyncCompileMode`). Where that fails, parallel compiles are off for the process: each variant
    then compiles at its first launch, as it always may (a variant that does not compile fails there)."""
    global PARALLEL_COMPILE
    if not PARALLEL_COMPILE or len(configs) < 2:
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        with AsyncCompileMode(_compile_pool(), ignore_errors=True):
            for c in configs:
                launch(c, compile_only=True)
    except Exception as e:      # an older Triton, or an API that moved: lose the speed, not the kernels
        PARALLEL_COMPILE = False
        log.warning("parallel Triton compiles are off (%s: %s); kernels compile at first launch",
                    type(e).__name__, e)


def launch_kernel(kernel, grid: tuple, args: tuple, options: dict, compile_only: bool = False) -> None:
    """kernel[grid](*args, **options), or, with `compile_only`, only its compile (`compile_candidates`)."""
    if compile_only:
        kernel.warmup(*args, grid=grid, **options)
    else:
        kernel[grid](*args, **options)


def timed(time, config) -> float:
    """time(config): milliseconds of a launch with `config`; infinite for a config this GPU cannot
    build (too much shared memory, or a compile or ptxas failure on an architecture the configs were
    not tested on): the others are timed and the warm-up goes on."""
    try:
        return time(config)
    except (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError,
            triton.compiler.errors.CompilationError) as e:
        log.warning("kernel config %s does not build on this GPU (%s); timing the others", config, type(e).__name__)
        return float("inf")


if triton is not None:
    @triton.jit
    def dependent_launch_start(PDL: tl.constexpr):
        """A decode-path kernel's first statement: launched while the kernel before still runs (`PDL`),
        it waits for that one's results, then lets the next kernel launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_rows_l2(base, rows, row_len, stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """Ask L2 for the first `row_len` elements of rows [0, rows) at `base` (`stride` elements apart),
        one prefetch a 128-byte line. A decode-path kernel does this for what it will read that the
        kernel before it does not write (its weights, a cache's older keys) while it still waits for
        that kernel (`PDL`): the memory's latency is paid in the shadow of the kernel before."""
        LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth     # elements a line
        r = tl.minimum(tl.arange(0, BLOCK_ROWS), rows - 1)[:, None]
        for c0 in range(0, row_len, BLOCK_COLS):
            c = tl.minimum(c0 + tl.arange(0, BLOCK_COLS // LINE) * LINE, row_len - 1)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [(base + r * stride + c).to(tl.int64, bitcast=True)],
                                      dtype=tl.int32, is_pure=False, pack=1)

