"""Syncs a user sees without configuring anything: one log line per sync on rank 0 at the logging defaults of a stock
run (no handler anywhere), the progress bar on a terminal only, and the figures a trainer's metrics take."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import lora, tiny_llama

import lora_stream.sinks.source as source_module
from lora_stream import ParamStream, SafetensorsSink
from lora_stream.reporting import DefaultHandler, default_handler, progress_bar
from lora_stream.sinks import SyncSource
from lora_stream.sinks.record import METRICS, SyncRecord
from lora_stream.sinks.verify import Verification

LOGGER = logging.getLogger("lora_stream")


class FakeTTY(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class NotTTY(io.StringIO):
    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def stock_run() -> Iterator[None]:
    """Logging as a stock TRL or verl script leaves it: no handler on the root logger (pytest's capture handlers,
    added for each phase of a test, taken off inside the block), the ``lora_stream`` logger as importing lora_stream
    set it."""
    assert isinstance(default_handler, DefaultHandler) and LOGGER.handlers == [default_handler], LOGGER.handlers
    assert LOGGER.level == logging.INFO and LOGGER.propagate
    held = logging.root.handlers[:]
    logging.root.handlers.clear()
    try:
        yield
    finally:
        logging.root.handlers[:] = held


def _stream() -> ParamStream:
    return ParamStream(lora(tiny_llama(), target_modules=["q_proj"]), group_by="layer")


def _sync_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "lora_stream" in line]


def test_rank_0_shows_one_line_per_sync_at_the_logging_defaults(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stream = _stream()
    sink = SafetensorsSink(tmp_path / "ckpt", overwrite=True, progress=False, rank=0)
    with stock_run():
        records = [sink.sync(stream, version=f"step-{k}") for k in range(2)]
    lines = _sync_lines(capsys.readouterr().err)
    assert len(lines) == 2, lines
    for line, record in zip(lines, records):
        assert line.startswith("INFO ") and f"lora_stream sync {record.version} (safetensors): " in line, line
        assert f"{record.seconds:.3f} s" in line and f"sent {record.tensors} tensors" in line, line
        assert f"{record.bytes / 2**20:.1f} MiB in {record.groups} groups" in line, line
        assert "skipped 0 unchanged, 0.0 MiB; full; not verified" in line, line


def test_other_ranks_log_their_line_at_debug_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Rank 1's sink syncs (its pass, no writing) and logs nothing at the defaults; its line exists at DEBUG."""
    sink = SafetensorsSink(tmp_path / "ckpt", progress=False, rank=1)
    with stock_run():
        sink.sync(_stream(), version="v1")
    assert _sync_lines(capsys.readouterr().err) == []
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    keep = Keep()
    with stock_run():
        LOGGER.setLevel(logging.DEBUG)
        LOGGER.addHandler(keep)
        try:
            sink.sync(_stream(), version="v2")
        finally:
            LOGGER.removeHandler(keep)
            LOGGER.setLevel(logging.INFO)
    lines = [r for r in seen if "lora_stream sync v2" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG], [(r.levelname, r.getMessage()) for r in seen]
    assert not [r for r in seen if r.levelno >= logging.WARNING], [r.getMessage() for r in seen]
    assert _sync_lines(capsys.readouterr().err) == []  # another handler took it: the default one stepped aside


def test_the_default_handler_steps_aside_for_the_applications_own(capsys: pytest.CaptureFixture[str]) -> None:
    """With a root handler (logging.basicConfig, verl's own) the line is shown once, by that handler."""
    own = io.StringIO()
    record = SyncRecord("test", 1, 2**20, 1, 0.5, 2**20, 2**20, version="v1")
    with stock_run():
        logging.root.addHandler(logging.StreamHandler(own))
        record.log(rank=0)
    assert _sync_lines(own.getvalue()) == [record.summary()]
    assert _sync_lines(capsys.readouterr().err) == []


