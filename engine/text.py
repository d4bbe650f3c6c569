"""Text tokenizer: Qwen2 byte-level BPE built from vocab.json + merges.txt (MODEL.md section 1.7).

The model folder has no tokenizer.json, so this rebuilds what `transformers` converts the slow
Qwen2 tokenizer into: NFC normalizer, a regex Split ("isolated") followed by ByteLevel (no prefix
space, no regex), BPE without unk/dropout, and the added tokens of tokenizer_config.json split off
before BPE. No BOS is added.

Two pre-tokenizer regexes exist (trap T1): the standard Qwen2 one (the default, what the files
declare) and the Mistral-style one the official package ends up with when it loads a local folder
(`patched_regex=True`). They differ on camelCase ("iPhone"), combining marks and "/" after
punctuation.

Leading line breaks (trap T3): the official prompt is "<|im_start|>assistant\\n" + text, sliced
positionally, so a text starting with whitespace that contains a line break merges with the role's
"\\n" and the model loses that newline (and the role changes). We strip leading whitespace up to and
including its last line break (`normalize_text`); for every other text this is the official
behaviour exactly.
"""
from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from .config import ModelFolderError

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MISTRAL_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ROLE_PREFIX = "<|im_start|>assistant\n"
TARGET_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
REF_SUFFIX = "<|im_end|>\n"

_LEADING_BREAK = re.compile(r"^\s*[\r\n]")


def normalize_text(text: str) -> str:
    """Drop leading whitespace up to and including its last line break (trap T3); else unchanged."""
    return _LEADING_BREAK.sub("", text, count=1)


