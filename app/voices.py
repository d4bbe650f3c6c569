"""Registered voices, kept on disk so that a voice is computed once and survives restarts.

A voice is one safetensors file `VOICES_DIR/<voice_id>.safetensors` holding the x-vector and, for an
ICL voice, the reference codes and reference text ids; its description (name, mode, duration,
created_at, reference text) is the file's metadata. One file per voice, written to a temporary name
and renamed, so a crash never leaves a half-written voice. Ids are checked against a strict pattern
before they touch a path. Voices whose x-vector does not fit the loaded model (a voice made with
another model) are skipped with a warning.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save

from engine.requests import VoicePrompt

log = logging.getLogger("qwen3_tts.voices")

VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SUFFIX = ".safetensors"


def valid_voice_id(voice_id) -> bool:
    return isinstance(voice_id, str) and VOICE_ID.fullmatch(voice_id) is not None


class VoiceStore:
    """The voices of one folder, loaded into memory at start (they are small: a few KB each); a voice
    asked for and not in memory is read from its file, so one written by another server appears."""

    def __init__(self, root: Path | str, hidden_size: int):
        self.root = Path(root)
        self.hidden_size = hidden_size
        self.voices: dict[str, tuple[VoicePrompt, dict]] = {}

    def load(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        for path in sorted(self.root.glob("*" + SUFFIX)):
            self._entry(path.name[: -len(SUFFIX)])

    def _read(self, path: Path) -> tuple[VoicePrompt, dict]:
        with safe_open(str(path), "pt") as f:
            info = json.loads((f.metadata() or {})["info"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        xvector = tensors["xvector"].float()
        if xvector.shape != (self.hidden_size,):
            raise ValueError(f"x-vector of shape {tuple(xvector.shape)} does not fit this model "
                             f"(hidden size {self.hidden_size}); it was made with another model")
        if "ref_codes" in tensors:
            prompt = VoicePrompt(xvector, tensors["ref_codes"].long(), tensors["ref_text_ids"].long().tolist())
        else:
            prompt = VoicePrompt(xvector)
        return prompt, info

    def _entry(self, voice_id: str) -> Optional[tuple[VoicePrompt, dict]]:
        """The voice from memory, else from its file: replicas sharing the folder see each other's voices."""
        entry = self.voices.get(voice_id)
        if entry is not None or not valid_voice_id(voice_id):
            return entry
        path = self.root / (voice_id + SUFFIX)
        if not path.is_file():
            return None
        try:
            entry = self.voices[voice_id] = self._read(path)
        except Exception as e:  # a damaged or foreign file must not keep the server from starting
            log.warning("skipping voice file %s: %s", path, e)
            return None
        return entry

    def get(self, voice_id: str) -> Optional[VoicePrompt]:
        entry = self._entry(voice_id)
        return entry[0] if entry else None

    def info(self, voice_id: str) -> Optional[dict]:
        entry = self._entry(voice_id)
        return dict(entry[1]) if entry else None

    def list(self) -> list[dict]:
        self._scan()
        return [dict(info) for _, info in self.voices.values()]

    def new_id(self) -> str:
        while True:
            voice_id = "voice_" + secrets.token_hex(6)
            if voice_id not in self.voices:
                return voice_id

    def add(self, voice_id: str, prompt: VoicePrompt, name: Optional[str], duration_s: float,
            ref_text: Optional[str]) -> dict:
        if not valid_voice_id(voice_id):
            raise ValueError(f"invalid voice id {voice_id!r}")
        info = {"voice_id": voice_id, "name": name or voice_id, "mode": "icl" if prompt.icl else "x_vector",
                "duration_s": round(float(duration_s), 3), "created_at": int(time.time()),
                "ref_text": ref_text if prompt.icl else None}
        tensors = {"xvector": prompt.xvector.float().contiguous()}
        if prompt.icl:
            tensors["ref_codes"] = prompt.ref_codes.long().contiguous()
            tensors["ref_text_ids"] = torch.tensor(prompt.ref_text_ids, dtype=torch.int64)
        data = save(tensors, metadata={"info": json.dumps(info)})
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / (voice_id + SUFFIX))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._sync_dir()
        self.voices[voice_id] = (prompt, info)
        return dict(info)

    def delete(self, voice_id: str) -> bool:
        if self._entry(voice_id) is None:
            return False
        (self.root / (voice_id + SUFFIX)).unlink(missing_ok=True)
        self._sync_dir()
        del self.voices[voice_id]
        return True

    def _sync_dir(self) -> None:
        """Make the rename itself durable (POSIX: fsync the folder)."""
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
