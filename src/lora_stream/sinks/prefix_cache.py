"""The prefix-cache reset after an update, read for what vLLM answers: shared by every sink that loads into vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import LoraStreamError

__all__ = ["PrefixCacheError", "reset_prefix_cache"]


def reset_prefix_cache(reset: Callable[[], Any], timeout: float, what: str) -> None:
    """Reset vLLM's prefix cache, reading what it answers: ``False`` means it did nothing (blocks are still held by
    running requests), so wait and retry until ``timeout``; then raise :class:`PrefixCacheError`. ``None`` (a vLLM
    that answers nothing) counts as done."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        if reset() is not False:
            return
        if time.monotonic() >= deadline:
            raise PrefixCacheError(
                f"{what} refused to reset its prefix cache for {timeout} s (KV blocks still held by running "
                "requests); blocks computed with the old weights could be reused, so the sync fails"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


class PrefixCacheError(LoraStreamError):
    """vLLM kept refusing to reset its prefix cache after an update (blocks held); the update is rolled back."""
