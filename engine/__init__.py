"""Qwen3-TTS-12Hz engine: the model in plain PyTorch, and the frame-synchronous scheduler."""
