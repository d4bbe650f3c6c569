"""Client fields, checked once for both routes, turned into what the engine takes.

Every check raises `ApiError` with a message naming the field, so a client mistake is always a 400
(or 413 for text over the limit), never an engine error later.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from typing import Any, Optional

from engine.config import GenerationDefaults
from engine.prompt import resolve_language
from engine.requests import SamplingParams

from .errors import ApiError, bad_request



def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad_request(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be from {lo} to {hi}, got {value!r}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}")
    return value


def optional_str(name: str, value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {type(value).__name__}")
    return value


def default_sampling(gen: GenerationDefaults) -> SamplingParams:
    """The model's generation_config.json, as the official wrapper applies it."""
    return SamplingParams(greedy=not gen.do_sample, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
                          repetition_penalty=gen.repetition_penalty, subtalker_greedy=not gen.subtalker_dosample,
                          subtalker_temperature=gen.subtalker_temperature, subtalker_top_k=gen.subtalker_top_k,
                          subtalker_top_p=gen.subtalker_top_p)


def sampling(fields: dict, base: SamplingParams) -> SamplingParams:
    """`base` with the talker fields present in `fields` replaced; temperature 0 means greedy
    (talker and code predictor), a positive temperature means sampling."""
    changes: dict = {}
    if fields.get("temperature") is not None:
        t = _number("temperature", fields["temperature"], 0.0, 10.0)
        changes.update(greedy=t == 0, subtalker_greedy=None if t == 0 else base.subtalker_greedy)
        if t > 0:
            changes["temperature"] = t
    if fields.get("top_k") is not None:
        changes["top_k"] = integer("top_k", fields["top_k"], 1, 3072)
    if fields.get("top_p") is not None:
        changes["top_p"] = _number("top_p", fields["top_p"], 0.0, 1.0, lo_open=True)
    if fields.get("repetition_penalty") is not None:
        changes["repetition_penalty"] = _number("repetition_penalty", fields["repetition_penalty"], 0.0, 10.0, lo_open=True)
    if fields.get("min_new_tokens") is not None:   # EOS suppressed before this many tokens (benchmarks)
        changes["min_new_tokens"] = integer("min_new_tokens", fields["min_new_tokens"], 0, 1 << 20)
    if "seed" in fields:
        changes["seed"] = None if fields["seed"] is None else integer("seed", fields["seed"], 0, 2**63 - 1)
    return dataclasses.replace(base, **changes)


def language(value: Any, config) -> str:
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise bad_request(f"language must be a string, got {type(value).__name__}")
    try:
        return resolve_language(value, config)
    except ValueError as e:
        raise bad_request(str(e)) from None


def text(name: str, value: Any, max_chars: int) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string" + ("" if value is not None else " (it is required)"))
    if len(value) > max_chars:
        raise ApiError(413, "text_too_long", f"{name} has {len(value)} characters; the limit is {max_chars}")
    return value


def base64_audio(name: str, value: Any) -> bytes:
    """Base64 (optionally a data: URL) -> bytes."""
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a base64 string of an audio file")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    value = "".join(value.split())
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{name} is not valid base64") from None
