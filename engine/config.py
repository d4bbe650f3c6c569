"""Configuration read from the model's original Hugging Face folder.

Only the values the engine uses are kept; every default below is the class default of the
official implementation (MODEL.md section 1), so a config file that omits a key behaves the same.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


class ModelFolderError(ValueError):
    """The model folder is missing a file, or a file is malformed."""


def _pick(cls, raw: dict, **overrides):
    """Build dataclass `cls` from the keys of `raw` it knows, ignoring the rest."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in raw.items() if k in names}
    values.update(overrides)
    return cls(**values)


@dataclass(frozen=True)
class TransformerConfig:
    """A Qwen3-style decoder stack (talker and code predictor share the form)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0


@dataclass(frozen=True)
class TalkerConfig:
    transformer: TransformerConfig
    vocab_size: int = 3072
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    num_code_groups: int = 16
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_language_id: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PredictorConfig:
    transformer: TransformerConfig
    vocab_size: int = 2048
    num_code_groups: int = 16


@dataclass(frozen=True)
class SpeakerConfig:
    """ECAPA-TDNN speaker encoder (class defaults of the official code)."""
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple = (5, 3, 3, 3, 1)
    enc_dilations: tuple = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass(frozen=True)
class DecoderConfig:
    """Speech-tokenizer decoder (codes -> 24 kHz waveform)."""
    codebook_size: int = 2048
    codebook_dim: int = 512
    latent_dim: int = 1024
    hidden_size: int = 512
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    decoder_dim: int = 1536
    upsample_rates: tuple = (8, 5, 4, 3)
    upsampling_ratios: tuple = (2, 2)


@dataclass(frozen=True)
class EncoderConfig:
    """Speech-tokenizer encoder (HF Mimi, 24 kHz waveform -> 12.5 Hz codes)."""
    sampling_rate: int = 24000
    audio_channels: int = 1
    num_filters: int = 64
    upsampling_ratios: tuple = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    num_residual_layers: int = 1
    compress: int = 2
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    valid_num_quantizers: int = 16


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json; the official wrapper merges these into every call."""
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    talker: TalkerConfig
    predictor: PredictorConfig
    speaker: SpeakerConfig
    decoder: DecoderConfig
    encoder: EncoderConfig
    generation: GenerationDefaults
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    sample_rate: int = 24000
    samples_per_frame: int = 1920

    @property
    def languages(self) -> list[str]:
        """Supported language names: 'auto' plus the codec language ids of the config."""
        return ["auto", *sorted(self.talker.codec_language_id)]


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelFolderError(f"missing file: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{path} is not valid JSON: {e}") from e


def _tupled(raw: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read config.json, generation_config.json and speech_tokenizer/config.json of `model_dir`."""
    model_dir = Path(model_dir)
    top = read_json(model_dir / "config.json")
    if top.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise ModelFolderError(f"unsupported tokenizer_type {top.get('tokenizer_type')!r}: only the 12 Hz codec is supported")
    talker_raw = top.get("talker_config")
    if not isinstance(talker_raw, dict) or "code_predictor_config" not in talker_raw:
        raise ModelFolderError(f"{model_dir / 'config.json'} has no talker_config.code_predictor_config")
    predictor_raw = talker_raw["code_predictor_config"]
    try:
        talker = _pick(TalkerConfig, talker_raw, transformer=_pick(TransformerConfig, talker_raw,
                       num_hidden_layers=talker_raw["num_hidden_layers"]))
        predictor = _pick(PredictorConfig, predictor_raw, transformer=_pick(TransformerConfig, predictor_raw))
    except TypeError as e:
        raise ModelFolderError(f"{model_dir / 'config.json'}: {e}") from e
    speaker = _pick(SpeakerConfig, _tupled(top.get("speaker_encoder_config", {})))
    if speaker.enc_dim != talker.transformer.hidden_size:
        raise ModelFolderError(f"speaker encoder dimension {speaker.enc_dim} differs from the talker's hidden size "
                               f"{talker.transformer.hidden_size} (the x-vector takes one prompt position)")
    gen_path = model_dir / "generation_config.json"
    generation = _pick(GenerationDefaults, read_json(gen_path)) if gen_path.is_file() else GenerationDefaults()
    st = read_json(model_dir / "speech_tokenizer" / "config.json")
    decoder = _pick(DecoderConfig, _tupled(st.get("decoder_config", {})))
    encoder = _pick(EncoderConfig, _tupled(st.get("encoder_config", {})),
                    valid_num_quantizers=st.get("encoder_valid_num_quantizers", 16))
    if decoder.num_quantizers != talker.num_code_groups:
        raise ModelFolderError(f"the talker makes {talker.num_code_groups} codes a frame but the speech tokenizer's "
                               f"decoder reads {decoder.num_quantizers}")
    token_ids = {k: top[k] for k in ("im_start_token_id", "im_end_token_id", "tts_pad_token_id",
                                     "tts_bos_token_id", "tts_eos_token_id") if k in top}
    return ModelConfig(talker=talker, predictor=predictor, speaker=speaker, decoder=decoder,
                       encoder=encoder, generation=generation,
                       sample_rate=st.get("output_sample_rate", 24000),
                       samples_per_frame=st.get("decode_upsample_rate", 1920), **token_ids)
