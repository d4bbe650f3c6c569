"""`qwen3-tts synth`: offline synthesis with the engine, for scripts and for checking it against
recorded outputs (PROTOCOL.md "Command line"). Also `python -m engine synth`.

Exit status 0 on success; 2 with a one-line "error: ..." on bad input (missing model files, an unknown
language, unreadable reference audio, inconsistent flags).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from .audio_io import BUILTIN_VOICE_WAV, AudioError, TARGET_RATE, load_reference
from .config import ModelFolderError
from .requests import SamplingParams, SpeechRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen3-tts", description="Qwen3-TTS-12Hz-0.6B-Base engine tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("synth", help="synthesize one text to a WAV file",
                       description="Synthesize TEXT in the voice of a reference recording (default: the "
                                   "built-in voice, the server's default).")
    p.add_argument("--model-dir", required=True, help="model folder (Hugging Face layout) or a Hugging Face id")
    p.add_argument("--text", required=True)
    p.add_argument("--language", default="auto", help="auto (default), a language name or code (english/en, ...)")
    p.add_argument("--ref-audio", help="reference recording of the voice to clone (any rate, mono or stereo; "
                   "default: the built-in voice's x-vector, as the server's default voice)")
    p.add_argument("--ref-text", help="transcript of the reference: enables ICL cloning")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding only")
    p.add_argument("--non-streaming-text", action="store_true",
                   help="the official non_streaming_mode layout (whole text in the prefill)")
    p.add_argument("--greedy", action="store_true", help="argmax for the talker and the code predictor")
    for flag, kind in (("--temperature", float), ("--top-k", int), ("--top-p", float), ("--repetition-penalty", float),
                       ("--subtalker-temperature", float), ("--subtalker-top-k", int), ("--subtalker-top-p", float)):
        p.add_argument(flag, type=kind, help="default: generation_config.json of the model")
    p.add_argument("--seed", type=int, help="same seed + same input = same audio (default: random)")
    p.add_argument("--max-frames", type=int, help="at most N frames of 80 ms (official max_new_tokens = N + 1)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--patched-regex", action="store_true",
                   help="the Mistral-style pre-tokenizer the official package uses for local folders")
    p.add_argument("--out", required=True, help="output audio file (24 kHz; format from the extension, WAV PCM_16)")
    p.add_argument("--codes-out", help="also write the codes as an int64 .npy of shape [frames, 16]")
    return parser


def sampling_from_args(args, defaults) -> SamplingParams:
    """Flags over generation_config.json; --greedy makes both stages greedy (the penalty still applies)."""
    def pick(name, default):
        value = getattr(args, name)
        return default if value is None else value
    return SamplingParams(
        greedy=args.greedy or not defaults.do_sample, temperature=pick("temperature", defaults.temperature), top_k=pick("top_k", defaults.top_k),
        top_p=pick("top_p", defaults.top_p), repetition_penalty=pick("repetition_penalty", defaults.repetition_penalty),
        subtalker_greedy=True if args.greedy else not defaults.subtalker_dosample,
        subtalker_temperature=pick("subtalker_temperature", defaults.subtalker_temperature),
        subtalker_top_k=pick("subtalker_top_k", defaults.subtalker_top_k),
        subtalker_top_p=pick("subtalker_top_p", defaults.subtalker_top_p), seed=args.seed)


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")


def check_args(args) -> None:
    given = [f"--{n.replace('_', '-')}" for n in SAMPLING_FLAGS if getattr(args, n) is not None]
    if args.greedy and given:
        raise ValueError(f"--greedy takes the argmax: {', '.join(given)} would be ignored")
    if args.ref_audio is None and args.ref_text:
        raise ValueError("--ref-text needs --ref-audio (the transcript of that recording)")
    if args.max_frames is not None and args.max_frames < 0:
        raise ValueError("--max-frames must be >= 0")
    if not args.text.strip():
        raise ValueError("--text is empty")
    for path in (args.out, args.codes_out):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"output folder of {path} does not exist")


def synth(args) -> int:
    from .loader import load_model
    from .prompt import resolve_language
    from .synth import synthesize

    check_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    wav = load_reference(args.ref_audio or BUILTIN_VOICE_WAV)     # before the model: fail fast on a bad file
    t0 = time.perf_counter()
    model = load_model(args.model_dir, device=device, dtype=dtype, patched_regex=args.patched_regex)
    resolve_language(args.language, model.config)
    voice = model.make_voice(wav, TARGET_RATE, ref_text=args.ref_text, x_vector_only=args.x_vector_only)
    request = SpeechRequest(text=args.text, voice=voice, language=args.language,
                            sampling=sampling_from_args(args, model.config.generation),
                            max_frames=args.max_frames, non_streaming_text=args.non_streaming_text)
    t1 = time.perf_counter()
    (result,) = synthesize(model, [request])
    t2 = time.perf_counter()
    sf.write(args.out, result.wav, model.config.sample_rate)
    if args.codes_out:
        np.save(args.codes_out, result.codes.astype(np.int64))
    seconds = result.wav.shape[0] / model.config.sample_rate
    print(f"{result.codes.shape[0]} frames, {seconds:.2f} s of audio ({result.reason}), "
          f"{'ICL' if voice.icl else 'x-vector'} voice{'' if args.ref_audio else ' (built-in)'}; load {t1 - t0:.1f} s, synthesis {t2 - t1:.1f} s "
          f"({seconds / max(t2 - t1, 1e-9):.2f}x real time) -> {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return synth(args)
    except (ModelFolderError, AudioError, ValueError, OSError, sf.LibsndfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