def test_the_line_says_partial_and_verified_and_the_metrics_carry_the_figures() -> None:
    record = SyncRecord(
        "vllm-colocated",
        tensors=14,
        bytes=12 * 2**20,
        groups=3,
        seconds=0.412,
        peak_group_bytes=4 * 2**20,
        peak_gathered_bytes=4 * 2**20,
        version="step-3",
        skipped_tensors=7,
        skipped_bytes=4 * 2**20,
        verification=Verification(max_abs_diff=0.0012, tolerance=0.05, tokens=9, seconds=0.1),
    )
    assert record.summary() == (
        "lora_stream sync step-3 (vllm-colocated): 0.412 s; sent 14 tensors, 12.0 MiB in 3 groups (0.03 GB/s); "
        "skipped 7 unchanged, 4.0 MiB; partial: only what changed; verified: max |diff| 0.0012 <= 0.0500; "
        "peak group 4.0 MiB, peak gathered 4.0 MiB"
    )
    assert record.metrics() == {
        "lora_stream/sync_s": 0.412,
        "lora_stream/sent_mib": 12.0,
        "lora_stream/skipped_mib": 4.0,
        "lora_stream/tensors": 14.0,
        "lora_stream/peak_gathered_mib": 4.0,
        "lora_stream/partial": 1.0,
        "lora_stream/verified": 1.0,
    }
    assert set(record.metrics()) == {f"lora_stream/{m}" for m in METRICS}
    full = SyncRecord("x", 1, 8, 1, 0.1, 8, 8, full_because="skip_unchanged=False")
    assert "; full: skip_unchanged=False; not verified;" in full.summary()
    assert full.metrics(prefix="")["partial"] == 0.0 and full.metrics(prefix="")["verified"] == 0.0


def test_the_log_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_stream import reporting

    for text, level in [("", logging.INFO), ("WARNING", logging.WARNING), ("debug", logging.DEBUG), ("40", 40)]:
        monkeypatch.setenv(reporting.LOG_LEVEL_ENV, text)
        assert reporting._level_from_env() == level, text
    monkeypatch.setenv(reporting.LOG_LEVEL_ENV, "off")
    assert reporting._level_from_env() is None
    monkeypatch.setenv(reporting.LOG_LEVEL_ENV, "loud")
    with pytest.warns(UserWarning, match="not a logging level"):
        assert reporting._level_from_env() == logging.INFO
    # 0 would set no level: the root logger's WARNING would hide the sync lines without a word. Refused, loudly.
    for text in ("0", "NOTSET", "-5"):
        monkeypatch.setenv(reporting.LOG_LEVEL_ENV, text)
        with pytest.warns(UserWarning, match="above 0"):
            assert reporting._level_from_env() == logging.INFO, text


def test_log_level_zero_still_shows_the_sync_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end in a fresh interpreter: LORA_STREAM_LOG_LEVEL=0 warns and the INFO line still reaches stderr."""
    import subprocess

    code = "import logging, lora_stream; logging.getLogger('lora_stream').info('a sync line')"
    env = {**os.environ, "LORA_STREAM_LOG_LEVEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "a sync line" in out.stderr and "above 0" in out.stderr, out.stderr


# -- the progress bar --------------------------------------------------------------------------------------------------
def test_the_bar_is_shown_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_stream.reporting import PROGRESS_ENV

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", NotTTY())
    assert progress_bar(100, "syncing") is None
    assert progress_bar(100, "syncing", show=True) is not None
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert progress_bar(100, "syncing") is not None
    terminal = FakeTTY()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert progress_bar(100, "syncing") is None
    monkeypatch.delenv(PROGRESS_ENV)
    assert progress_bar(100, "syncing", show=False) is None
    assert progress_bar(100, "syncing", rank=1) is None
    bar = progress_bar(100, "syncing")
    assert bar is not None
    bar.update(100)
    bar.close()
    assert "syncing" in terminal.getvalue() and "100/100" in terminal.getvalue(), terminal.getvalue()


def test_a_sync_and_a_save_draw_their_bar_on_a_terminal_and_none_elsewhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from lora_stream.reporting import PROGRESS_ENV

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    monkeypatch.setattr(source_module, "SYNC_BAR_DELAY_S", 0.0)  # this sync is short: show it at once
    for stderr, shown in [(NotTTY(), False), (FakeTTY(), True)]:
        monkeypatch.setattr(sys, "stderr", stderr)
        source = SyncSource(_stream(), {}, "v1")
        for _ in source.iter_groups():
            pass
        assert ("lora_stream sync v1" in stderr.getvalue()) is shown, stderr.getvalue()
        # A save's bar is its writing's (the shard), never the sync's as well.
        SafetensorsSink(tmp_path / f"ckpt-{shown}", rank=0).sync(_stream())
        assert (f"saving ckpt-{shown}" in stderr.getvalue()) is shown, stderr.getvalue()
        assert stderr.getvalue().count("lora_stream sync") == int(shown), stderr.getvalue()
