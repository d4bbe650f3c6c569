"""A random-weight model folder in the original Hugging Face layout, built with the engine's modules.

    python -m engine.testing.random_model --preset tiny|0.6b --seed N --out DIR [--bf16]

`0.6b` has the real sizes (the configs of Qwen/Qwen3-TTS-12Hz-0.6B-Base): for speed work without the
weights. `tiny` has the sizes of the golden tiny model: for tests and `qwen3-tts-server --demo`. The
configs and the real tokenizer files ship in `configs/` beside this file (vocab and merges once, for
both presets), so nothing outside the repo is needed.

Weights are PyTorch's default init drawn from `torch.manual_seed(seed)` on the CPU (the same folder on
any machine), plus what default init leaves degenerate: codebook sums (zeros would make every code
decode alike) get unit normals, the vocoder's biases are zeroed (they would drown the codes) and its
last conv is scaled so that random codes peak at about half of full scale instead of clipping. Tensors the official checkpoint has but the engine
never builds (RVQ projections of the other direction, Mimi's unused acoustic levels) are written too,
so the folder has the official tensor names and shapes.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import ModelConfig, load_config
from ..model.codec_encoder import CodecEncoder
from ..model.speaker import SpeakerEncoder
from ..model.talker import Talker
from ..model.vocoder import Vocoder

CONFIGS = Path(__file__).resolve().parent / "configs"
PRESETS = ("tiny", "0.6b")
PEAK = 0.5


def copy_configs(preset: str, out: Path, overrides: dict[str, dict] | None = None) -> None:
    """The preset's config.json files plus the files common to both presets, in the HF layout;
    `overrides` maps a config file's relative path to values merged into it (nested dicts merge)."""
    for src_root in (CONFIGS / "common", CONFIGS / preset):
        for src in src_root.rglob("*"):
            if src.is_file():
                dst = out / src.relative_to(src_root)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    for name, values in (overrides or {}).items():
        path = out / name
        config = json.loads(path.read_text())
        _merge(config, values)
        path.write_text(json.dumps(config, indent=2))


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


@torch.no_grad()
def _codebook_sums(module: torch.nn.Module) -> None:
    """Unit-normal codebook vectors (usage stays 1), whether the module keeps them as buffers or parameters."""
    for name, t in module.state_dict(keep_vars=True).items():
        if name.endswith(("embedding_sum", "embed_sum")):
            t.normal_()


def unbuilt_official_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Speech-tokenizer tensors of the official checkpoint that the engine's modules do not build."""
    d, e = config.decoder, config.encoder
    out = {f"decoder.quantizer.{q}.input_proj.weight": torch.randn(d.codebook_dim // 2, d.codebook_dim, 1) / d.codebook_dim ** 0.5
           for q in ("rvq_first", "rvq_rest")}
    for q in ("semantic", "acoustic"):
        out[f"encoder.quantizer.{q}_residual_vector_quantizer.output_proj.weight"] = \
            torch.randn(e.hidden_size, e.codebook_dim, 1) / e.codebook_dim ** 0.5
    first_unused = e.valid_num_quantizers - e.num_semantic_quantizers
    for i in range(first_unused, e.num_quantizers - e.num_semantic_quantizers):
        p = f"encoder.quantizer.acoustic_residual_vector_quantizer.layers.{i}.codebook."
        out[p + "initialized"] = torch.ones(1)
        out[p + "cluster_usage"] = torch.ones(e.codebook_size)
        out[p + "embed_sum"] = torch.randn(e.codebook_size, e.codebook_dim)
    return out


@torch.no_grad()
def _calibrate_vocoder(vocoder: Vocoder, codebook_size: int, frames: int = 24) -> None:
    """Zero the biases and scale the last conv so random codes peak at PEAK before the [-1, 1] clamp.

    With default-init biases the output is mostly a bias-driven waveform with a large DC offset, the
    same whatever the codes (two random code sequences correlate at 0.999); without them it follows
    the codes."""
    for m in vocoder.modules():
        if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)) and m.bias is not None:
            m.bias.zero_()
    codes = torch.randint(0, codebook_size, (1, frames, 16))
    seen = []
    last = vocoder.decoder[-1]
    hook = last.register_forward_hook(lambda mod, args, out: seen.append(out.detach()))
    vocoder.decode_unchunked(codes)
    hook.remove()
    scale = PEAK / seen[0].abs().max().clamp(min=1e-12)
    last.conv.weight.mul_(scale)
    last.conv.bias.mul_(scale)


def build(preset: str, seed: int, out: str | Path, bf16: bool = False, overrides: dict[str, dict] | None = None) -> Path:
    """Write the random folder `out` for `preset` (its configs changed by `overrides`, as
    `copy_configs` takes them: other sizes for tests); returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy_configs(preset, out, overrides)
    config = load_config(out)
    torch.manual_seed(seed)
    talker = Talker(config.talker, config.predictor)
    speaker = SpeakerEncoder(config.speaker)
    encoder = CodecEncoder(config.encoder)
    vocoder = Vocoder(config.decoder)
    _codebook_sums(encoder)
    _codebook_sums(vocoder)
    extra = unbuilt_official_tensors(config)
    _calibrate_vocoder(vocoder.eval(), config.decoder.codebook_size)
    main = {**{"talker." + k: v for k, v in talker.state_dict().items()},
            **{"speaker_encoder." + k: v for k, v in speaker.state_dict().items()}}
    if bf16:
        main = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in main.items()}
    codec = {**{"encoder." + k: v for k, v in encoder.state_dict().items()},
             **{"decoder." + k: v for k, v in vocoder.state_dict().items()}, **extra}
    save_file({k: v.contiguous() for k, v in main.items()}, str(out / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in codec.items()}, str(out / "speech_tokenizer" / "model.safetensors"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.testing.random_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="folder to write (created if needed)")
    parser.add_argument("--bf16", action="store_true", help="store model.safetensors in bfloat16 (half the size)")
    args = parser.parse_args(argv)
    out = build(args.preset, args.seed, args.out, args.bf16)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {args.preset} random model (seed {args.seed}) to {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
