"""Loading safetensors checkpoints into modules whose parameter names mirror the checkpoint.

Every model module in `engine.model` is laid out with the official parameter names, so loading is
one rule: each parameter and persistent buffer of the module must be in the file under
`prefix + name` with the same shape. A missing or mis-shaped tensor is an error naming it; a tensor
in the file that no module uses gets one warning listing it. F32, F16 and BF16 files are accepted and
converted to the module's dtype.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelFolderError

log = logging.getLogger(__name__)

_ACCEPTED_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8}


class WeightError(ModelFolderError):
    """A tensor the engine needs is missing from the checkpoint or has the wrong shape."""


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, on the CPU, in their stored dtype."""
    path = Path(path)
    if not path.is_file():
        raise ModelFolderError(f"missing file: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ModelFolderError(f"cannot read {path}: {e}") from e
    for name, t in tensors.items():
        if t.dtype not in _ACCEPTED_DTYPES:
            raise WeightError(f"{path}: tensor {name} has unsupported dtype {t.dtype}")
    return tensors


def load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str,
              source: str = "checkpoint") -> set[str]:
    """Copy `tensors[prefix + name]` into every parameter and persistent buffer of `module`.

    Returns the set of checkpoint keys used, so the caller can warn about the ones nobody used.
    """
    used = set()
    targets = dict(module.named_parameters())
    targets.update(module.state_dict(keep_vars=True))  # adds persistent buffers
    for name, target in targets.items():
        key = prefix + name
        if key not in tensors:
            raise WeightError(f"{source}: missing tensor {key} (expected shape {list(target.shape)})")
        src = tensors[key]
        if tuple(src.shape) != tuple(target.shape):
            raise WeightError(f"{source}: tensor {key} has shape {list(src.shape)}, expected {list(target.shape)}")
        with torch.no_grad():
            target.data.copy_(src.to(target.dtype))
        used.add(key)
    return used


def warn_unused(tensors: dict[str, torch.Tensor], used: set[str], source: str, ignore_prefixes: tuple = ()) -> None:
    unused = sorted(k for k in tensors if k not in used and not k.startswith(ignore_prefixes))
    if unused:
        shown = ", ".join(unused[:10]) + (f" ... (+{len(unused) - 10} more)" if len(unused) > 10 else "")
        log.warning("%s: %d unknown tensors skipped: %s", source, len(unused), shown)
