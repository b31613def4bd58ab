"""No credential in any error, repr, log line, warning or record (issue 32).

A distinctive API key (and a password in a URL's userinfo) is passed to lora_stream, and searched for in everything
lora_stream shows: the reprs of the TRL hook, the server sink and its client; the TRL hook's "options differ" error;
the errors of failure paths triggered cheaply (a closed port, a fleet of two unreachable servers under
``on_replica_failure="exclude"``, a local stand-in server that answers errors and echoes the request's headers back);
every log record (at DEBUG) and warning; and the records (``repr``, :func:`dataclasses.asdict`, the log line).
No vLLM server, no training run: the TRL hook is exercised against a stand-in of TRL's ``VLLMGeneration``.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import threading
import traceback
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from helpers import require, unavailable
from launch import free_port
from torch import nn

from lora_stream import ParamStream
from lora_stream.redaction import REDACTED, is_sensitive, redact, redact_text
from lora_stream.sinks.record import AdapterSyncRecord, SyncRecord

#: The API key: distinctive enough that any occurrence is a leak.
KEY = "sk-lora-stream-TEST-9f3a"
#: A second key (the "other options" of a second use_lora_stream call).
OTHER = "sk-lora-stream-OTHER-77c1"
#: A password in a URL's userinfo.
PASSWORD = "pw-lora-stream-TEST-41d2"
SECRETS = (KEY, OTHER, PASSWORD)


def assert_no_secret(*shown: Any, what: str = "") -> None:
    """None of :data:`SECRETS` occurs in the text of any of ``shown`` (``str`` and ``repr`` of each; an exception
    with its notes, causes and context, as a traceback shows it)."""
    for item in shown:
        if isinstance(item, BaseException):
            texts = ["".join(traceback.format_exception(item)), repr(item)]
        else:
            texts = [str(item), repr(item)]
        for text in texts:
            for secret in SECRETS:
                assert secret not in text, f"{what or type(item).__name__} shows a credential: {text[:2000]}"


@pytest.fixture
def shown(caplog: pytest.LogCaptureFixture) -> Iterator[list[Any]]:
    """Everything logged (every logger, DEBUG and up) and warned during the test: checked for secrets at the end,
    so every test that takes it also checks its log records and warnings (as well as what it appends)."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="lora_stream")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out: list[Any] = []
        yield out
    for record in caplog.records:
        assert_no_secret(record.getMessage(), what=f"log record {record.name}:{record.levelname}")
        if record.exc_info and record.exc_info[1] is not None:
            assert_no_secret(record.exc_info[1], what=f"exception logged by {record.name}")
    for w in caught:
        assert_no_secret(str(w.message), what=f"warning {w.category.__name__}")
    assert_no_secret(*out)


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _closed_url(userinfo: bool = False) -> str:
    return f"http://{f'lora:{PASSWORD}@' if userinfo else ''}127.0.0.1:{free_port()}"


# -- the helper itself -------------------------------------------------------------------------------------------------
def test_redact_hides_credential_values_and_leaves_the_rest() -> None:
    options = {
        "api_key": KEY,
        "Authorization": f"Bearer {KEY}",
        "hf_token": KEY,
        "X-Api-Key": KEY,
        "nested": {"password": PASSWORD, "urls": [f"http://u:{PASSWORD}@h:1"]},
        "base_url": f"https://user:{PASSWORD}@example.com/v1",
        "unset_api_key": None,
        "timeout": 5,
        "max_tokens": 16,
        "tokenizer": "tok",
        "lora_name": "policy",
    }
    shown = redact(options)
    assert_no_secret(shown, repr(shown))
    assert shown["timeout"] == 5 and shown["max_tokens"] == 16 and shown["tokenizer"] == "tok"
    assert shown["lora_name"] == "policy" and shown["unset_api_key"] is None
    assert repr(shown["api_key"]) == REDACTED and shown["base_url"] == f"https://{REDACTED}@example.com/v1"
    assert options["api_key"] == KEY  # a copy: what is used keeps the real value
    for name in ("api_key", "apiKey", "API-KEY", "token", "access_token", "Secret", "PASSWORD", "authorization"):
        assert is_sensitive(name), name
    for name in ("max_tokens", "tokenizer", "timeout", "lora_name", "checkpoint", "keep_bytes"):
        assert not is_sensitive(name), name
    for text in (
        f"Authorization: Bearer {KEY}",
        f"{{'Authorization': 'Basic {KEY}'}}",
        f"api_key={KEY!r}",
        f'{{"secret": "{KEY}"}}',
        f"GET /v1/models?token={KEY}&x=1",
        f"http://user:{PASSWORD}@127.0.0.1:8000",
        f"the key {KEY} refused",
    ):
        assert_no_secret(redact_text(text, secrets=[KEY]), what=text)
    prose = "missing key: model.norm.weight; probe token 12 (17); max_tokens=16; needs a bearer token"
    assert redact_text(prose) == prose


