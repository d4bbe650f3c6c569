"""`python -m app` = `qwen3-tts-server`."""
import sys

from .main import main

sys.exit(main())
