"""`python -m engine synth ...`: the same as the `qwen3-tts` console script."""
from .cli import main

raise SystemExit(main())