# -- the TRL hook ------------------------------------------------------------------------------------------------------
class _Generation:
    """The attributes of TRL 1.16's server-mode ``VLLMGeneration`` the hook reads (as in tests/test_trl.py)."""

    def __init__(self, model: Any) -> None:
        self.mode = "server"
        self.model = model
        self.accelerator = SimpleNamespace(process_index=0)
        self.enable_sleep_mode = False
        self.server_base_url = "http://127.0.0.1:9"
        self.server_timeout = 5

    def sync_weights(self) -> None:
        raise AssertionError("TRL's own sync ran")


def _installed_hook() -> tuple[Any, Any]:
    """A trainer stand-in whose generation holds a hook installed with ``api_key=KEY`` (as use_lora_stream leaves
    it; nothing reaches a server)."""
    from lora_stream.integrations.trl import TrlSyncHook

    model = _tiny()
    gen = _Generation(model)
    trainer = SimpleNamespace(
        vllm_generation=gen, model=model, model_wrapped=model, state=SimpleNamespace(global_step=0)
    )
    hook = TrlSyncHook(trainer, {}, {"api_key": KEY, "checkpoint": False, "pause": "wait"})
    gen.sync_weights = hook.sync_weights  # type: ignore[method-assign]
    gen._lora_stream_hook = hook  # type: ignore[attr-defined]
    return trainer, hook


def test_the_trl_hooks_repr_shows_no_key(shown: list[Any]) -> None:
    _, hook = _installed_hook()
    assert_no_secret(hook, what="TrlSyncHook")
    assert "sink_options" in repr(hook) and "'api_key': <redacted>" in repr(hook) and "'pause': 'wait'" in repr(hook)
    hook.sink_options["base_url"] = f"http://lora:{PASSWORD}@127.0.0.1:1"
    assert_no_secret(hook, what="TrlSyncHook")


def test_the_trl_hooks_options_differ_error_shows_no_key_and_compares_the_real_values(shown: list[Any]) -> None:
    require("trl")
    from lora_stream.integrations.trl import UnsupportedTrlError, use_lora_stream
    from lora_stream.integrations.trl.guard import _check_version

    try:
        _check_version()
    except UnsupportedTrlError as exc:
        unavailable(str(exc))
    trainer, hook = _installed_hook()
    same = {"api_key": KEY, "checkpoint": False, "pause": "wait"}
    assert use_lora_stream(trainer, sink_options=same) is hook  # the same real values: the installed hook
    with pytest.raises(ValueError, match=r"hook\.remove\(\) first") as info:
        use_lora_stream(trainer, sink_options={**same, "api_key": OTHER})  # only the (redacted) key differs
    assert_no_secret(info.value)
    assert "sink_options['api_key']" in str(info.value), info.value  # the difference is still named
    with pytest.raises(ValueError) as info:
        use_lora_stream(trainer, sink_options={**same, "api_key": OTHER, "pause": "abort"})
    assert_no_secret(info.value)
    assert "'pause': 'abort'" in str(info.value) and "'pause': 'wait'" in str(info.value), info.value


# -- the server sink and its client ------------------------------------------------------------------------------------
def test_the_server_sink_and_client_reprs_show_no_key(shown: list[Any]) -> None:
    from lora_stream import VLLMServerSink
    from lora_stream.sinks import VLLMServerClient

    client = VLLMServerClient(_closed_url(), api_key=f"{KEY}\n")
    sink = VLLMServerSink([_closed_url(), _closed_url()], api_key=KEY, checkpoint=False)
    assert_no_secret(client, sink, sink.client, *(r.client for r in sink.replicas))


def test_the_server_client_repr_shows_no_url_password() -> None:
    from lora_stream.sinks import VLLMServerClient

    assert_no_secret(VLLMServerClient(_closed_url(userinfo=True), api_key=KEY))


def test_an_unreachable_server_raises_without_the_key(shown: list[Any]) -> None:
    from lora_stream import VLLMServerSink
    from lora_stream.sinks import ServerError, VLLMServerClient

    client = VLLMServerClient(_closed_url(), api_key=KEY, timeout=5)
    with pytest.raises(ServerError) as info:
        client.check_access()
    assert_no_secret(info.value)
    sink = VLLMServerSink(_closed_url(), api_key=KEY, checkpoint=False, timeout=5)
    try:
        with pytest.raises(ServerError, match="unreachable") as info:
            sink.sync(ParamStream(_tiny()), version="v1")
        assert_no_secret(info.value)
    finally:
        sink.close()


