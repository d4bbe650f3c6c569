"""Everything loaded from a model folder in the original Hugging Face layout (MODEL.md 1.1, 10).

`load_model` reads the configs, builds the modules with the checkpoint's parameter names, and loads
`model.safetensors` (`talker.`, `speaker_encoder.`) and `speech_tokenizer/model.safetensors`
(`encoder.`, `decoder.`). A Hugging Face model id is downloaded first when the hub is reachable.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .audio_io import TARGET_RATE, resample
from .config import ModelConfig, ModelFolderError, load_config
from .model.codec_encoder import CodecEncoder
from .model.speaker import SpeakerEncoder
from .model.talker import Talker
from .model import vocoder as vocoder_module
from .model.vocoder import UNUSED_KEYS as VOCODER_UNUSED, Vocoder
from .prompt import PromptBuilder
from .requests import VoicePrompt
from .text import TextTokenizer
from .weights import load_into, read_safetensors, warn_unused

log = logging.getLogger(__name__)

HUB_HINT = ("get the files with `huggingface-cli download Qwen/Qwen3-TTS-12Hz-0.6B-Base --local-dir "
            "models/0.6b-base` (`hf download ...` with huggingface_hub >= 1.0) and pass that folder, or copy "
            "the model folder from a machine that has it")


class TTSModel:
    """The loaded model: tokenizer, talker (+ code predictor), speaker encoder, codec encoder, vocoder."""

    def __init__(self, config: ModelConfig, tokenizer: TextTokenizer, talker: Talker,
                 speaker_encoder: SpeakerEncoder, codec_encoder: CodecEncoder, vocoder: Vocoder,
                 device: torch.device, dtype: torch.dtype, model_dir: Path | None = None):
        self.config, self.tokenizer = config, tokenizer
        self.talker, self.speaker_encoder, self.codec_encoder, self.vocoder = talker, speaker_encoder, codec_encoder, vocoder
        self.device, self.dtype, self.model_dir = device, dtype, model_dir
        self.prompts = PromptBuilder(talker, config, tokenizer)

    @torch.no_grad()
    def make_voice(self, wav: np.ndarray, sr: int, ref_text: str | None = None,
                   x_vector_only: bool = False) -> VoicePrompt:
        """A cloned voice from a mono float32 reference: its x-vector, plus (ICL, when `ref_text` is
        given and not `x_vector_only`) its codec codes and the reference text ids R = ref_ids[3:-2]."""
        wav = resample(np.asarray(wav, dtype=np.float32), sr, TARGET_RATE)
        xvector = self.speaker_encoder.embed(wav).float().cpu()
        if x_vector_only or ref_text is None:
            return VoicePrompt(xvector)
        if not ref_text.strip():
            raise ValueError("ref_text is empty: give the transcript of the reference audio, or use x_vector_only")
        x = torch.from_numpy(wav).to(self.device)[None]
        codes = self.codec_encoder.encode(x, torch.tensor([wav.shape[0]], device=self.device))[0]
        return VoicePrompt(xvector, codes.long().cpu(), self.tokenizer.ref_text_ids(ref_text))


def resolve_model_dir(model_dir_or_hub_id: str | Path) -> Path:
    """A local folder as is; a Hugging Face id ("org/name", not an existing path) downloaded."""
    path = Path(model_dir_or_hub_id)
    if path.exists():
        if not path.is_dir():
            raise ModelFolderError(f"{path} is not a folder")
        return path
    name = str(model_dir_or_hub_id)
    if "/" not in name or name.startswith((".", "/")) or name.count("/") != 1:
        raise ModelFolderError(f"model folder {path} does not exist; {HUB_HINT}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelFolderError(f"{name} is not a local folder and huggingface_hub is not installed; {HUB_HINT}") from e
    try:
        return Path(snapshot_download(repo_id=name))
    except Exception as e:  # offline, unknown repo, gated, disk full: all mean "get the files yourself"
        raise ModelFolderError(f"{name} is not a local folder, and downloading it as a Hugging Face model id "
                               f"failed ({type(e).__name__}: {e}); {HUB_HINT}") from e


@contextlib.contextmanager
def _skip_random_init():
    """Module constructors allocate without drawing random weights (the checkpoint overwrites them).

    Same idea as transformers' `no_init_weights`: the nn.init fillers used by reset_parameters become
    no-ops. Building the 0.6B modules otherwise spends ~15 s of CPU on random numbers.
    """
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _place(module: nn.Module, device, dtype) -> nn.Module:
    """Cast parameters and persistent buffers to `dtype`, then move to `device`. Non-persistent
    buffers (RoPE inv_freq, computed in fp32 at init as officially) keep their dtype. Cast on the host
    first: cast on the device, the freed fp32 copies left holes among the weights that the allocator
    kept reserved (1.4 GiB of the 0.6B model's)."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and name not in m._non_persistent_buffers_set:
                m._buffers[name] = b.to(dtype)
    return module.to(device).eval().requires_grad_(False)


def _grow_segments_in_place() -> None:
    """PyTorch's CUDA allocator in expandable-segments mode, unless the environment sets allocator
    options itself: segments grow in place instead of being cut from fixed-size blocks, and the CUDA
    graphs' pool holds about half as much (an H200, the vocoder's graphs for 256 streams: 5.96
    against 12.51 GiB), replays as fast."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")


def load_model(model_dir_or_hub_id: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, patched_regex: bool = False,
               codec_dtype: torch.dtype | None = None) -> TTSModel:
    """Load a Qwen3-TTS Base model folder (or hub id) onto `device`.

    dtype: talker, code predictor and speaker encoder. codec_dtype: codec encoder and vocoder
    (default: the same, as the official code does; float32 keeps the codec exact under bf16).
    patched_regex: the Mistral-style pre-tokenizer the official package uses for local folders (T1).
    """
    model_dir = resolve_model_dir(model_dir_or_hub_id)
    device = torch.device(device)
    codec_dtype = dtype if codec_dtype is None else codec_dtype
    config = load_config(model_dir)
    tokenizer = TextTokenizer(model_dir, patched_regex=patched_regex)
    main_path = model_dir / "model.safetensors"
    codec_path = model_dir / "speech_tokenizer" / "model.safetensors"
    main, codec = read_safetensors(main_path), read_safetensors(codec_path)
    with _skip_random_init():
        talker = Talker(config.talker, config.predictor)
        speaker = SpeakerEncoder(config.speaker)
        encoder = CodecEncoder(config.encoder)
        vocoder = Vocoder(config.decoder)
    used = load_into(talker, main, "talker.", str(main_path)) | load_into(speaker, main, "speaker_encoder.", str(main_path))
    warn_unused(main, used, str(main_path))
    used = load_into(encoder, codec, "encoder.", str(codec_path)) | load_into(vocoder, codec, "decoder.", str(codec_path))
    ignore = tuple("decoder." + k for k in VOCODER_UNUSED) + tuple("encoder." + k for k in encoder.unused_checkpoint_prefixes)
    warn_unused(codec, used, str(codec_path), ignore_prefixes=ignore)
    del main, codec
    if device.type == "cuda":
        _grow_segments_in_place()
    talker = _place(talker, device, dtype)
    if device.type == "cuda":        # fewer, fatter kernels for the decode step (same weights)
        talker.model.fuse()
        talker.code_predictor.model.fuse()
        talker.tabulate_text()
        torch.cuda.empty_cache()     # the text embedding's memory goes back to the device
    vocoder = _place(vocoder, device, codec_dtype)
    if device.type == "cuda" and vocoder_module.CHANNELS_LAST:    # its convs run channels-last there
        vocoder.channels_last_weights()
    return TTSModel(config, tokenizer, talker, _place(speaker, device, dtype),
                    _place(encoder, device, codec_dtype), vocoder, device, dtype, model_dir)
