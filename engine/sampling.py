"""Batched logits processing (MODEL.md 6.2 / 6.3) and batch-invariant seeded sampling.

Every parameter is a per-row tensor, so one call serves a batch of requests with different settings,
with no host sync and no per-row Python loop.

Randomness does not come from a torch generator: the noise for (seed, frame, codebook, token id) is a
counter-based hash (splitmix64 in int64 torch ops, on the device). A row's draws therefore depend only
on its own seed and progress, never on its batch companions or on other rows' draws. Sampling is
Gumbel-max: argmax(logits + Gumbel noise) is an exact draw from softmax(logits) (noise in float64).

Typical use per decode step (rows 0..B-1):
    processor = TalkerLogitsProcessor(cfg.talker.vocab_size, cfg.talker.codec_eos_token_id, device)
    params = SamplingTensors.from_params([req.sampling for req in batch], device)
    c0 = sample_talker(processor, logits, seen, generated, params)   # generated[b] = frame index
    mark_seen(seen, c0)
    sub_fn = lambda logits, group, embed: sample_subtalker(logits, group, frame, params, embed=embed)
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, fields

import torch

from .host import to_device
from .model import kernels
from .model.predictor import Embed
from .requests import SamplingParams

_NEG_INF = float("-inf")


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_TOKEN_BITS = 12     # token ids < 4096
_GROUP_BITS = 5      # codebooks < 32


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplications wrap mod 2^64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def random_bits(seed: torch.Tensor, frame: torch.Tensor, codebook, vocab: int) -> torch.Tensor:
    """int64 [B, vocab] (or [B, G, vocab] for a tensor of G codebooks): element `counter` of the
    splitmix64 stream keyed by mix64(seed[b]).

    counter = ((frame[b] * 32 + codebook) << 12) + token id, so every (frame, codebook, token) of a
    row gets its own draw.
    """
    if vocab > 1 << _TOKEN_BITS:
        raise ValueError(f"vocab {vocab} exceeds {1 << _TOKEN_BITS}")
    tokens = torch.arange(vocab, dtype=torch.long, device=seed.device)
    if isinstance(codebook, torch.Tensor):                       # [G]: one pass for a frame's codebooks
        counter = ((frame[:, None, None] * (1 << _GROUP_BITS) + codebook[None, :, None]) << _TOKEN_BITS) + tokens
        return mix64(mix64(seed)[:, None, None] + counter * _GOLDEN)
    counter = ((frame[:, None] * (1 << _GROUP_BITS) + codebook) << _TOKEN_BITS) + tokens
    return mix64(mix64(seed)[:, None] + counter * _GOLDEN)


def gumbel_noise(seed: torch.Tensor, frame: torch.Tensor, codebook, vocab: int) -> torch.Tensor:
    """float64 [B, vocab] (or [B, G, vocab]) standard Gumbel noise -log(-log(u)),
    u = (52 random bits + 0.5) / 2^52 in (0, 1)."""
    u = (_shr(random_bits(seed, frame, codebook, vocab), 12).double() + 0.5) * 2.0 ** -52
    return -torch.log(-torch.log(u))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, all [B].

    `*_top_p_any` are host flags (known when the rows are built): False lets the top-p sort be
    skipped for the whole batch. `assign` keeps them conservative (once True, stays True).
    """
    greedy: torch.Tensor              # bool
    temperature: torch.Tensor         # float32
    top_k: torch.Tensor               # int64, <= 0 means no top-k
    top_p: torch.Tensor               # float64 (1 - top_p as HF computes it), 1.0 means no top-p
    repetition_penalty: torch.Tensor  # float32
    sub_greedy: torch.Tensor
    sub_temperature: torch.Tensor
    sub_top_k: torch.Tensor
    sub_top_p: torch.Tensor           # float64
    seed: torch.Tensor                # int64
    min_new_tokens: torch.Tensor      # int64
    talker_top_p_any: bool = True
    sub_top_p_any: bool = True

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        """Rows from SamplingParams; a None seed becomes a fresh random one (see `.seed`)."""
        for p in params:
            p.validate()

        def col(values, dtype):
            return to_device(values, device, dtype)

        seeds = [(secrets.randbits(63) if p.seed is None else p.seed) % (1 << 63) for p in params]
        return cls(
            greedy=col([p.greedy for p in params], torch.bool),
            temperature=col([p.temperature for p in params], torch.float32),
            top_k=col([p.top_k for p in params], torch.long),
            top_p=col([p.top_p for p in params], torch.float64),
            repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
            sub_greedy=col([p.sub_greedy for p in params], torch.bool),
            sub_temperature=col([p.subtalker_temperature for p in params], torch.float32),
            sub_top_k=col([p.subtalker_top_k for p in params], torch.long),
            sub_top_p=col([p.subtalker_top_p for p in params], torch.float64),
            seed=col(seeds, torch.long),
            min_new_tokens=col([p.min_new_tokens for p in params], torch.long),
            talker_top_p_any=any(p.top_p < 1 and not p.greedy for p in params),
            sub_top_p_any=any(p.subtalker_top_p < 1 and not p.sub_greedy for p in params),
        )

    def _tensors(self):
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def assign(self, slots: torch.Tensor, rows: "SamplingTensors") -> None:
        """In place: row slots[i] of self := row i of `rows` (slot-indexed state of a runner)."""
        for name in self._tensors():
            getattr(self, name)[slots] = getattr(rows, name)
        self.talker_top_p_any |= rows.talker_top_p_any
        self.sub_top_p_any |= rows.sub_top_p_any

    def rows(self, index: torch.Tensor | slice) -> "SamplingTensors":
        """The rows `index` (a LongTensor of slots: a gathered copy; a slice: views)."""
        return SamplingTensors(**{name: getattr(self, name)[index] for name in self._tensors()},
                               talker_top_p_any=self.talker_top_p_any, sub_top_p_any=self.sub_top_p_any)

    def head(self, n: int) -> "SamplingTensors":
        """Views of rows 0..n-1 (the decode batch over slots 0..n-1)."""
        return self.rows(slice(0, n))


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF rule on ids marked in seen [B,V]: negative logits * penalty, others / penalty (fp32)."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