def test_a_fleet_of_unreachable_servers_excluded_raises_and_logs_without_the_key(
    shown: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``on_replica_failure="exclude"``: each server is logged as excluded, then every server failed: the error
    lists them all with their reasons."""
    from lora_stream import LoraStreamError, VLLMServerSink

    sink = VLLMServerSink(
        [_closed_url(), _closed_url()], api_key=KEY, checkpoint=False, timeout=5, on_replica_failure="exclude"
    )
    try:
        with pytest.raises(LoraStreamError, match="every vLLM server failed") as info:
            sink.sync(ParamStream(_tiny()), version="v1")
        assert_no_secret(info.value)
    finally:
        sink.close()
    assert any("excluding the vLLM server" in r.getMessage() for r in caplog.records)  # the log lines were checked


def test_an_unreachable_server_with_a_password_in_its_url_raises_and_logs_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lora_stream import LoraStreamError, VLLMServerSink

    caplog.set_level(logging.DEBUG, logger="lora_stream")

    sink = VLLMServerSink(
        [_closed_url(userinfo=True), _closed_url(userinfo=True)],
        api_key=KEY,
        checkpoint=False,
        timeout=5,
        on_replica_failure="exclude",
    )
    try:
        with pytest.raises(LoraStreamError) as info:
            sink.sync(ParamStream(_tiny()), version="v1")
    finally:
        sink.close()
    assert_no_secret(info.value, sink.urls, sink.client, *(r.getMessage() for r in caplog.records))


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``status`` and a body that echoes the request's headers (as a debugging proxy's
    error page may): a client that puts the body into its error shows the key."""

    status = 500
    marker = ""
    #: Paths answered otherwise: path -> (status, JSON body).
    routes: ClassVar[dict[str, tuple[int, str]]] = {}

    def _answer(self) -> None:
        status, body_text = self.routes.get(self.path, (self.status, ""))
        body = (body_text or f"error {self.marker}; you sent: {dict(self.headers)}").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if body_text else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def echo() -> Iterator[type[_Echo]]:
    handler = type("Echo", (_Echo,), {"routes": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_401_answer_raises_without_the_key(shown: list[Any], echo: Any) -> None:
    from lora_stream.sinks import ServerError, VLLMServerClient

    echo.status = 401
    with pytest.raises(ServerError, match="requires an API key") as info:
        VLLMServerClient(echo.url, api_key=KEY, timeout=5).check_access()
    assert_no_secret(info.value)


@pytest.mark.parametrize("status, marker", [(500, ""), (409, "busy"), (409, "expired")])
def test_an_error_answer_echoing_the_headers_raises_without_the_key(status: int, marker: str, echo: Any) -> None:
    """Every branch that puts the answer's body into the error: any status >= 400, and the lease's 409s."""
    from lora_stream.engine.lease_terms import BUSY, EXPIRED
    from lora_stream.sinks import ServerError, VLLMServerClient

    echo.status, echo.marker = status, {"": "", "busy": BUSY, "expired": EXPIRED}[marker]
    with pytest.raises(ServerError) as info:
        VLLMServerClient(echo.url, api_key=KEY, timeout=5).check_access()
    assert "you sent" in str(info.value)  # the body is in the error
    assert_no_secret(info.value)


def test_a_server_without_the_lease_warns_and_a_later_refusal_raises_without_the_key(
    shown: list[Any], echo: Any
) -> None:
    """A stand-in server that accepts the key (/v1/models), keeps no lease (404: the sink warns, naming it) and
    then refuses /get_world_size: the warning, the log and the error are checked."""
    from lora_stream import VLLMServerSink
    from lora_stream.sinks import ServerError

    echo.status = 404
    echo.routes.update({"/v1/models": (200, '{"data": []}'), "/get_world_size": (500, '{"error": "no"}')})
    sink = VLLMServerSink(echo.url, api_key=KEY, checkpoint=False, timeout=5)
    try:
        with pytest.warns(RuntimeWarning, match="keeps no weight-update lease") as warned:
            with pytest.raises(ServerError, match="get_world_size") as info:
                sink.sync(ParamStream(_tiny()), version="v1")
    finally:
        sink.close()
    assert_no_secret(info.value, *(str(w.message) for w in warned))


# -- records -----------------------------------------------------------------------------------------------------------
def test_a_record_holds_no_credential(shown: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """What the server sink puts in a record (its addresses, an excluded server's reason, a resume failure, the
    stages keyed by address), with credentials in them: the record stores them redacted."""
    url = f"http://lora:{PASSWORD}@10.0.0.1:8000"
    fields = dict(
        sink="vllm-server/gloo",
        tensors=2,
        bytes=80,
        groups=1,
        seconds=0.1,
        peak_group_bytes=80,
        peak_gathered_bytes=80,
        version="v1",
        stages={"produce_s": 0.01, "replicas": {url: {"sent_bytes": 80}}, "api_key": KEY},
        replicas=(url,),
        excluded={f"http://x:{PASSWORD}@10.0.0.2:8000": f"ServerError: refused (Authorization: Bearer {KEY})"},
        readmitted=(url,),
        resume_failure=f"resuming {url}'s generation failed: api_key={KEY!r}",
    )
    for record in (SyncRecord(**fields), AdapterSyncRecord(**fields, lora_name="policy")):
        caplog.clear()
        record.log()
        assert caplog.records and "(vllm-server over gloo)" in caplog.records[-1].getMessage()
        assert_no_secret(record, dataclasses.asdict(record), record.excluded, record.stages, what="SyncRecord")
        assert_no_secret(caplog.records[-1].getMessage(), what="SyncRecord.log()")
        assert record.replicas == (f"http://{REDACTED}@10.0.0.1:8000",) and record.stages["produce_s"] == 0.01
        assert dataclasses.replace(record, version="v2").replicas == record.replicas  # redacting twice is a no-op
