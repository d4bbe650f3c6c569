"""Talker prompt building for voice cloning, exactly MODEL.md section 5.

A prompt is the prefill embeddings [P, D] plus the trailing text embeddings [N, D] that the decode
steps add to the frame embeddings, one per step (then tts_pad forever). Four layouts:

| mode     | streaming text (default)                       | non-streaming text                  |
|----------|------------------------------------------------|-------------------------------------|
| x-vector | prefill ends with E_t(T[0]) + E_c(bos);        | whole text + eos in the prefill;    |
|          | trailing = E_t(T[1:]), tts_eos                 | trailing empty                      |
| ICL      | text R++T++eos overlaps bos++ref frames; the   | text then ref frames; trailing      |
|          | text beyond the frames is trailing             | empty                               |

Incremental text: `tokens_needed` says how many target tokens the prefill needs while the text is
still arriving (x-vector streaming: 1; ICL streaming: enough for R++T to cover the Lc = T_ref + 1
codec positions); the non-streaming layouts need the complete text. With `text_complete=False`
the trailing holds only the known tokens past the prompt; the caller then feeds `embed_text(new ids)`
rows as tokens arrive and `tts_eos` once the text is complete.

Call granularity (MODEL.md 5.2-5.4, T17): tts_bos/eos/pad come from one E_t call on a length-3
sequence and the role from one call on its 3 ids (both computed once per builder); a prompt's text
(T, or R++T in ICL) is one E_t call, and `build_many` makes that one call for the texts of many
prompts (an admission burst: a call per prompt was most of its host time). The official code embeds
x-vector streaming T[0:1] and T[1:] in two calls; E_t is per token, so the rows differ only by GEMM
blocking (~1e-7 in fp32 on the CPU; on the GPU E_t is a table lookup, `Talker.tabulate_text`: none).
Reference frames are summed as one reduction over a [T_ref, 16, D] stack (`Talker.embed_frame`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .host import to_device
from .requests import PerVoice, VoicePrompt
from .text import ROLE_PREFIX

LANGUAGE_ALIASES = {"en": "english", "zh": "chinese", "es": "spanish", "fr": "french", "de": "german",
                    "it": "italian", "pt": "portuguese", "ja": "japanese", "ko": "korean", "ru": "russian"}


def resolve_language(language: str | None, config: ModelConfig) -> str:
    """Canonical language name ('auto' or a key of codec_language_id), case-insensitive, with aliases."""
    name = (language or "auto").strip().lower()
    name = LANGUAGE_ALIASES.get(name, name)
    if name != "auto" and name not in config.talker.codec_language_id:
        raise ValueError(f"unsupported language {language!r}; supported: {', '.join(config.languages)} "
                         f"(or the codes {', '.join(k for k, v in LANGUAGE_ALIASES.items() if v in config.talker.codec_language_id)})")
    return name


@dataclass
class Prompt:
    embeds: torch.Tensor     # [P, D] prefill
    trailing: torch.Tensor   # [N, D] decode step k adds trailing[k] (k < N), else tts_pad


class PromptBuilder:
    """Builds prompts with the talker's embeddings, on its device and dtype."""

    def __init__(self, talker, config: ModelConfig, tokenizer):
        self.talker = talker
        self.config = config
        t = config.talker
        self.device = talker.codec_head.weight.device
        with torch.no_grad():
            specials = self._ids([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
            self.tts_bos, self.tts_eos, self.tts_pad = talker.embed_text(specials[None])[0]   # each [D]
            role = self._ids(tokenizer.encode(ROLE_PREFIX))                                    # ids[:3]
            self.role = talker.embed_text(role[None])[0]                                      # [3, D]
            self.codec_pad_bos = talker.embed_codec(self._ids([t.codec_pad_id, t.codec_bos_id]))  # [2, D]
        self._heads = PerVoice()     # x-vector -> {language: head}: a quarter of a prompt's launches

    def _ids(self, ids) -> torch.Tensor:
        return to_device(ids, self.device, torch.long)

    def embed_text(self, ids) -> torch.Tensor:
        """E_t of text ids [n] -> [n, D] (prompts' texts, trailing rows fed as text arrives)."""
        with torch.no_grad():
            return self.talker.embed_text(self._ids(ids)[None])[0]

    @staticmethod
    def tokens_needed(voice: VoicePrompt, non_streaming: bool = False) -> int | None:
        """Target tokens needed before the prefill can run on incomplete text; None: needs it all."""
        if non_streaming:
            return None
        if not voice.icl:
            return 1
        return max(1, voice.ref_codes.shape[0] + 1 - len(voice.ref_text_ids))

    def _head(self, language: str, xvector: torch.Tensor) -> torch.Tensor:
        """role ++ (tts_pad*(L-2), tts_bos) + C[:-1]: the 8 ('auto') or 9 positions before the text."""
        name = resolve_language(language, self.config)
        heads = self._heads.get(xvector)
        if heads is None:
            heads = {}
            self._heads.put(xvector, heads)
        if name not in heads:
            heads[name] = self._new_head(name, xvector)
        return heads[name]

    def _new_head(self, name: str, xvector: torch.Tensor) -> torch.Tensor:
        t = self.config.talker
        prefix = ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if name == "auto" else
                  [t.codec_think_id, t.codec_think_bos_id, t.codec_language_id[name], t.codec_think_eos_id])
        spk = to_device(xvector, self.device).to(self.tts_pad.dtype).reshape(1, -1)
        codec = torch.cat([self.talker.embed_codec(self._ids(prefix)), spk, self.codec_pad_bos])   # C [L, D]
        n = codec.shape[0]
        text = torch.cat([self.tts_pad.expand(n - 2, -1), self.tts_bos[None]])
        return torch.cat([self.role, text + codec[:-1]])

    @staticmethod
    def embedded_ids(text_ids: list[int], voice: VoicePrompt) -> list[int]:
        """The text ids whose E_t a prompt is made of: T, or R++T in ICL."""
        return [*voice.ref_text_ids, *text_ids] if voice.icl else list(text_ids)

    def build(self, text_ids: list[int], voice: VoicePrompt, language: str = "auto",
              non_streaming: bool = False, text_complete: bool = True, text: torch.Tensor | None = None) -> Prompt:
        """The prompt for target ids T (`TextTokenizer.text_ids`), possibly only the first ones.
        text: E_t of `embedded_ids(T, voice)` [n, D] when the caller has it (`build_many`)."""
        if text_complete and not text_ids:
            raise ValueError("empty text: nothing to speak")
        needed = self.tokens_needed(voice, non_streaming)
        if not text_complete and (needed is None or len(text_ids) < needed):
            raise ValueError(f"the prompt needs {'the complete text' if needed is None else f'{needed} text tokens'}"
                             f" in this mode; got {len(text_ids)} tokens of incomplete text")
        eos = self.tts_eos[None] if text_complete else self.tts_eos[:0]
        with torch.no_grad():
            head = self._head(language, voice.xvector)
            if text is None:
                text = self.embed_text(self.embedded_ids(text_ids, voice))
            if voice.icl:
                body, trailing = self._icl(torch.cat([text, eos]), voice, non_streaming, text_complete)
            elif non_streaming:
                text = torch.cat([text, self.tts_eos[None]])
                pads = self.codec_pad_bos[0].expand(text.shape[0], -1)            # E_c(pad) a position
                body = torch.cat([text + pads, (self.tts_pad + self.codec_pad_bos[1])[None]])
                trailing = text[:0]
            else:
                body, trailing = text[:1] + self.codec_pad_bos[1], torch.cat([text[1:], eos])
        return Prompt(torch.cat([head, body]), trailing)

    def build_many(self, turns: list[tuple]) -> list[Prompt | ValueError]:
        """`build(*turn)` of each turn (build's arguments but `text`), with one E_t call over all their
        texts; a turn that `build` refuses gets its ValueError in its place."""
        lists = [self.embedded_ids(turn[0], turn[1]) for turn in turns]
        texts = self.embed_text([i for ids in lists for i in ids]).split([len(ids) for ids in lists])
        prompts = []
        for turn, text in zip(turns, texts):
            try:
                prompts.append(self.build(*turn, text=text))
            except ValueError as e:
                prompts.append(e)
        return prompts

    def _icl(self, text: torch.Tensor, voice: VoicePrompt, non_streaming: bool, text_complete: bool):
        """Body and trailing of an ICL prompt from text = E_t(R++T) (++ tts_eos once complete)."""
        codes = to_device(voice.ref_codes, self.device)
        codec = torch.cat([self.codec_pad_bos[1:], self.talker.embed_frame(codes)])      # Y [Lc, D]
        lc = codec.shape[0]
        if non_streaming:
            pads = self.codec_pad_bos[0].expand(text.shape[0], -1)
            return torch.cat([text + pads, codec + self.tts_pad]), text[:0]
        if text.shape[0] > lc or not text_complete:   # incomplete text covers Lc (tokens_needed)
            return text[:lc] + codec, text[lc:]
        return torch.cat([text, self.tts_pad.expand(lc - text.shape[0], -1)]) + codec, text[:0]
