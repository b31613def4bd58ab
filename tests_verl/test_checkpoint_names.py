"""The checkpoint's names under verl's transformers (5.10, whose weight conversions revert in two phases where the
main suite's 5.19 takes one call): the main suite's own test, every architecture of its table (MoE experts
included), collected again here in verl's environment."""

from __future__ import annotations

from test_architectures import test_the_stream_is_the_merged_checkpoint

__all__ = ["test_the_stream_is_the_merged_checkpoint"]
