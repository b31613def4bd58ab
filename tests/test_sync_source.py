"""SyncSource, what every sink sends: aliases travel in their primary's group, and a failure's text reaches the
pass that the other ranks hear from, even when a subclass wraps the stream's pass in a generator of its own."""

from __future__ import annotations

import pytest
from helpers import lora, tiny_llama

from lora_stream import ParamStream
from lora_stream.sinks import SyncSource
from lora_stream.stream_pass import PassState


class Wrapped(ParamStream):
    def iter_groups(self):  # type: ignore[no-untyped-def,override]
        yield from super().iter_groups()


@pytest.mark.parametrize("cls", [ParamStream, Wrapped])
def test_an_exception_in_the_consumer_becomes_the_stop_reason_of_the_stream_pass(cls: type[ParamStream]) -> None:
    source = SyncSource(cls(lora(tiny_llama(), target_modules=["q_proj"]), group_by="module"))
    with pytest.raises(ValueError, match="disk full"):
        with source.batches() as batches:
            for _ in batches:
                raise ValueError("disk full")
    assert source.pass_ is not None
    assert source.pass_.state == PassState.STOPPED
    assert source.pass_.stop_reason == "ValueError: disk full"


def test_tied_aliases_travel_in_their_primary_group_and_are_counted() -> None:
    stream = ParamStream(lora(tiny_llama(tie=True), target_modules=["q_proj"]), group_by="module")
    source = SyncSource(stream, {"lm_head.weight": "model.embed_tokens.weight"})
    groups = list(source.iter_groups())
    assert groups[0][0] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert groups[0][1][0] is groups[0][1][1]
    assert [m.name for m in source.metadata()] == [n for names, _ in groups for n in names]
    record = source.record("test", 0.1)
    assert record.tensors == len(stream.metadata()) + 1 and record.groups == len(stream.groups())
    assert source.pass_ is not None and source.pass_.state == PassState.COMPLETE


def test_the_server_sinks_current_source_forwards_aliases_and_the_adapter() -> None:
    """The trainer-side transfer engine reads ``aliases`` (sent as optional names) and ``adapter`` from the source it
    was built with, the sink's proxy of the current sync: both must come through."""
    from lora_stream.sinks.server_replica import CurrentSource as _CurrentSource

    model = lora(tiny_llama(tie=True), target_modules=["q_proj"])
    stream = ParamStream(model)
    proxy = _CurrentSource()
    proxy.current = SyncSource(stream, {"lm_head.weight": "model.embed_tokens.weight"}, "v1", {"path": "p"})
    assert proxy.aliases == ["lm_head.weight"]
    assert proxy.adapter == {"path": "p"} and proxy.weight_version == "v1"