class TalkerLogitsProcessor:
    """MODEL.md 6.2 steps 2-4 for the talker: repetition penalty, min-new-tokens, suppression.

    Suppressed: ids [vocab-1024, vocab) except EOS (the official `suppress_tokens`). EOS is masked
    while a row has generated fewer than its `min_new_tokens` tokens (officially 2 for every row).
    """

    def __init__(self, vocab_size: int, eos_id: int, device: torch.device | str = "cpu"):
        ids = torch.arange(vocab_size, device=device)
        self.eos_id, self.suppress_from = eos_id, vocab_size - 1024
        self.suppress = (ids >= self.suppress_from) & (ids != eos_id)
        self.is_eos = ids == eos_id

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor, generated: torch.Tensor,
                 penalty: torch.Tensor, min_new_tokens: torch.Tensor) -> torch.Tensor:
        """logits fp32 [B,V]; seen bool [B,V] (c0 ids generated so far); generated, min_new_tokens int64 [B]."""
        logits = repetition_penalty(logits, seen, penalty)
        blocked = self.suppress | (self.is_eos & (generated < min_new_tokens)[:, None])
        return logits.masked_fill(blocked, _NEG_INF)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         top_p_any: bool = True) -> torch.Tensor:
    """Temperature, then top-k (values < the k-th largest removed: ties survive), then top-p.

    Top-p follows HF TopPLogitsWarper: sort ascending, remove tokens whose cumulative probability is
    <= 1 - top_p, always keep the most likely one; rows with top_p == 1 are untouched.
    """
    vocab = logits.shape[-1]
    logits = logits / temperature[:, None]
    k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, _NEG_INF)
    if not top_p_any:
        return logits
    sorted_logits, order = logits.sort(dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum <= (1 - top_p).float()[:, None]) & (top_p < 1)[:, None]
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, order, remove), _NEG_INF)


