# qwen3-tts-server for an NVIDIA GPU host.
#   docker build -t qwen3-tts-server .
#   docker run --gpus all -p 8090:8090 -v $PWD/models:/models -v $PWD/voices:/voices -v $PWD/cache:/cache qwen3-tts-server
# (/cache: Triton's compiled kernels and the launch configs the warm-up picks; kept there, a restart
# neither compiles the kernels nor times their configs again)
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip libsndfile1 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /srv/qwen3-tts-server
# CUDA build of PyTorch first (its own index), then the package.
RUN python3 -m pip install "torch>=2.7" --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY engine engine
COPY app app
COPY web web
RUN python3 -m pip install -e .

ENV MODEL_DIR=/models/0.6b-base VOICES_DIR=/voices HOST=0.0.0.0 PORT=8090 \
    TRITON_CACHE_DIR=/cache/triton QWEN3_TTS_TUNING_CACHE=/cache/launch-configs
EXPOSE 8090
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s CMD python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8090/health', timeout=4)" || exit 1
STOPSIGNAL SIGTERM
CMD ["qwen3-tts-server"]