class TextTokenizer:
    """Encodes text to the ids the official processor produces."""

    def __init__(self, model_dir: str | Path, patched_regex: bool = False):
        model_dir = Path(model_dir)
        vocab, merges, config = (model_dir / n for n in ("vocab.json", "merges.txt", "tokenizer_config.json"))
        for path in (vocab, merges, config):
            if not path.is_file():
                raise ModelFolderError(f"missing file: {path}")
        try:
            added = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
            bpe = BPE.from_file(str(vocab), str(merges), dropout=None, unk_token=None,
                                continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                byte_fallback=False)
        except Exception as e:  # json and tokenizers raise assorted exception types on bad files
            raise ModelFolderError(f"cannot build the text tokenizer from {model_dir}: {e}") from e
        tok = Tokenizer(bpe)
        tok.normalizer = normalizers.NFC()
        self.pre_tokenizer = pre_tokenizers.Split(Regex(MISTRAL_REGEX if patched_regex else QWEN2_REGEX),
                                                  behavior="isolated", invert=False)
        self.byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([self.pre_tokenizer, self.byte_level])
        tok.decoder = decoders.ByteLevel()
        # Added tokens, in id order, with their flags; all are split off before BPE.
        tokens = [AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                             rstrip=t.get("rstrip", False), normalized=t.get("normalized", False),
                             special=t.get("special", False))
                  for _, t in sorted(added.items(), key=lambda kv: int(kv[0]))]
        tok.add_tokens(tokens)
        for id_, t in added.items():
            if tok.token_to_id(t["content"]) != int(id_):
                raise ModelFolderError(f"{config}: added token {t['content']!r} should have id {id_}, "
                                       f"got {tok.token_to_id(t['content'])}")
        self.tokenizer = tok
        self.added_tokens = [t.content for t in tokens]
        # what an incremental tokenizer holds back: text that could be the start of an added token
        self.added_prefixes = {t[:n] for t in self.added_tokens for n in range(1, len(t))}
        self.longest_added_prefix = max(map(len, self.added_prefixes), default=0)
        self.patched_regex = patched_regex

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as the official processor tokenizes it (special tokens recognised, no BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def bpe(self, chunk: str) -> list[int]:
        """Ids of one pre-tokenizer chunk (byte-level mapping + BPE, no further splitting)."""
        (mapped, _), = self.byte_level.pre_tokenize_str(chunk)
        return [t.id for t in self.tokenizer.model.tokenize(mapped)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def text_ids(self, text: str) -> list[int]:
        """The target text ids T = ids[3:-5] of the official prompt template (after `normalize_text`).

        Tokenizing the text alone gives the same ids as slicing the template: the role's "\\n" is
        always its own pre-token once leading line breaks are stripped, and "<|im_end|>" is split
        off before BPE."""
        return self.encode(normalize_text(text))

    def ref_text_ids(self, ref_text: str) -> list[int]:
        """The reference text ids R = ref_ids[3:-2] (same reasoning as `text_ids`)."""
        return self.encode(normalize_text(ref_text))

    def incremental(self) -> IncrementalTokenizer:
        return IncrementalTokenizer(self)


def _is_starter(ch: str) -> bool:
    return unicodedata.combining(ch) == 0


class IncrementalTokenizer:
    """Tokenizes text that arrives in pieces, committing only ids that later text cannot change.

    `push(piece)` returns the newly committed ids; `finish()` returns the rest. For any split of a
    text, the concatenated ids equal `TextTokenizer.text_ids(whole text)`.

    What is held back (not yet committed) after each piece:
    - leading whitespace, until a non-space character shows whether it ends in a line break (T3);
    - a suffix that could be the start of an added token such as "<|im_end|>";
    - everything from the last NFC starter on (a combining mark that arrives later may compose or
      reorder with it);
    - the last pre-tokenizer chunk of the text after the last complete added token (a regex match
      reaching the end of the text can still grow or change; earlier matches end at a character that
      is already known, and the regex has no look-behind, so they are final).
    Text is kept NFC-normalized: NFC(NFC(a) + b) == NFC(a + b), so normalizing as it comes is exact.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tok = tokenizer
        self.pending = ""
        self.started = False   # leading whitespace has been resolved
        self.finished = False

    def push(self, piece: str) -> list[int]:
        if self.finished:
            raise RuntimeError("push() after finish()")
        self.pending = unicodedata.normalize("NFC", self.pending + piece)
        if not self.started:
            if not self.pending.strip():
                return []
            self.pending = normalize_text(self.pending)
            self.started = True
        cut, ids = self._commit(self.pending)
        self.pending = self.pending[cut:]
        return ids

    def finish(self) -> list[int]:
        """Commit everything still held back; the text is complete."""
        if self.finished:
            return []
        self.finished = True
        rest, self.pending = normalize_text(self.pending) if not self.started else self.pending, ""
        return self.tok.encode(rest) if rest else []

    def _commit(self, text: str) -> tuple[int, list[int]]:
        """(n, ids): the longest prefix text[:n] whose ids no appended text can change, and its ids.

        The prefix's last chunks are BPE-encoded as the chunks they are in context: re-tokenizing
        text[:n] alone could split its end differently (`\\s+(?!\\S)` behaves otherwise at the end).
        """
        limit = len(text) - self._partial_added_token(text)
        seg_start = 0     # end of the last complete added token: what precedes it is final
        for tok in self.tok.added_tokens:
            i = text.rfind(tok, 0, limit)
            if i != -1:
                seg_start = max(seg_start, i + len(tok))
        ids = self.tok.encode(text[:seg_start]) if seg_start else []
        starters = [i for i in range(seg_start, limit) if _is_starter(text[i])]
        if not starters:
            return seg_start, ids
        chunks = self.tok.pre_tokenizer.pre_tokenize_str(text[seg_start:starters[-1]])[:-1]
        for chunk, _ in chunks:
            ids += self.tok.bpe(chunk)
        return seg_start + (chunks[-1][1][1] if chunks else 0), ids

    def _partial_added_token(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some added token."""
        prefixes = self.tok.added_prefixes
        return next((n for n in range(min(self.tok.longest_added_prefix, len(text)), 0, -1)
                     if text[-n:] in prefixes), 0)