def sample(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seed: torch.Tensor, frame: torch.Tensor, codebook: int,
           top_p_any: bool = True, noise: torch.Tensor | None = None, embed: Embed | None = None) -> torch.Tensor:
    """ids [B]: argmax of logits where greedy, else a seeded draw from softmax(warp(logits)), in
    fp32 whatever the logits' float dtype. `noise`: this codebook's gumbel_noise(seed, frame,
    codebook) when already computed (the fused kernel hashes its own). `embed` = (table, out): table[ids]
    is written to out too."""
    if fused_sampling(logits.device, top_p_any):          # the same, in one kernel
        return kernels.sample_rows(logits, greedy, temperature, top_k, seed, frame, codebook, embed=embed)
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    if not all_greedy(greedy):
        if noise is None:
            noise = gumbel_noise(seed, frame, codebook, logits.shape[-1])
        warped = warp(logits, temperature, top_k, top_p, top_p_any)
        ids = torch.where(greedy, ids, (warped.double() + noise).argmax(dim=-1))
    if embed is not None:
        write_embedding(ids, embed)
    return ids


def write_embedding(ids: torch.Tensor, embed: Embed) -> None:
    """embed = (table [V, D], out [B, D]): out := table[ids] (what a `SampleFn` does with its embed)."""
    table, out = embed
    out.copy_(table[ids])


def all_greedy(greedy: torch.Tensor) -> bool:
    """Whether every row takes the argmax, so no noise or warp is needed: asked on the CPU only,
    where it costs no device sync (a GPU step keeps the same ops, for its CUDA graphs)."""
    return greedy.device.type == "cpu" and bool(greedy.all())


def fused_sampling(device: torch.device, top_p_any: bool) -> bool:
    """Whether `sample` runs as one Triton kernel that hashes its own noise (CUDA, no top-p row):
    then a caller need not compute the noise ahead."""
    return torch.device(device).type == "cuda" and not top_p_any and kernels.triton is not None


def sample_talker(processor: TalkerLogitsProcessor, logits: torch.Tensor, seen: torch.Tensor,
                  generated: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """c0 [B] from raw fp32 talker logits [B,V]; `generated` [B] = c0 tokens generated so far by the
    row (also the frame index keying its noise, codebook 0)."""
    if fused_sampling(logits.device, p.talker_top_p_any):       # the processor in the sampling kernel
        processing = kernels.TalkerProcessing(seen, p.repetition_penalty, p.min_new_tokens, processor.eos_id,
                                              processor.suppress_from)
        return kernels.sample_rows(logits, p.greedy, p.temperature, p.top_k, p.seed, generated, 0,
                                   processing=processing)
    logits = processor(logits, seen, generated, p.repetition_penalty, p.min_new_tokens)
    return sample(logits, p.greedy, p.temperature, p.top_k, p.top_p, p.seed, generated, 0, p.talker_top_p_any)


def sample_subtalker(logits: torch.Tensor, group: int, frame: torch.Tensor, p: SamplingTensors,
                     noise: torch.Tensor | None = None, embed: Embed | None = None) -> torch.Tensor:
    """Codebook `group` (1..15) ids [B] from code-predictor logits (MODEL.md 6.3: no penalty,
    no suppression). `frame` [B] is the row's index of the frame being completed. `noise`
    [B, 15, V]: `subtalker_noise(...)` for the frame (one hash pass instead of 15), or None (always
    when `fused_sampling`)."""
    return sample(logits, p.sub_greedy, p.sub_temperature, p.sub_top_k, p.sub_top_p, p.seed, frame, group,
                  p.sub_top_p_any, None if noise is None else noise[:, group - 1], embed)


def subtalker_noise(seed: torch.Tensor, frame: torch.Tensor, groups: int, vocab: int) -> torch.Tensor:
    """Gumbel noise [B, groups, vocab] for codebooks 1..groups of `frame`: the same draws that
    `sample_subtalker` makes one codebook at a time."""
    return gumbel_noise(seed, frame, torch.arange(1, groups + 1, device=seed.device), vocab)


def mark_seen(seen: torch.Tensor, ids: torch.Tensor) -> None:
    """In place: add ids [B] to each row's c0 history seen [B,V] (duplicates count once)."""
    seen.scatter_(1, ids[:, None], True)
