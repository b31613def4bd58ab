"""What a user sees of a sync without configuring anything: the ``lora_stream`` logger's default handler, and the
progress bar of long syncs and saves.

**The log line.** Every sink logs one line per committed sync (:meth:`SyncRecord.log
<lora_stream.SyncRecord.log>`): at ``INFO`` on rank 0, at ``DEBUG`` on the other ranks (the same sync, seen from
each rank). A stock TRL or verl run configures no handler for the ``lora_stream`` logger, and Python's logging would
drop an ``INFO`` record; so, as transformers and vLLM do for their own loggers, importing lora_stream sets the
``lora_stream`` logger to ``INFO`` (unless it already has a level) and adds one handler to it, writing to stderr.
That handler steps aside whenever the record reaches another handler (one the application configured on the root
logger -- ``logging.basicConfig``, verl's own, pytest's -- or on the ``lora_stream`` logger itself), so a line is
never printed twice and an application's own logging format wins.

To change it: ``LORA_STREAM_LOG_LEVEL`` in the environment (a level name or a number above 0 -- ``0`` and
``NOTSET`` are refused with a warning, as they would silently hide the lines; ``WARNING`` hides the sync lines,
``DEBUG`` shows every rank's; ``off`` installs no handler and sets no level, Python's defaults apply), or after the
import ``logging.getLogger("lora_stream").setLevel(logging.WARNING)``, or remove :data:`default_handler` from it.

**The progress bar.** :func:`progress_bar`: a ``tqdm`` bar of bytes on rank 0, shown only when stderr is a terminal
(never in a log file, a batch job or a Ray worker), only once a sync has taken :data:`SYNC_BAR_DELAY_S`, and cleared
when it ends. ``LORA_STREAM_PROGRESS=0`` turns it off, ``=1`` on (a terminal or not), where no option chose
(:class:`~lora_stream.SafetensorsSink`'s ``progress=``). tqdm is not a dependency of lora_stream (peft brings it);
without it there is no bar.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, TextIO

__all__ = [
    "LOG_LEVEL_ENV",
    "PROGRESS_ENV",
    "SYNC_BAR_DELAY_S",
    "DefaultHandler",
    "default_handler",
    "install_default_handler",
    "progress_bar",
    "sync_log_level",
]

#: The environment variable read at import: the ``lora_stream`` logger's level, or ``off``.
LOG_LEVEL_ENV = "LORA_STREAM_LOG_LEVEL"
#: The environment variable that forces the progress bar off (``0``) or on (``1``).
PROGRESS_ENV = "LORA_STREAM_PROGRESS"
#: Seconds a sync runs before its bar appears: the short syncs of an RL loop show none.
SYNC_BAR_DELAY_S = 2.0

logger = logging.getLogger("lora_stream")


class DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current ``sys.stderr`` (looked up at each record, as Python's last-resort handler does), unless
    another handler will show the record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", datefmt="%m-%d %H:%M:%S"))

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current stderr

    def emit(self, record: logging.LogRecord) -> None:
        if not _shown_elsewhere(logging.getLogger(record.name), self):
            super().emit(record)


def _shown_elsewhere(start: logging.Logger, mine: logging.Handler) -> bool:
    """Whether a record logged on ``start`` reaches a handler other than ``mine`` (the walk ``callHandlers`` makes;
    Python's last resort does not count: it runs only where no handler exists at all)."""
    node: logging.Logger | None = start
    while node is not None:
        if any(h is not mine for h in node.handlers):
            return True
        node = node.parent if node.propagate else None
    return False


#: The handler :func:`install_default_handler` put on the ``lora_stream`` logger (``None``: none, ``off``).
default_handler: DefaultHandler | None = None


def _level_from_env() -> int | None:
    """``LORA_STREAM_LOG_LEVEL`` as a level; ``None`` for ``off``; ``INFO`` when unset or unreadable."""
    text = os.environ.get(LOG_LEVEL_ENV, "").strip()
    if not text:
        return logging.INFO
    if text.lower() in ("off", "none"):
        return None
    level = int(text) if text.lstrip("-").isdigit() else logging.getLevelName(text.upper())
    if isinstance(level, int) and level > logging.NOTSET:
        return level
    # 0 (NOTSET) and below would not set a level at all: the logger would defer to the root logger (WARNING by
    # default) and silently hide the sync lines, whether "0" was meant as "off" or as "everything".
    why = (
        "is NOTSET, which hides the sync lines behind the root logger's level"
        if isinstance(level, int)
        else "is not a logging level"
    )
    warnings.warn(
        f"{LOG_LEVEL_ENV}={text!r} {why}; set DEBUG, INFO, WARNING, ERROR, a number above 0, or off (no handler, no "
        "level). Using INFO",
        stacklevel=2,
    )
    return logging.INFO


def install_default_handler() -> DefaultHandler | None:
    """Give the ``lora_stream`` logger its level and its default handler, once per process (the module does it at
    import); returns the handler, or ``None`` with ``LORA_STREAM_LOG_LEVEL=off``."""
    global default_handler
    if default_handler is not None:
        return default_handler
    level = _level_from_env()
    if level is None:
        return None
    if os.environ.get(LOG_LEVEL_ENV, "").strip() or logger.level == logging.NOTSET:
        logger.setLevel(level)  # set explicitly, or nobody set one: an application's own level is kept otherwise
    default_handler = DefaultHandler()
    logger.addHandler(default_handler)
    return default_handler


def sync_log_level(rank: int) -> int:
    """The level of a sync's line: ``INFO`` on rank 0, ``DEBUG`` on the others."""
    return logging.INFO if rank == 0 else logging.DEBUG


def progress_bar(
    total: int, desc: str, *, show: bool | None = None, rank: int = 0, delay: float = 0.0, leave: bool = True
) -> Any:
    """A ``tqdm`` bar of ``total`` bytes, or ``None`` where none is shown: on a rank other than 0, with
    ``show=False``, without tqdm, and with ``show=None`` (the default) when stderr is not a terminal or
    ``LORA_STREAM_PROGRESS=0``. ``show=True`` (or ``show=None`` and ``LORA_STREAM_PROGRESS=1``) shows it on any
    stderr. ``delay``: seconds before it appears."""
    if rank != 0:
        return None
    forced = os.environ.get(PROGRESS_ENV, "").strip()
    if show is None and forced in ("0", "1"):
        show = forced == "1"
    if show is None:
        isatty = getattr(sys.stderr, "isatty", None)
        show = bool(isatty()) if callable(isatty) else False
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        delay=delay,
        leave=leave,
        file=sys.stderr,
    )


install_default_handler()
