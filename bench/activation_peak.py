"""The vocoder's activation memory, modeled without a GPU: the most bytes of tensors alive at once
during one streaming window decode (what a CUDA graph's pool must hold, less cuDNN's workspaces and
the allocator's rounding), and the largest tensors alive then.

Runs on the meta device (shapes only, no data, seconds on a CPU) with the real decoder config; the
Triton kernels, which cannot run there, are replaced by what they allocate (their outputs). A
storage counts from the op that makes it until no tensor refers to it.

    python -m bench.activation_peak --batch 64 --window 8
"""
from __future__ import annotations

import argparse
import weakref
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import load_config
from engine.model import vocoder as vocoder_module

PRESET = Path(__file__).resolve().parents[1] / "engine" / "testing" / "configs" / "0.6b"
VIEWS = {"view", "_unsafe_view", "slice", "select", "transpose", "unsqueeze", "squeeze", "expand", "permute",
         "alias", "as_strided", "split", "unbind", "narrow", "detach", "t"}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under this mode that some tensor still refers to, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        self.made: dict[int, tuple[int, tuple, str]] = {}
        self.at_peak: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key not in self.refs:
                if func._opname in VIEWS:     # a view of a storage made outside (weights, stream state)
                    continue
                self.refs[key] = 0
                self.made[key] = (t.untyped_storage().nbytes(), tuple(t.shape), func._opname)
                self.live += self.made[key][0]
                if self.live > self.peak:
                    self.peak, self.at_peak = self.live, sorted(self.made.values(), reverse=True)[:6]
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.made.pop(key)[0]
            del self.refs[key]


def window_peak(model_dir: str | Path, batch: int, window: int) -> LiveBytes:
    """One window decode of `batch` streams on the meta device, the kernels' allocations in their stead:
    SnakeBeta's output (with the left context ahead), the residual tail's."""
    def snake_beta(x, log_alpha, log_beta, bias=None, left=None):
        return x.new_empty(*x.shape[:2], x.shape[2] + (0 if left is None else left.shape[-1]))

    with mock.patch.multiple(vocoder_module, snake_beta=snake_beta,
                             residual_tail=lambda x, y, *rest, **options: torch.empty_like(y)), \
            torch.device("meta"), torch.no_grad():
        vocoder = vocoder_module.Vocoder(load_config(model_dir).decoder).to(torch.bfloat16)
        streams = vocoder_module.VocoderStreams(vocoder, batch)
        codes = torch.zeros(batch, window, vocoder.num_codebooks, dtype=torch.long)
        with LiveBytes() as live:
            streams.decode(torch.arange(batch), codes)
    return live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(PRESET), help="a folder with config.json and speech_tokenizer/")
    ap.add_argument("--batch", type=int, default=64, help="streams in one window decode")
    ap.add_argument("--window", type=int, default=8, help="frames a window")
    args = ap.parse_args()
    live = window_peak(args.model_dir, args.batch, args.window)
    print(f"{args.batch} streams, {args.window}-frame window, bf16: at most {live.peak / 2**20:.1f} MiB of "
          f"tensors alive at once; the largest then:")
    for nbytes, shape, op in live.at_peak:
        print(f"  {nbytes / 2**20:8.1f} MiB  {list(shape)}  ({op})")


if __name__ == "__main__":
    main()
