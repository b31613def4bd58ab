"""What lora_stream relies on in vLLM, as data; a checker that reads a vLLM source tree or wheel, never importing it.

Why: lora_stream reaches into vLLM internals (the weight-transfer engine base classes, the layerwise reload bracket, the
LoRA worker manager, the dev-mode routes of the API server) that change between releases without notice, and the CUDA
releases (``vllm`` 0.33, 0.34) cannot be installed, let alone run, on a CPU-only machine. Their Python sources can
still be read: this module parses them with :mod:`ast` (from a directory holding ``vllm/`` or straight from a wheel
with :mod:`zipfile`) and reports every name, signature, base class and route that lora_stream uses and a release lacks.

Each entry of :data:`CONTRACT` names the lora_stream module that relies on it (``used_by``). Keep the list to what
``src/lora_stream`` (and the tests that reach vLLM directly) really use: an entry nothing uses would fail releases for
no reason, and a use with no entry is a blind spot.

Usage: ``python tests/vllm_contract.py PATH...`` (a wheel, or a directory holding ``vllm/``) prints the violations.

The routes of the API server are read by :func:`read_routes` (every way FastAPI and Starlette register a route or a
mount); where a release runs, :func:`running_routes` builds its apps, so that the reading is checked against them.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "CONTRACT",
    "Call",
    "Calls",
    "Class",
    "Function",
    "LoaderChecks",
    "Mentions",
    "Module",
    "Route",
    "RouteReading",
    "RouteSite",
    "Source",
    "Value",
    "app_routes",
    "check",
    "read_routes",
    "running_routes",
]


# -- reading a vLLM release -------------------------------------------------------------------------------------------


class Source:
    """The Python files of one vLLM release: a directory that holds ``vllm/`` (an installed site-packages, an unpacked
    wheel) or a wheel read in place (no unzip to disk: a CUDA wheel is hundreds of MB, its ``.py`` files a few)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, str] | None = None
        if self.path.is_file():
            with zipfile.ZipFile(self.path) as wheel:
                self._files = {
                    n: wheel.read(n).decode("utf-8", "replace")
                    for n in wheel.namelist()
                    if n.startswith("vllm/") and n.endswith(".py")
                }
        elif not (self.path / "vllm").is_dir():
            raise FileNotFoundError(f"{self.path}: neither a wheel nor a directory holding vllm/")
        self._trees: dict[str, ast.Module | None] = {}

    def __repr__(self) -> str:
        return f"Source({str(self.path)!r})"

    def read(self, rel: str) -> str | None:
        """The text of ``rel`` (``vllm/x/y.py``), or ``None`` when the release has no such file."""
        if self._files is not None:
            return self._files.get(rel)
        p = self.path / rel
        return p.read_text("utf-8", "replace") if p.is_file() else None

    def files_under(self, prefix: str) -> list[str]:
        """Every ``.py`` file under ``prefix`` (``vllm/entrypoints/``), sorted."""
        if self._files is not None:
            return sorted(n for n in self._files if n.startswith(prefix))
        root = self.path / prefix
        return sorted(str(p.relative_to(self.path)) for p in root.rglob("*.py")) if root.is_dir() else []

    def module_file(self, module: str) -> str | None:
        """The file that defines ``module`` (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), or ``None``."""
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if self.read(rel) is not None:
                return rel
        return None

    def tree(self, rel: str) -> ast.Module | None:
        """``rel`` parsed (cached); ``None`` when it is missing."""
        if rel not in self._trees:
            text = self.read(rel)
            self._trees[rel] = None if text is None else _parse(text, rel)
        return self._trees[rel]

    def module_tree(self, module: str) -> ast.Module | None:
        rel = self.module_file(module)
        return None if rel is None else self.tree(rel)


@lru_cache(maxsize=4096)
def _parse(text: str, rel: str) -> ast.Module:
    """``text`` parsed, once per text: the tests read many copies of one release that differ in a file or two."""
    return ast.parse(text, rel)


Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | ast.Assign | ast.AnnAssign


def _top_level(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module body, including those nested in top-level ``if`` / ``try`` blocks (vLLM guards
    optional imports that way)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(part)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def resolve(src: Source, module: str, name: str, depth: int = 0) -> tuple[str, Definition] | None:
    """Where ``module.name`` is defined: ``(defining module, node)``, following ``from x import name`` re-exports
    (vLLM's package ``__init__`` files re-export most of what lora_stream imports). ``None`` if it is not there."""
    rel = src.module_file(module)
    if rel is None or depth > 8:
        return None
    tree = src.tree(rel)
    assert tree is not None
    found: tuple[str, Definition] | None = None
    for node in _top_level(tree.body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = (module, node)  # the last binding wins, as at run time
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = (module, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = (module, node)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    origin = _absolute(module, rel.endswith("__init__.py"), node)
                    if origin.split(".")[0] != "vllm":
                        continue
                    inner = resolve(src, origin, alias.name, depth + 1)
                    if inner is None and src.module_file(f"{origin}.{alias.name}") is None:
                        continue
                    if inner is not None:
                        found = inner
    return found


# -- the contract's vocabulary ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """How lora_stream calls a function or method: ``positional`` arguments (after ``self``) and these keywords.
    ``params``, when given, are the exact parameter names the callee must have (after ``self``): for a method that
    lora_stream *overrides*, which vLLM calls with its own arguments."""

    positional: int = 0
    keywords: tuple[str, ...] = ()
    params: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Module:
    """The module exists."""

    module: str
    used_by: str


@dataclass(frozen=True)
class Function:
    """A module-level function (or a re-export of one) that accepts ``call``. With ``fallback`` (what lora_stream
    does instead, in words), a release without the function (or its module) satisfies the entry; one that has it
    must still accept ``call``, since lora_stream then calls vLLM's."""

    module: str
    name: str
    call: Call
    used_by: str
    fallback: str | None = None


@dataclass(frozen=True)
class Value:
    """A module-level constant with this literal value (``name = value``)."""

    module: str
    name: str
    value: object
    used_by: str


@dataclass(frozen=True)
class Class:
    """A class, with the methods lora_stream calls or overrides (``methods``, each with how it is called), the
    attributes it reads (class-level, dataclass or struct fields, ``self.x = ...`` in any method, properties; base
    classes inside vLLM included), the base classes it must derive from (``bases``, as written in vLLM), and, for a
    base class lora_stream subclasses, the methods its subclass implements (``implements``): an abstract method of
    vLLM's outside that set would make lora_stream's subclass impossible to instantiate."""

    module: str
    name: str
    used_by: str
    methods: dict[str, Call] = field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    bases: tuple[str, ...] = ()
    implements: tuple[str, ...] | None = None

    def __hash__(self) -> int:
        return hash((self.module, self.name))


@dataclass(frozen=True)
class Route:
    """An HTTP route registered in vLLM's API server sources (in any form :func:`read_routes` reads, anywhere under
    ``vllm/entrypoints``), whose handler reads or answers these ``fields`` (as a parameter of the handler or a string
    literal in its body: a query parameter, a JSON body field, a key of its answer).

    ``when`` (``(module, class, method)``): the route is required only in a release whose class has that method,
    for a route lora_stream serves only as part of a vLLM protocol that older releases do not have yet (a release
    with the method but without the route is a violation)."""

    method: str
    path: str
    used_by: str
    fields: tuple[str, ...] = ()
    when: tuple[str, str, str] | None = None


@dataclass(frozen=True)
class Calls:
    """``name`` (``"function"`` or ``"Class.method"``, in ``module``) calls ``<...>.<receiver>.<method>(...)``: a
    call lora_stream observes at run time by shadowing ``method`` on the receiver object, which sees the call only
    while vLLM makes it through that attribute."""

    module: str
    name: str
    receiver: str
    method: str
    used_by: str


@dataclass(frozen=True)
class LoaderChecks:
    """The checks a vLLM loader runs on what it built, replayed by lora_stream's own loader: every call
    ``self.<via>.<name>(...)`` in ``module.cls.method`` must be, in order, exactly what lora_stream's ``pick``
    (a dotted path to a function taking the callee class) chooses for this release, given the methods the class
    ``target`` (``(module, class)``) has in it; each chosen method must exist and take ``call``. ``helper`` names
    a local variable of the loader (``peft_helper``) whose method calls must be exactly ``helper_calls``: lora_stream
    makes those calls too.

    A check the release's loader runs that lora_stream would not (a new validation, a rename) and a method
    lora_stream would call that the loader does not run both fail: never skip a validation vLLM runs, never run
    one it does not."""

    module: str
    cls: str
    method: str
    via: str
    target: tuple[str, str]
    pick: str
    used_by: str
    call: Call = Call(1)
    helper: str | None = None
    helper_calls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mentions:
    """Names that must occur in a module, as an identifier, an attribute, a keyword or a string literal: for what is
    looked up by name at run time (environment variables in ``vllm/envs.py``, ``app.state`` attributes, lazily
    exported names)."""

    module: str
    names: tuple[str, ...]
    used_by: str
    #: Anywhere in the package ``module`` (every file under it), not in one module: for a name lora_stream reads off
    #: an object (``args.api_key``) whose defining module it never imports, and which vLLM may move.
    package: bool = False


Entry = Module | Function | Value | Class | Route | Mentions | LoaderChecks | Calls


# -- the contract: what lora_stream uses -------------------------------------------------------------------------------

_BASE = "vllm.distributed.weight_transfer.base"
_RELOAD = "vllm.model_executor.model_loader.reload"

#: Every vLLM name lora_stream relies on (src/lora_stream, and the tests that reach vLLM directly), with who relies on
#: it. Found by grepping for ``vllm`` imports, attributes and routes; see the module docstring.
CONTRACT: tuple[Entry, ...] = (
    # ---- weight-transfer engines: lora_stream's backend subclasses vLLM's, on both sides ----
    Class(
        _BASE,
        "WeightTransferEngine",
        "lora_stream.engine.receiver (WorkerTransferEngine subclasses it; vLLM's worker calls the overridden methods)",
        methods={
            "__init__": Call(4, params=("config", "vllm_config", "device", "model")),  # super().__init__(...)
            "parse_update_info": Call(1),  # receiver.update_weights
            "init_transfer_engine": Call(params=("init_info",)),
            "start_weight_update": Call(params=()),
            "finish_weight_update": Call(params=()),
            "update_weights": Call(params=("update_info",)),
            "receive_weights": Call(params=("update_info",)),
            "shutdown": Call(params=()),
        },
        # read in receiver.py (parallel_config.data_parallel_index / world_size / rank, model_config, device, ...)
        attributes=("init_info_cls", "update_info_cls", "vllm_config", "parallel_config", "model_config", "device"),
        implements=(
            "__init__",
            "init_transfer_engine",
            "start_weight_update",
            "finish_weight_update",
            "update_weights",
            "receive_weights",
            "shutdown",
        ),
    ),
    Class(_BASE, "WeightTransferInitInfo", "lora_stream.transfer.protocol (TransferInitInfo subclasses it)"),
    Class(_BASE, "WeightTransferUpdateInfo", "lora_stream.transfer.protocol (TransferUpdateInfo subclasses it)"),
    Class(
        _BASE,
        "TrainerInitInfo",
        "lora_stream.transfer.sender (TrainerTransferInitInfo subclasses it, sets backend, reads is_sender)",
        attributes=("backend", "rank", "is_sender"),
    ),
    Class(
        _BASE,
        "TrainerWeightTransferEngine",
        "lora_stream.transfer.sender (TrainerTransferEngine subclasses it and builds itself with cls(client=, ...))",
        methods={"__init__": Call(keywords=("client", "source", "is_sender"))},
        attributes=("is_sender", "client", "source"),
        implements=("trainer_init", "send_weights", "shutdown"),
    ),
    Class(
        _BASE,
        "WeightTransferUpdateRequest",
        "lora_stream.engine.lease (a heal rolls an update back through the engine client)",
        methods={"__init__": Call(keywords=("update_info",))},
    ),
    Class(
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferEngineFactory",
        "lora_stream.engine.plugin (registers the worker engine)",
        methods={"register_engine": Call(3)},
        attributes=("_registry",),
    ),
    Class(
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferTrainerFactory",
        "lora_stream.engine.plugin (registers the trainer engine)",
        methods={"register_engine": Call(3)},
        attributes=("_registry",),
    ),
    # ---- the plugin system that loads lora_stream's plugin in every server process ----
    Value("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "vllm.general_plugins", "pyproject.toml's entry point group"),
    Function("vllm.plugins", "load_general_plugins", Call(), "tests/check_wheel.py (vLLM's own plugin loader)"),
    # ---- the layerwise reload bracket ----
    Function(_RELOAD, "initialize_layerwise_reload", Call(1), "lora_stream.engine.reload (ReloadBracket.begin)"),
    Function(_RELOAD, "finalize_layerwise_reload", Call(2), "lora_stream.engine.reload (ReloadBracket.finish)"),
    Value(f"{_RELOAD}.layerwise", "LAYERWISE_INFO", None, "lora_stream.engine.reload (per-module reload counts)"),
    Function(
        f"{_RELOAD}.layerwise",
        "_place_kernel_tensors",
        Call(2),
        "lora_stream.engine.reload (puts back a module that got part of its weights)",
    ),
    Value(f"{_RELOAD}.meta", "SKIP_LOAD_TENSORS", None, "lora_stream.engine.vllm_reload (_expected_numel)"),
    Function(f"{_RELOAD}.utils", "get_tensor_load_numel", Call(1), "lora_stream.engine.vllm_reload (_expected_numel)"),
    Class(
        f"{_RELOAD}.types",
        "LayerReloadingInfo",
        "lora_stream.engine.reload (reads what each module got before finalize)",
        methods={"can_load": Call(), "reset": Call()},
        attributes=("load_numel", "loaded_weights", "kernel_tensors"),
    ),
    Class(
        "vllm.model_executor.layers.fused_moe.modular_kernel",
        "FusedMoEExperts",
        "lora_stream.engine.vllm_reload (_experts_relaid_after_load)",
        methods={"process_weights_after_loading": Call(1)},
    ),
    Class(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts",
        "lora_stream.engine.vllm_reload (RELAYOUT_REPEATED names it)",
        methods={"process_weights_after_loading": Call(1)},
    ),
    Calls(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        "UnquantizedFusedMoEMethod._setup_kernel",
        "fused_experts",
        "process_weights_after_loading",
        "lora_stream.engine.reload (ReloadBracket watches the experts' re-layout; repeats it only where vLLM did not)",
    ),
    Class(
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base",
        "FusedMoEMethodBase",
        "lora_stream.engine.reload (quant_method.moe_kernel.fused_experts)",
        attributes=("moe_kernel",),
    ),
    # ---- the verification probe and digests ----
    Function(
        "vllm.forward_context",
        "set_forward_context",
        Call(2, keywords=("num_tokens", "slot_mapping")),
        "lora_stream.engine.probe (probe_logprobs)",
    ),
    Function(
        "vllm.model_executor.model_loader.weight_checksum",
        "compute_tensor_digests",
        Call(1),
        "lora_stream.engine.probe (weight_digests: verify= on every route)",
        fallback="lora_stream.engine.probe._compute_tensor_digests, vLLM 0.32's function (vLLM 0.31 has none)",
    ),
    Function("vllm.distributed.parallel_state", "get_pp_group", Call(), "lora_stream.engine.receiver (_layout)"),
    Function("vllm.distributed.parallel_state", "get_tp_group", Call(), "lora_stream.engine.receiver (_layout)"),
    Class(
        "vllm.distributed.parallel_state",
        "GroupCoordinator",
        "lora_stream.engine.receiver (_layout)",
        attributes=("rank_in_group",),
    ),
    Class(
        "vllm.config.parallel",
        "ParallelConfig",
        "lora_stream.engine.receiver, lora_stream.engine.probe",
        attributes=("data_parallel_index", "world_size", "rank", "pipeline_parallel_size", "worker_extension_cls"),
    ),
    Class(
        "vllm.config.model",
        "ModelConfig",
        "lora_stream.sinks.verify, lora_stream.engine.receiver, lora_stream.engine.merger, lora_stream.engine.probe",
        methods={"get_vocab_size": Call()},
        attributes=("hf_config", "hf_text_config", "dtype", "model", "uses_mrope"),
    ),
    # ---- LoRA: adapters staged in memory and loaded by vLLM's own add_lora ----
    Class(
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "lora_stream.engine.adapter_staging (wraps _load_adapter, reads the manager's state)",
        methods={"_load_adapter": Call(params=("lora_request",))},
        attributes=("_adapter_manager", "max_position_embeddings", "lora_config", "_lora_model_cls", "vocab_size"),
    ),
    Class(
        "vllm.lora.peft_helper",
        "PEFTHelper",
        "lora_stream.engine.adapter_staging, lora_stream.sinks.vllm_lora, lora_stream.sinks.server_client",
        methods={"from_dict": Call(1), "validate_legal": Call(1)},
    ),
    Class(
        "vllm.lora.lora_model",
        "LoRAModel",
        "lora_stream.engine.adapter_staging (build_lora_model, check_accepted)",
        methods={
            "from_lora_tensors": Call(
                keywords=(
                    "lora_model_id",
                    "tensors",
                    "peft_helper",
                    "device",
                    "dtype",
                    "model_vocab_size",
                    "weights_mapper",
                    "skip_prefixes",
                )
            )
        },
        attributes=("loras", "is_3d_lora_weight"),
    ),
    Class(
        "vllm.lora.lora_weights",
        "LoRALayerWeights",
        "lora_stream.engine.adapter_staging (check_accepted)",
        attributes=("lora_a", "lora_b", "scaling"),
    ),
    Class(
        "vllm.lora.model_manager",
        "LoRAModelManager",
        "lora_stream.engine.adapter_staging (the engine's LoRA layers)",
        attributes=("modules", "packed_modules", "model"),
    ),
    LoaderChecks(
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "_load_adapter",
        via="_adapter_manager",
        target=("vllm.lora.model_manager", "LoRAModelManager"),
        pick="lora_stream.engine.adapter_staging.loader_validations",
        used_by="lora_stream.engine.adapter_staging (build_lora_model runs the validations vLLM's _load_adapter runs)",
        helper="peft_helper",
        helper_calls=("validate_legal",),
    ),
    Class(
        "vllm.lora.request",
        "LoRARequest",
        "lora_stream.sinks.vllm_lora, lora_stream.engine.adapter_staging",
        attributes=("lora_name", "lora_int_id", "lora_path", "load_inplace", "is_3d_lora_weight"),
    ),
    Class("vllm.lora.layers", "BaseLayerWithLoRA", "lora_stream.engine.state_digest (LoRA layers' own state)"),
    Class(
        "vllm.entrypoints.serve.lora.protocol",
        "LoadLoRAAdapterRequest",
        "lora_stream.engine.lease (restores the adapter a heal rolls back), lora_stream.sinks.server_client",
        attributes=("lora_name", "lora_path", "load_inplace"),
    ),
    Class(
        "vllm.entrypoints.serve.lora.protocol",
        "UnloadLoRAAdapterRequest",
        "lora_stream.engine.lease",
        attributes=("lora_name",),
    ),
    Class(
        "vllm.entrypoints.openai.models.serving",
        "OpenAIServingModels",
        "lora_stream.engine.lease (app.state.openai_serving_models)",
        methods={"load_lora_adapter": Call(1), "unload_lora_adapter": Call(1)},
    ),
    # ---- the engine in this process or a child process (colocated and LoRA sinks) ----
    Class(
        "vllm.entrypoints.llm",
        "LLM",
        "lora_stream.sinks.local_engine, lora_stream.sinks.verify, lora_stream.sinks.vllm_lora",
        methods={
            "collective_rpc": Call(1, keywords=("args",)),
            "reset_prefix_cache": Call(),
            "generate": Call(2, keywords=("lora_request", "use_tqdm")),
        },
        attributes=("llm_engine",),
    ),
    Class(
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "lora_stream.sinks.local_engine (engine_core / model_executor chains, sleep), lora_stream.sinks.vllm_lora",
        methods={"add_lora": Call(1), "remove_lora": Call(1), "sleep": Call(1)},
        attributes=("engine_core", "model_executor", "model_config", "vllm_config"),
    ),
    Class(
        "vllm.sampling_params",
        "SamplingParams",
        "lora_stream.sinks.verify (SamplingParams(max_tokens=, temperature=, prompt_logprobs=))",
        attributes=("max_tokens", "temperature", "prompt_logprobs"),
    ),
    Class("vllm.inputs", "TokensPrompt", "lora_stream.sinks.verify", attributes=("prompt_token_ids",)),
    Mentions("vllm", ("SamplingParams", "LLM"), "lora_stream.sinks.verify (from vllm import SamplingParams)"),
    Class(
        "vllm.compilation.cuda_graph",
        "CUDAGraphWrapper",
        "lora_stream.engine.state_digest / holding (unwrap), tests/test_engine_state.py",
        methods={"__init__": Call(3), "unwrap": Call()},
        attributes=("runnable",),
    ),
    # ---- the API server: middleware hook, engine client, app state, dev-mode routes ----
    Function(
        "vllm.entrypoints.serve.middleware.register",
        "init_entrypoints_middleware",
        Call(2, params=("args", "app", "supported_tasks")),  # plugin._install_lease reads args[1] / kwargs["app"]
        "lora_stream.engine.plugin (_install_lease wraps it)",
    ),
    Mentions(
        "vllm.entrypoints.launchers.app",
        ("init_entrypoints_middleware",),
        "lora_stream.engine.plugin (_MIDDLEWARE_MODULES: the module that imported the name)",
    ),
    Class(
        "vllm.engine.protocol",
        "EngineClient",
        "lora_stream.engine.lease (heal: roll back, finish, resume)",
        methods={
            "update_weights": Call(keywords=("request",)),
            "finish_weight_update": Call(1),
            "resume_generation": Call(),
        },
    ),
    Mentions(
        "vllm.entrypoints.launchers.api_server.app_state",
        ("engine_client", "openai_serving_models", "args"),
        "lora_stream.engine.lease (app.state.engine_client / openai_serving_models / args)",
    ),
    Mentions(
        "vllm.entrypoints",
        ("api_key", "api_server_count", "middleware"),
        "lora_stream.engine.guard and lease (args.api_key, args.api_server_count; --middleware)",
        package=True,
    ),
    Mentions(
        "vllm.envs",
        (
            "VLLM_SERVER_DEV_MODE",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            "VLLM_ENABLE_V1_MULTIPROCESSING",
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_API_KEY",
        ),
        "lora_stream.sinks.vllm_server / vllm_colocated / engine.guard (documented and read environment)",
    ),
    Route("POST", "/init_weight_transfer_engine", "lora_stream.sinks.server_client", ("init_info",)),
    Route("POST", "/start_weight_update", "lora_stream.sinks.server_client"),
    Route("POST", "/update_weights", "lora_stream.sinks.server_client", ("update_info",)),
    Route("POST", "/finish_weight_update", "lora_stream.sinks.server_client", ("weight_version",)),
    Route(
        "POST",
        "/shutdown_weight_transfer_engine",
        "lora_stream.sinks.server_client (shutdown_weight_transfer_engine, as vLLM's own HTTP client has it)",
        when=(
            "vllm.distributed.weight_transfer.clients",
            "HTTPVLLMWeightSyncClient",
            "shutdown_weight_transfer_engine",
        ),
    ),
    Route("POST", "/update_weight_version", "lora_stream.sinks.server_client", ("new_version",)),
    Route("GET", "/weight_info", "lora_stream.sinks.server_client", ("weight_version",)),
    Route("GET", "/get_world_size", "lora_stream.sinks.server_client", ("world_size",)),
    Route("GET", "/server_info", "lora_stream.sinks.server_client (server_config)", ("config_format",)),
    Route("POST", "/reset_prefix_cache", "lora_stream.sinks.server_client"),
    Route("POST", "/pause", "lora_stream.sinks.server_client", ("mode",)),
    Route("POST", "/resume", "lora_stream.sinks.server_client"),
    Route("POST", "/collective_rpc", "lora_stream.engine.lease (WRITE_PATHS, GUARDED_PATHS)"),
    Route("POST", "/sleep", "lora_stream.engine.lease (WRITE_PATHS, GUARDED_PATHS)"),
    Route("POST", "/wake_up", "lora_stream.engine.lease (GUARDED_PATHS)"),
    Route("GET", "/v1/models", "lora_stream.sinks.server_client (reachable)"),
    Route("POST", "/v1/load_lora_adapter", "lora_stream.sinks.server_client (adapter sync)"),
    Route("POST", "/v1/unload_lora_adapter", "lora_stream.sinks.server_client (adapter sync)"),
)


# -- the checker ------------------------------------------------------------------------------------------------------


def _call_problem(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: Call, method: bool) -> str | None:
    """Why ``fn`` cannot be called as ``call`` (``None``: it can). ``method``: the first parameter is bound."""
    a = fn.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    positional = [*a.posonlyargs, *a.args]
    if method and not static:
        positional = positional[1:]
    names = [p.arg for p in positional]
    shown = f"{fn.name}({', '.join(names + ([f'*{a.vararg.arg}'] if a.vararg else []))}"
    shown += "".join(f", {k.arg}=" for k in a.kwonlyargs) + (f", **{a.kwarg.arg}" if a.kwarg else "") + ")"
    if call.params is not None:
        exact = tuple(names + [k.arg for k in a.kwonlyargs])
        if exact != call.params and not (a.vararg and a.kwarg and not exact):
            return f"parameters are now {shown}, lora_stream expects ({', '.join(call.params)})"
        return None  # vLLM calls it (an override, a wrapped function): the names are the contract
    defaults_from = len(positional) - len(a.defaults)
    if call.positional > len(positional) and a.vararg is None:
        return f"takes at most {len(positional)} positional argument(s), lora_stream passes {call.positional}: {shown}"
    posonly = {p.arg for p in a.posonlyargs}
    for kw in call.keywords:
        if kw not in names and kw not in {k.arg for k in a.kwonlyargs} and a.kwarg is None:
            return f"has no parameter {kw!r}, which lora_stream passes: {shown}"
        if kw in posonly:
            return f"parameter {kw!r} is positional-only now: {shown}"
    for i, p in enumerate(positional):
        if i >= call.positional and i < defaults_from and p.arg not in call.keywords:
            return f"requires {p.arg!r}, which lora_stream does not pass: {shown}"
    for k, default in zip(a.kwonlyargs, a.kw_defaults):
        if default is None and k.arg not in call.keywords:
            return f"requires keyword {k.arg!r}, which lora_stream does not pass: {shown}"
    return None


def _class_chain(src: Source, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    """``cls`` and its base classes defined inside vLLM, in method-resolution order (depth first, enough here)."""
    chain: list[tuple[str, ast.ClassDef]] = [(module, cls)]
    for base in cls.bases:
        node = base.value if isinstance(base, ast.Subscript) else base
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name is None:
            continue
        found = resolve(src, module, name)
        if found is not None and isinstance(found[1], ast.ClassDef) and found[1] is not cls:
            chain += [c for c in _class_chain(src, *found) if c not in chain]  # type: ignore[arg-type]
    return chain


def _method(chain: list[tuple[str, ast.ClassDef]], name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for _, cls in chain:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
    return None


def _is_abstract(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "abstractmethod")
        or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
        for d in fn.decorator_list
    )


def _attributes(chain: list[tuple[str, ast.ClassDef]]) -> set[str]:
    """Names an instance of the class has: class-level assignments and annotations (dataclass, struct and TypedDict
    fields), methods and properties, and every ``self.x = ...`` in a method."""
    names: set[str] = set()
    for _, cls in chain:
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                for sub in ast.walk(node):
                    targets: list[ast.expr] = []
                    if isinstance(sub, ast.Assign):
                        targets = list(sub.targets)
                    elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                        targets = [sub.target]
                    for t in targets:
                        for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name):
                                if el.value.id in ("self", "cls"):
                                    names.add(el.attr)
    return names


def _check_class(src: Source, entry: Class) -> list[str]:
    where = f"{entry.module}.{entry.name}"
    found = resolve(src, entry.module, entry.name)
    if found is None:
        what = "module missing" if src.module_file(entry.module) is None else "class missing"
        return [f"{where}: {what} (used by {entry.used_by})"]
    module, node = found
    if not isinstance(node, ast.ClassDef):
        return [f"{where}: no longer a class (used by {entry.used_by})"]
    chain = _class_chain(src, module, node)
    problems: list[str] = []
    written = {ast.unparse(b) for b in node.bases}
    for base in entry.bases:
        if base not in written:
            problems.append(f"{where}: no longer derives from {base} (bases: {sorted(written)}; {entry.used_by})")
    for name, call in entry.methods.items():
        fn = _method(chain, name)
        if fn is None:
            if name == "__init__" and call.params is None:
                fields = _attributes(chain)
                missing = [k for k in call.keywords if k not in fields]
                if not missing:  # a dataclass or struct: its fields are its constructor's keywords
                    continue
            problems.append(f"{where}.{name}: method missing (used by {entry.used_by})")
            continue
        why = _call_problem(fn, call, method=True)
        if why is not None:
            problems.append(f"{where}.{name}: {why} ({entry.used_by})")
    if entry.attributes:
        have = _attributes(chain)
        for attr in entry.attributes:
            if attr not in have:
                problems.append(f"{where}.{attr}: attribute missing (used by {entry.used_by})")
    if entry.implements is not None:
        abstract = {
            n.name
            for _, cls in chain
            for n in cls.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_abstract(n)
        }
        for name in sorted(abstract - set(entry.implements)):
            problems.append(
                f"{where}.{name}: new abstract method, which lora_stream's subclass does not implement "
                f"({entry.used_by})"
            )
    return problems


def _identifiers(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
    return out


# -- the API server's routes, read from the sources -------------------------------------------------------------------

Handler = ast.FunctionDef | ast.AsyncFunctionDef
#: What routes are registered on: ``(module, scope, name)`` of the variable holding a router or app (scope ``""`` for a
#: module-level one, else the dotted name of the function that binds it).
RouterKey = tuple[str, str, str]

#: FastAPI's method decorators (``@router.post("/x")``, on ``APIRouter`` and ``FastAPI`` alike).
_HTTP_VERBS = ("get", "post", "put", "delete", "patch", "options", "head", "trace")
#: Classes that hold routes: ``include_router``, ``mount`` and the route decorators register on their instances.
_ROUTERS = ("APIRouter", "Router", "FastAPI", "Starlette")
#: Classes whose instances are served apps (:attr:`RouteReading.apps`).
_APPS = ("FastAPI", "Starlette")
#: Route objects: built, they are registered on whatever router holds them (``routes=[...]``, ``x.routes.append``).
_ROUTE_OBJECTS = ("Route", "APIRoute", "WebSocketRoute", "APIWebSocketRoute", "Mount", "Host")
#: The documentation routes ``FastAPI(...)`` adds itself (``FastAPI.setup``), by keyword, with FastAPI's defaults: a
#: keyword given as ``None`` drops its route, ``docs_url`` and ``redoc_url`` need ``openapi_url``, the OAuth2 redirect
#: needs ``docs_url``. The same defaults stand for ``app.<keyword>`` read off an app whose constructor is not seen
#: (vLLM's offline docs register ``@app.get(app.swagger_ui_oauth2_redirect_url)``).
_FASTAPI_DOCS = {
    "openapi_url": "/openapi.json",
    "docs_url": "/docs",
    "swagger_ui_oauth2_redirect_url": "/docs/oauth2-redirect",
    "redoc_url": "/redoc",
}
#: Routes that a library vLLM calls adds for it: ``model_hosting_container_standards.sagemaker``'s handler decorators
#: (``bootstrap(app)``, which vLLM's ``build_app`` always runs, includes a router with a route for each decorated
#: handler; ``sagemaker_router.get_sagemaker_route_config`` and ``lora.routes.LORA_ROUTE_REGISTRY`` give these paths).
#: ``Instrumentator(...).expose(app, endpoint=...)`` (prometheus-fastapi-instrumentator) adds ``GET endpoint``
#: (default ``/metrics``). The running-app tests check these against the app vLLM builds.
_SAGEMAKER_ROUTES = {
    "register_ping_handler": ("GET", "/ping"),
    "register_invocation_handler": ("POST", "/invocations"),
    "register_load_adapter_handler": ("POST", "/adapters"),
    "register_unload_adapter_handler": ("DELETE", "/adapters/{adapter_name}"),
}


@dataclass(frozen=True)
class RouteSite:
    """One route a vLLM source registers: ``method`` (an HTTP method, ``WEBSOCKET``, ``MOUNT`` or ``HOST``) and the
    ``path`` the app's router holds (prefixes applied; a ``HOST`` route's host), where and how (``form``)."""

    method: str
    path: str
    where: str
    form: str


@dataclass
class RouteReading:
    """What :func:`read_routes` found: every route, each with the handlers registered for it, where each was
    registered, the registrations whose path (or methods, or prefix) cannot be read statically (``unresolved``, each
    ``file:line: form: why``; a route there is unseen), and the functions that build an app (``apps``,
    ``module:function``)."""

    routes: dict[tuple[str, str], list[Handler]] = field(default_factory=dict)
    sites: list[RouteSite] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    apps: set[str] = field(default_factory=set)


class _Scope:
    """The names a module, function or class binds (not descending into nested functions or classes)."""

    def __init__(self, module: str, qualname: str, parent: _Scope | None, node: ast.AST) -> None:
        self.module, self.qualname, self.parent, self.node = module, qualname, parent, node
        #: name -> what binds it: ("assign", value), ("def", node), ("import", module, attr or None),
        #: ("for", iterable), ("other", None)
        self.bindings: dict[str, list[tuple[Any, ...]]] = {}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    self.bind(arg.arg, ("other", None))

    def bind(self, name: str, what: tuple[Any, ...]) -> None:
        self.bindings.setdefault(name, []).append(what)

    def lookup(self, name: str) -> tuple[_Scope, list[tuple[Any, ...]]] | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.bindings:
                return scope, scope.bindings[name]
            scope = scope.parent
        return None


def _module_name(rel: str) -> str:
    name = rel[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _starlette_methods(methods: list[str] | None) -> list[str]:
    """A Starlette ``Route``'s methods: GET when none are given (a function endpoint), and HEAD wherever GET is."""
    out = {m.upper() for m in methods} if methods is not None else {"GET"}
    return sorted(out | ({"HEAD"} if "GET" in out else set()))


class _RouteReader:
    """Reads every route registration under ``vllm/entrypoints`` (see :func:`read_routes` for the forms)."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.scopes: dict[str, _Scope] = {}  # rel -> module scope
        self.scope_of: dict[int, _Scope] = {}  # id(function or class node) -> its scope
        self.constructors: dict[RouterKey, ast.Call] = {}  # a router or app variable -> the call that built it
        self.done: set[int] = set()  # route-object calls already registered (inside a routes=[...] or Mount)
        self.registrations: list[tuple[RouterKey | None, str, str, RouteSite, Handler | None]] = []
        self.edges: dict[RouterKey, list[tuple[RouterKey | None, str]]] = {}  # child -> [(parent, prefix)]
        self.reading = RouteReading()

    # -- scopes and names --

    def module_scope(self, rel: str) -> _Scope | None:
        if rel not in self.scopes:
            tree = self.src.tree(rel)
            if tree is None:
                return None
            scope = _Scope(_module_name(rel), "", None, tree)
            self.scopes[rel] = scope
            for stmt in tree.body:
                self._collect(stmt, scope, rel.endswith("__init__.py"))
        return self.scopes[rel]

    def _collect(self, node: ast.AST, scope: _Scope, is_package: bool) -> None:
        """Bind in ``scope`` the names ``node`` binds; a nested function or class gets a scope of its own."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope.bind(node.name, ("def", node))
            inner = _Scope(scope.module, f"{scope.qualname}.{node.name}".lstrip("."), scope, node)
            self.scope_of[id(node)] = inner
            for stmt in node.body:
                self._collect(stmt, inner, is_package)
            return
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    scope.bind(t.id, ("assign", node.value))
                    if isinstance(node.value, ast.Call) and self.class_name(node.value.func, scope) in _ROUTERS:
                        self.constructors[(scope.module, scope.qualname, t.id)] = node.value
                else:
                    for el in ast.walk(t):
                        if isinstance(el, ast.Name):
                            scope.bind(el.id, ("other", None))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    scope.bind(alias.asname, ("import", alias.name, None))
                else:
                    top = alias.name.split(".")[0]
                    scope.bind(top, ("import", top, None))
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(scope.module, is_package, node)
            for alias in node.names:
                scope.bind(alias.asname or alias.name, ("import", origin, alias.name))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            for el in ast.walk(node.target):
                if isinstance(el, ast.Name):
                    scope.bind(el.id, ("for", node.iter))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                for el in ast.walk(item.optional_vars) if item.optional_vars is not None else ():
                    if isinstance(el, ast.Name):
                        scope.bind(el.id, ("other", None))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.bind(node.name, ("other", None))
        for child in ast.iter_child_nodes(node):
            self._collect(child, scope, is_package)

    def class_name(self, func: ast.expr, scope: _Scope) -> str | None:
        """The name of the class (or function) a call calls, through an import alias (``import X as Y``)."""
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            found = scope.lookup(func.id)
            if found is not None:
                for what in found[1]:
                    if what[0] == "import" and what[2] is not None:
                        return str(what[2])
            return func.id
        return None

    def _imported_module(self, expr: ast.expr, scope: _Scope) -> str | None:
        """The vLLM module ``expr`` (a name) stands for, when it names an imported module."""
        if not isinstance(expr, ast.Name):
            return None
        found = scope.lookup(expr.id)
        if found is None or len(found[1]) != 1 or found[1][0][0] != "import":
            return None
        _, module, attr = found[1][0]
        full = module if attr is None else f"{module}.{attr}"
        return full if self.src.module_file(full) is not None else None

    def _global(self, module: str, name: str) -> tuple[str, ast.AST | None]:
        """``module.name`` followed through re-exports: (defining module, its definition or ``None``)."""
        found = resolve(self.src, module, name)
        return (module, None) if found is None else found

    def key(self, expr: ast.expr, scope: _Scope, depth: int = 0) -> RouterKey | None:
        """The router or app variable ``expr`` names (``router``, ``app``, ``app.router``, ``module.router``)."""
        if depth > 8:
            return None
        if isinstance(expr, ast.Attribute):
            module = self._imported_module(expr.value, scope)
            if module is not None:  # module.router
                return self._global_key(module, expr.attr)
            if expr.attr == "router":  # app.router: the app's own router
                return self.key(expr.value, scope, depth + 1)
            return None
        if not isinstance(expr, ast.Name):
            return None
        found = scope.lookup(expr.id)
        if found is None:
            return (scope.module, "", expr.id)
        where, binds = found
        if len(binds) == 1 and binds[0][0] == "import" and binds[0][2] is not None:
            return self._global_key(binds[0][1], binds[0][2])
        if len(binds) == 1 and binds[0][0] == "assign" and isinstance(binds[0][1], (ast.Name, ast.Attribute)):
            return self.key(binds[0][1], where, depth + 1)
        return (where.module, where.qualname, expr.id)

    def _global_key(self, module: str, name: str) -> RouterKey:
        defining, node = self._global(module, name)
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            name = names[0] if names else name
        return (defining, "", name)

    def string(self, expr: ast.expr | None, scope: _Scope, depth: int = 0) -> str | None:
        """The string ``expr`` evaluates to when it can be read statically: a literal, a name bound once to one (here
        or in another vLLM module), ``+`` and f-strings of those, and FastAPI's URL attributes; else ``None``."""
        if expr is None or depth > 8:
            return None
        if isinstance(expr, ast.Constant):
            return expr.value if isinstance(expr.value, str) else None
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            left, right = self.string(expr.left, scope, depth + 1), self.string(expr.right, scope, depth + 1)
            return None if left is None or right is None else left + right
        if isinstance(expr, ast.JoinedStr):
            parts = []
            for v in expr.values:
                if isinstance(v, ast.FormattedValue):
                    if v.format_spec is not None or v.conversion not in (-1, ord("s")):
                        return None
                    part = self.string(v.value, scope, depth + 1)
                else:
                    part = self.string(v, scope, depth + 1)
                if part is None:
                    return None
                parts.append(part)
            return "".join(parts)
        if isinstance(expr, ast.Attribute):
            module = self._imported_module(expr.value, scope)
            if module is not None:
                return self._global_string(module, expr.attr, depth)
            if expr.attr in _FASTAPI_DOCS:
                owner = self.key(expr.value, scope)
                call = self.constructors.get(owner) if owner is not None else None
                given = next((k.value for k in call.keywords if k.arg == expr.attr), None) if call else None
                return _FASTAPI_DOCS[expr.attr] if given is None else self.string(given, scope, depth + 1)
            return None
        if isinstance(expr, ast.Name):
            found = scope.lookup(expr.id)
            if found is None:
                return None
            where, binds = found
            values = set()
            for what in binds:
                if what[0] == "assign":
                    values.add(self.string(what[1], where, depth + 1))
                elif what[0] == "import" and what[2] is not None:
                    values.add(self._global_string(what[1], what[2], depth))
                else:
                    return None
            return values.pop() if len(values) == 1 else None
        return None

    def _global_string(self, module: str, name: str, depth: int) -> str | None:
        defining, node = self._global(module, name)
        rel = self.src.module_file(defining)
        scope = self.module_scope(rel) if rel is not None else None
        if scope is None or not isinstance(node, (ast.Assign, ast.AnnAssign)):
            return None
        return self.string(node.value, scope, depth + 1)

    def strings(self, expr: ast.expr | None, scope: _Scope) -> list[str] | None:
        """A list, tuple or set of strings (``methods=[...]``), or ``None``."""
        if isinstance(expr, ast.Name):
            found = scope.lookup(expr.id)
            if found and len(found[1]) == 1 and found[1][0][0] == "assign":
                return self.strings(found[1][0][1], found[0])
            return None
        if not isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            return None
        out = [self.string(e, scope) for e in expr.elts]
        return None if any(s is None for s in out) else [s for s in out if s is not None]

    def function(self, expr: ast.expr | None, scope: _Scope) -> Handler | None:
        """The function ``expr`` names (a handler passed to ``add_api_route``, ``Route(...)``)."""
        if isinstance(expr, ast.Attribute):
            module = self._imported_module(expr.value, scope)
            node = self._global(module, expr.attr)[1] if module is not None else None
            return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if not isinstance(expr, ast.Name):
            return None
        found = scope.lookup(expr.id)
        if found is None:
            return None
        for what in found[1]:
            if what[0] == "def" and isinstance(what[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
                return what[1]
            if what[0] == "import" and what[2] is not None:
                node = self._global(what[1], what[2])[1]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return node
        return None

    # -- registrations --

    def unresolved(self, rel: str, node: ast.AST, form: str, why: str) -> None:
        self.reading.unresolved.append(f"{rel}:{getattr(node, 'lineno', 0)}: {form}: {why}")

    def register(
        self,
        rel: str,
        scope: _Scope,
        node: ast.AST,
        form: str,
        receiver: ast.expr | None,
        path: ast.expr | None,
        methods: list[str] | None,
        handler: Handler | None,
        *,
        own_prefix: bool = False,
        key: RouterKey | None = None,
        prefix: str = "",
        mount: bool = False,
    ) -> str | None:
        """Register ``methods`` on ``path`` (an expression) for the router ``receiver`` (or ``key``), under
        ``prefix``; ``own_prefix``: FastAPI's forms, which put the router's own ``APIRouter(prefix=...)`` first;
        ``mount``: a mount path, whose trailing ``/`` Starlette strips. Returns the path registered (``None``: none)."""
        if receiver is not None:
            key = self.key(receiver, scope)
        copied = self._copied_routers(path, scope)
        if copied is not None:  # for route in (*a.routes, *b.routes): app.add_api_route(route.path, ...)
            for source in copied:
                if source is None or source not in self.constructors:
                    self.unresolved(rel, node, form, "it copies the routes of a router not built in these sources")
                elif source != key:
                    self.edges.setdefault(source, []).append((key, prefix))
            return None
        if methods is None:
            self.unresolved(rel, node, form, "its methods cannot be read statically")
            return None
        text = self.string(path, scope)
        if text is None:
            what = "no path" if path is None else f"its path {ast.unparse(path)!r}"
            self.unresolved(rel, node, form, f"{what} cannot be read statically")
            return None
        if mount:
            text = text.rstrip("/")
        if own_prefix and key is not None and key in self.constructors:
            given = next((k.value for k in self.constructors[key].keywords if k.arg == "prefix"), None)
            mine = "" if given is None else self.string(given, scope)
            if mine is None and given is not None:
                self.unresolved(rel, node, form, f"its router's prefix {ast.unparse(given)!r} cannot be read")
                return None
            text = (mine or "") + text
        text = prefix + text
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        for method in methods:
            self.registrations.append(
                (key, method.upper(), text, RouteSite(method.upper(), text, where, form), handler)
            )
        return text

    def _copied_routers(self, path: ast.expr | None, scope: _Scope) -> list[RouterKey | None] | None:
        """For ``x.path`` where ``x`` loops over routers' ``.routes``: those routers (their routes are re-registered
        under the same paths)."""
        if not (isinstance(path, ast.Attribute) and path.attr == "path" and isinstance(path.value, ast.Name)):
            return None
        found = scope.lookup(path.value.id)
        if found is None or len(found[1]) != 1 or found[1][0][0] != "for":
            return None
        iterable = found[1][0][1]
        items = iterable.elts if isinstance(iterable, (ast.Tuple, ast.List)) else [iterable]
        routers = []
        for item in items:
            item = item.value if isinstance(item, ast.Starred) else item
            if not (isinstance(item, ast.Attribute) and item.attr == "routes"):
                return None
            routers.append(self.key(item.value, found[0]))
        return routers

    def _method_ref(self, func: ast.expr, scope: _Scope) -> tuple[str, ast.expr, _Scope] | None:
        """``(method name, object, its scope)`` for ``obj.method``, also through a name bound to it once
        (``add = app.add_api_route``)."""
        if isinstance(func, ast.Attribute):
            return func.attr, func.value, scope
        if isinstance(func, ast.Name):
            found = scope.lookup(func.id)
            if found is not None and len(found[1]) == 1 and found[1][0][0] == "assign":
                value = found[1][0][1]
                if isinstance(value, ast.Attribute):
                    return value.attr, value.value, found[0]
        return None

    def decorator(self, rel: str, scope: _Scope, d: ast.expr, fn: Handler | None, site: ast.AST) -> bool:
        """Register the route a decorator declares (``@router.post("/x")``, ``@router.api_route``, ``@app.route``,
        ``@router.websocket``, ``@app.websocket_route``, the SageMaker handler decorators); ``False`` if it declares
        none."""
        if isinstance(d, ast.Attribute) and d.attr in _SAGEMAKER_ROUTES:
            method, fixed = _SAGEMAKER_ROUTES[d.attr]
            self.register(rel, scope, site, f"@{d.attr}", None, ast.Constant(fixed), [method], fn)
            return True
        ref = self._method_ref(d.func, scope) if isinstance(d, ast.Call) else None
        if ref is None or not isinstance(d, ast.Call):
            return False
        attr, receiver, where = ref
        if attr in _SAGEMAKER_ROUTES:
            return self.decorator(rel, scope, ast.Attribute(receiver, attr), fn, site)
        if attr not in (*_HTTP_VERBS, "api_route", "route", "websocket", "websocket_route"):
            return False
        key = self.key(receiver, where)
        path = d.args[0] if d.args else next((k.value for k in d.keywords if k.arg == "path"), None)
        given = next((k.value for k in d.keywords if k.arg == "methods"), None)
        listed = None if given is None else self.strings(given, scope)
        form = f"@{ast.unparse(d.func)}"
        fastapi = attr not in ("route", "websocket_route")  # FastAPI's forms put APIRouter(prefix=) first
        methods: list[str] | None
        if attr in _HTTP_VERBS:
            methods = [attr.upper()]
        elif attr == "api_route":
            methods = ["GET"] if given is None else listed
        elif attr == "route":
            methods = None if given is not None and listed is None else _starlette_methods(listed)
        else:
            methods = ["WEBSOCKET"]
        self.register(rel, scope, site, form, None, path, methods, fn, own_prefix=fastapi, key=key)
        return True

    def route_objects(self, rel: str, scope: _Scope, expr: ast.expr, key: RouterKey | None, prefix: str) -> None:
        """Register the route objects in ``expr`` (``Route(...)``, a list of them, a ``Mount`` with ``routes=``) on
        ``key``, under ``prefix``."""
        if isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
            for el in expr.elts:
                self.route_objects(rel, scope, el.value if isinstance(el, ast.Starred) else el, key, prefix)
            return
        if not isinstance(expr, ast.Call):
            return
        cls = self.class_name(expr.func, scope)
        if cls not in _ROUTE_OBJECTS:
            return
        self.done.add(id(expr))
        kw = {k.arg: k.value for k in expr.keywords if k.arg}
        first = expr.args[0] if expr.args else kw.get("host" if cls == "Host" else "path")
        endpoint = expr.args[1] if len(expr.args) > 1 else kw.get("endpoint")
        form = f"{cls}(...)"
        if cls in ("Mount", "Host"):
            method = "MOUNT" if cls == "Mount" else "HOST"
            sub = expr.args[1] if len(expr.args) > 1 else kw.get("app")
            routes = expr.args[2] if len(expr.args) > 2 else kw.get("routes")
            mount = cls == "Mount"
            text = self.register(  # a host is no path: no prefix goes before it
                rel,
                scope,
                expr,
                form,
                None,
                first,
                [method],
                None,
                key=key,
                prefix=prefix if mount else "",
                mount=mount,
            )
            if text is None:
                return
            inner = text if mount else prefix  # a Host's routes keep their paths
            if routes is not None:
                self.route_objects(rel, scope, routes, key, inner)
            if sub is not None:
                self.mount_edge(sub, scope, key, inner)
            return
        if cls in ("WebSocketRoute", "APIWebSocketRoute"):
            methods: list[str] | None = ["WEBSOCKET"]
        else:
            given = kw.get("methods")
            listed = None if given is None else self.strings(given, scope)
            if given is not None and listed is None:
                methods = None
            elif cls == "Route":
                methods = _starlette_methods(listed)
            else:
                methods = listed if listed is not None else ["GET"]
        self.register(
            rel, scope, expr, form, None, first, methods, self.function(endpoint, scope), key=key, prefix=prefix
        )

    def mount_edge(self, sub: ast.expr, scope: _Scope, parent: RouterKey | None, prefix: str) -> None:
        """A mounted router or app whose routes the reader sees: they are served under the mount's path."""
        child = self.key(sub, scope)
        if child is not None and child in self.constructors and child != parent:
            self.edges.setdefault(child, []).append((parent, prefix or ""))

    def call(self, rel: str, scope: _Scope, node: ast.Call) -> None:
        func = node.func
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(func, ast.Call) and node.args:  # router.post("/x")(handler): a decorator, applied by hand
            if self.decorator(rel, scope, func, self.function(node.args[0], scope), node):
                return
        ref = self._method_ref(func, scope)
        if ref is not None:
            attr, receiver, where = ref
            key = self.key(receiver, where)
            path = node.args[0] if node.args else kw.get("host" if attr == "host" else "path")
            endpoint = node.args[1] if len(node.args) > 1 else kw.get("endpoint")
            given = kw.get("methods")
            listed = None if given is None else self.strings(given, scope)
            form = f"{ast.unparse(func)}(...)"
            handler = self.function(endpoint, scope)
            if attr == "add_api_route":
                methods = ["GET"] if given is None else listed
                self.register(rel, scope, node, form, None, path, methods, handler, own_prefix=True, key=key)
            elif attr == "add_route":
                methods = None if given is not None and listed is None else _starlette_methods(listed)
                self.register(rel, scope, node, form, None, path, methods, handler, key=key)
            elif attr == "add_api_websocket_route":
                self.register(rel, scope, node, form, None, path, ["WEBSOCKET"], handler, own_prefix=True, key=key)
            elif attr == "add_websocket_route":
                self.register(rel, scope, node, form, None, path, ["WEBSOCKET"], handler, key=key)
            elif attr == "mount":
                text = self.register(rel, scope, node, form, None, path, ["MOUNT"], None, mount=True, key=key)
                sub = node.args[1] if len(node.args) > 1 else kw.get("app")
                if text is not None and sub is not None:
                    self.mount_edge(sub, scope, key, text)
            elif attr == "host":
                self.register(rel, scope, node, form, None, path, ["HOST"], None, key=key)
            elif attr == "include_router":
                router = node.args[0] if node.args else kw.get("router")
                self.include(rel, scope, node, key, router, kw)
            elif attr == "expose" and self._instrumentator(receiver, where):
                app = node.args[0] if node.args else kw.get("app")
                endpoint_path = kw.get("endpoint", ast.Constant("/metrics"))
                self.register(rel, scope, node, "Instrumentator.expose(...)", app, endpoint_path, ["GET"], None)
            elif attr in ("append", "insert", "extend") and isinstance(receiver, ast.Attribute):
                if receiver.attr == "routes" and node.args:
                    self.route_objects(rel, scope, node.args[-1], self.key(receiver.value, where), "")
        cls = self.class_name(func, scope)
        if cls in _ROUTE_OBJECTS and id(node) not in self.done:
            self.route_objects(rel, scope, node, None, "")
        elif cls in _ROUTERS:
            owner = next((k for k, c in self.constructors.items() if c is node), None)
            routes = kw.get("routes")
            if routes is None and cls == "Router" and node.args:
                routes = node.args[0]
            elif routes is None and cls == "Starlette" and len(node.args) > 1:
                routes = node.args[1]
            if routes is not None:
                self.route_objects(rel, scope, routes, owner, "")
            if cls in _APPS:
                self.reading.apps.add(f"{scope.module}:{scope.qualname or '<module>'}")
            if cls == "FastAPI":
                self.fastapi_docs(rel, scope, node, owner, kw)

    def _instrumentator(self, expr: ast.expr, scope: _Scope) -> bool:
        """Whether ``expr`` is a chain of calls on ``Instrumentator(...)`` (``Instrumentator().instrument(app)``)."""
        while isinstance(expr, ast.Call):
            if self.class_name(expr.func, scope) == "Instrumentator":
                return True
            expr = expr.func.value if isinstance(expr.func, ast.Attribute) else expr.func
        return False

    def fastapi_docs(
        self, rel: str, scope: _Scope, node: ast.Call, owner: RouterKey | None, kw: dict[str, ast.expr]
    ) -> None:
        urls: dict[str, str | None] = {}
        for name, default in _FASTAPI_DOCS.items():
            given = kw.get(name)
            if given is None:
                urls[name] = default
            elif isinstance(given, ast.Constant) and given.value is None:
                urls[name] = None
            else:
                urls[name] = self.string(given, scope)
                if urls[name] is None:
                    self.unresolved(rel, node, "FastAPI(...)", f"its {name} {ast.unparse(given)!r} cannot be read")
        shown = ["openapi_url"] if urls["openapi_url"] else []
        if urls["openapi_url"] and urls["docs_url"]:
            shown += ["docs_url"] + (
                ["swagger_ui_oauth2_redirect_url"] if urls["swagger_ui_oauth2_redirect_url"] else []
            )
        if urls["openapi_url"] and urls["redoc_url"]:
            shown.append("redoc_url")
        for name in shown:
            self.register(
                rel, scope, node, f"FastAPI({name}=)", None, ast.Constant(urls[name]), ["GET", "HEAD"], None, key=owner
            )

    def include(
        self,
        rel: str,
        scope: _Scope,
        node: ast.Call,
        parent: RouterKey | None,
        router: ast.expr | None,
        kw: dict[str, ast.expr],
    ) -> None:
        given = kw.get("prefix")
        prefix = "" if given is None else self.string(given, scope)
        child = None if router is None else self.key(router, scope)
        form = f"{ast.unparse(node.func)}(...)"
        if prefix is None and given is not None:
            self.unresolved(rel, node, form, f"its prefix {ast.unparse(given)!r} cannot be read statically")
            return
        if child is None or child not in self.constructors:
            # a router passed in, or built outside vllm/entrypoints: its routes, or which routes the prefix goes to,
            # are not in the sources read here
            what = ast.unparse(router) if router is not None else "no router"
            self.unresolved(rel, node, form, f"the router it includes ({what}) is not one built in these sources")
            return
        if child != parent:
            self.edges.setdefault(child, []).append((parent, prefix or ""))

    def walk(self, rel: str, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                self.decorator(rel, scope, d, node, node)
            inner = self.scope_of[id(node)]
            for stmt in node.body:
                self.walk(rel, stmt, inner)
            return
        if isinstance(node, ast.ClassDef):
            inner = self.scope_of[id(node)]
            for stmt in node.body:
                self.walk(rel, stmt, inner)
            return
        if isinstance(node, ast.Call):
            self.call(rel, scope, node)
        for child in ast.iter_child_nodes(node):
            self.walk(rel, child, scope)

    def paths(self, key: RouterKey | None, path: str, depth: int = 0) -> set[str]:
        """``path`` registered on ``key`` as the apps serve it: under every prefix it is included or mounted with."""
        if key is None or key not in self.edges or depth > 16:
            return {path}
        out: set[str] = set()
        for parent, prefix in self.edges[key]:
            out |= self.paths(parent, prefix + path, depth + 1)
        return out

    def read(self) -> RouteReading:
        files = self.src.files_under("vllm/entrypoints/")
        for rel in files:
            self.module_scope(rel)
        for rel in files:
            scope = self.module_scope(rel)
            if scope is not None:
                self.walk(rel, scope.node, scope)
        for key, _, path, site, handler in self.registrations:
            for full in sorted(self.paths(key, path)):
                shown = site if full == site.path else RouteSite(site.method, full, site.where, site.form)
                self.reading.sites.append(shown)
                handlers = self.reading.routes.setdefault((site.method, full), [])
                if handler is not None and handler not in handlers:
                    handlers.append(handler)
        return self.reading


@cache
def read_routes(src: Source) -> RouteReading:
    """Every route the sources under ``vllm/entrypoints`` register, in any of the ways FastAPI and Starlette offer:

    - the method decorators ``@x.get / post / put / delete / patch / options / head / trace(path)`` (the path
      positional or ``path=``), ``@x.api_route(path, methods=[...])`` (GET by default), Starlette's
      ``@x.route(path, methods=[...])``, and ``@x.websocket(path)`` / ``@x.websocket_route(path)``; the same
      decorators applied by hand (``x.post("/p")(handler)``);
    - the calls ``x.add_api_route(path, endpoint, methods=[...])``, ``x.add_route(...)`` (Starlette),
      ``x.add_api_websocket_route(...)``, ``x.add_websocket_route(...)``, ``x.mount(path, app)`` (``MOUNT path``:
      the mount path is what the app's router matches) and ``x.host(host, app)`` (``HOST host``);
    - route objects, wherever they are built: ``Route(...)`` / ``APIRoute(...)`` / ``WebSocketRoute(...)`` /
      ``APIWebSocketRoute(...)`` / ``Mount(path, app=..., routes=[...])`` / ``Host(...)``, in a ``routes=[...]`` of
      ``FastAPI`` / ``Starlette`` / ``APIRouter`` / ``Router``, in ``x.routes.append / insert / extend(...)``, or
      anywhere else (a route object is built to be registered); the routes of a ``Mount(..., routes=[...])`` under
      the mount's path;
    - the routes ``FastAPI(...)`` adds itself: ``/openapi.json``, ``/docs``, ``/docs/oauth2-redirect``, ``/redoc``
      (GET and HEAD), as its keywords set or drop them;
    - routes a library adds for a call in the sources: SageMaker's handler decorators (:data:`_SAGEMAKER_ROUTES`) and
      ``Instrumentator(...).expose(app)`` (``GET /metrics``);
    - routes re-registered from routers' own lists (``for r in router.routes: app.add_api_route(r.path, ...)``).

    Prefixes are applied where they can be read statically: ``APIRouter(prefix=...)`` for FastAPI's forms on that
    router; ``include_router(router, prefix=...)``, nested to any depth, the router found by its variable here or
    imported from another vLLM module; a router or app mounted by ``mount(path, app)`` / ``Mount(path, app=...)``.
    A path is read when it is a literal, a name bound once to one (here or in another vLLM module), ``+`` or an
    f-string of those, or FastAPI's ``app.openapi_url`` / ``docs_url`` / ``swagger_ui_oauth2_redirect_url`` /
    ``redoc_url``. Methods are read from a literal list, tuple or set. A registration whose path, methods or prefix
    cannot be read is listed in :attr:`RouteReading.unresolved`, not dropped: its route is unseen, and the tests fail
    on it.

    Each route is ``(METHOD, path)``: an HTTP method (Starlette's forms add HEAD to GET, as Starlette does),
    ``WEBSOCKET``, ``MOUNT`` or ``HOST``. Over-reading is safe (a route the table must classify that no app serves);
    under-reading is not (tests/test_vllm_contract.py compares this with the apps a release builds, where it runs)."""
    return _RouteReader(src).read()


def _routes(src: Source) -> dict[tuple[str, str], list[Handler]]:
    """Every route under ``vllm/entrypoints`` by ``(METHOD, path)``, with its handlers (:func:`read_routes`)."""
    return read_routes(src).routes


def _has_method(src: Source, module: str, cls: str, method: str) -> bool:
    """Whether ``module.cls`` (or a base class of it inside vLLM) defines ``method`` in this release."""
    found = resolve(src, module, cls)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return False
    return _method(_class_chain(src, found[0], found[1]), method) is not None


def _check_route(src: Source, entry: Route) -> list[str]:
    if entry.when is not None and not _has_method(src, *entry.when):
        return []  # the protocol the route belongs to is not in this release: lora_stream's use of it is not either
    handlers = _routes(src).get((entry.method, entry.path))
    if handlers is None:
        return [f"route {entry.method} {entry.path}: not registered by the API server (used by {entry.used_by})"]
    if entry.fields and not handlers:
        fields = list(entry.fields)
        return [f"route {entry.method} {entry.path}: its handler cannot be found to read {fields} ({entry.used_by})"]
    seen: set[str] = set()
    for fn in handlers:
        seen |= _identifiers(fn)
    missing = [f for f in entry.fields if f not in seen]
    if missing:
        return [f"route {entry.method} {entry.path}: its handler no longer reads {missing} (used by {entry.used_by})"]
    return []


def _loader_calls(fn: ast.FunctionDef | ast.AsyncFunctionDef, via: str) -> list[str]:
    """The method names of every ``self.<via>.<name>(...)`` call in ``fn``, in source order."""
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute)
        and n.func.value.attr == via
        and isinstance(n.func.value.value, ast.Name)
        and n.func.value.value.id == "self"
    ]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [n.func.attr for n in calls if isinstance(n.func, ast.Attribute)]


def _helper_calls(fn: ast.FunctionDef | ast.AsyncFunctionDef, helper: str) -> list[str]:
    """The method names of every ``<helper>.<name>(...)`` call in ``fn`` (``helper`` a local name), in order."""
    calls = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == helper
    ]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [n.func.attr for n in calls if isinstance(n.func, ast.Attribute)]


def _check_loader(src: Source, entry: LoaderChecks) -> list[str]:
    import importlib

    where = f"{entry.module}.{entry.cls}.{entry.method}"
    found = resolve(src, entry.module, entry.cls)
    target = resolve(src, *entry.target)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return [f"{entry.module}.{entry.cls}: class missing (used by {entry.used_by})"]
    if target is None or not isinstance(target[1], ast.ClassDef):
        return [f"{'.'.join(entry.target)}: class missing (used by {entry.used_by})"]
    loader = _method(_class_chain(src, *found), entry.method)  # type: ignore[arg-type]
    if loader is None:
        return [f"{where}: method missing (used by {entry.used_by})"]
    target_chain = _class_chain(src, *target)  # type: ignore[arg-type]
    have = {
        n.name for _, cls in target_chain for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    # lora_stream's own choice for a class with exactly this release's methods.
    module, _, name = entry.pick.rpartition(".")
    pick = getattr(importlib.import_module(module), name)
    stand_in = type(entry.target[1], (), {m: (lambda self, *a, **k: None) for m in have})
    problems: list[str] = []
    try:
        ours = list(pick(stand_in))
    except Exception as exc:  # lora_stream refuses this release's loader
        ours = []
        problems.append(f"{where}: lora_stream's {entry.pick} refuses this release: {exc} ({entry.used_by})")
    theirs = _loader_calls(loader, entry.via)
    if not problems and ours != theirs:
        problems.append(
            f"{where}: runs self.{entry.via}.{theirs} on what it built, lora_stream's {entry.pick} picks {ours} "
            f"for this release ({entry.used_by})"
        )
    for method in ours:
        fn = _method(target_chain, method)
        if fn is None:
            problems.append(f"{'.'.join(entry.target)}.{method}: method missing (used by {entry.used_by})")
            continue
        why = _call_problem(fn, entry.call, method=True)
        if why is not None:
            problems.append(f"{'.'.join(entry.target)}.{method}: {why} ({entry.used_by})")
    if entry.helper is not None:
        helper = _helper_calls(loader, entry.helper)
        if helper != list(entry.helper_calls):
            problems.append(
                f"{where}: calls {entry.helper}.{helper}, lora_stream's loader calls {list(entry.helper_calls)} "
                f"({entry.used_by})"
            )
    return problems


def _check_calls(src: Source, entry: Calls) -> list[str]:
    where = f"{entry.module}.{entry.name}"
    owner, _, method = entry.name.rpartition(".")
    found = resolve(src, entry.module, owner or entry.name)
    if found is None:
        return [f"{where}: missing (used by {entry.used_by})"]
    fn: ast.AST | None = found[1]
    if owner:
        fn = _method(_class_chain(src, *found), method) if isinstance(found[1], ast.ClassDef) else None  # type: ignore[arg-type]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{where}: missing (used by {entry.used_by})"]
    for n in ast.walk(fn):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == entry.method
            and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == entry.receiver
        ):
            return []
    return [f"{where}: no longer calls {entry.receiver}.{entry.method}(...) (used by {entry.used_by})"]


def check_entry(src: Source, entry: Entry) -> list[str]:
    """The violations of one contract entry in ``src`` (empty: satisfied)."""
    if isinstance(entry, Calls):
        return _check_calls(src, entry)
    if isinstance(entry, LoaderChecks):
        return _check_loader(src, entry)
    if isinstance(entry, Module):
        return [] if src.module_file(entry.module) else [f"{entry.module}: module missing (used by {entry.used_by})"]
    if isinstance(entry, Class):
        return _check_class(src, entry)
    if isinstance(entry, Route):
        return _check_route(src, entry)
    if isinstance(entry, Mentions):
        if entry.package:
            trees = [src.tree(rel) for rel in src.files_under(entry.module.replace(".", "/") + "/")]
        else:
            trees = [src.module_tree(entry.module)]
        if not trees or trees[0] is None:
            return [f"{entry.module}: module missing (used by {entry.used_by})"]
        names = set().union(*(_identifiers(t) for t in trees if t is not None))
        return [
            f"{entry.module}: no longer mentions {n!r} (used by {entry.used_by})" for n in entry.names if n not in names
        ]
    where = f"{entry.module}.{entry.name}"
    found = resolve(src, entry.module, entry.name)
    if found is None:
        if isinstance(entry, Function) and entry.fallback is not None:
            return []  # lora_stream does it itself on this release (entry.fallback)
        what = "module missing" if src.module_file(entry.module) is None else "missing"
        return [f"{where}: {what} (used by {entry.used_by})"]
    node = found[1]
    if isinstance(entry, Value):
        if entry.value is None:
            return []
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Constant) or value.value != entry.value:
            got = ast.unparse(value) if value is not None else type(node).__name__
            return [f"{where}: is {got}, lora_stream needs {entry.value!r} ({entry.used_by})"]
        return []
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{where}: no longer a function (used by {entry.used_by})"]
    why = _call_problem(node, entry.call, method=False)
    return [] if why is None else [f"{where}: {why} ({entry.used_by})"]


def check(path: str | Path | Source, contract: Sequence[Entry] = CONTRACT) -> list[str]:
    """Every violation of ``contract`` in the vLLM release at ``path`` (a wheel or a directory holding ``vllm/``),
    one line each naming the vLLM name and the lora_stream module that relies on it; empty when it is satisfied."""
    src = path if isinstance(path, Source) else Source(path)
    problems: list[str] = []
    for entry in contract:
        problems += check_entry(src, entry)
    return problems


# -- the routes of the apps a release builds, where it runs ------------------------------------------------------------

#: The environment :func:`running_routes` builds vLLM's apps in: every switch of vLLM's that adds routes. lora_stream's
#: servers run with the first two (tests/vllm_server.py: dev mode always, runtime LoRA updating for adapter syncs);
#: the Cohere API needs the optional ``cohere`` SDK as well.
RUNNING_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    "VLLM_ENABLE_COHERE_API": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}
#: The ``vllm serve`` flags that add routes, all on (``enable_offline_docs`` is built both ways: it drops ``/redoc``;
#: ``profiler_config`` is set to a torch profiler, which adds the profiling routes).
RUNNING_FLAGS = {
    "enable_fault_tolerance": True,
    "enable_scale_out": True,
    "tokens_only": True,
    "enable_tokenizer_info_endpoint": True,
}


def app_routes(routes: Sequence[Any], prefix: str = "") -> set[tuple[str, str]]:
    """The ``(METHOD, path)`` of every route in a Starlette or FastAPI route list, as :func:`read_routes` names them:
    ``MOUNT``/``HOST`` for a mount or host route and the routes inside it, ``WEBSOCKET`` for a websocket route. A route
    of another type fails, so that nothing is skipped unseen."""
    from starlette.routing import Host, Mount, Route, WebSocketRoute

    out: set[tuple[str, str]] = set()
    for r in routes:
        if isinstance(r, Mount):
            out.add(("MOUNT", prefix + r.path))
            out |= app_routes(r.routes, prefix + r.path)
        elif isinstance(r, Host):
            out.add(("HOST", r.host))
            out |= app_routes(r.routes, prefix)
        elif isinstance(r, WebSocketRoute):  # FastAPI's APIWebSocketRoute too
            out.add(("WEBSOCKET", prefix + r.path))
        elif isinstance(r, Route):  # FastAPI's APIRoute too
            out |= {(m, prefix + r.path) for m in r.methods or ()}
        else:
            raise TypeError(f"a route of type {type(r).__module__}.{type(r).__name__}: teach app_routes to list it")
    return out


def running_routes() -> dict[str, Any]:
    """Build every app the installed vLLM's entrypoints build (:attr:`RouteReading.apps`), without an engine, with
    every route switched on (:data:`RUNNING_ENV`, :data:`RUNNING_FLAGS`, every task vLLM knows), and list their
    routes: ``{"version": ..., "apps": {"module:function": [[METHOD, path], ...]}}``.

    The API server's app is vLLM's own ``build_app(args, supported_tasks, model_config)``, as ``vllm serve`` calls it
    (args from vLLM's own parser); ``model_config`` is a stand-in that reports an embedding model, which is all the
    pooling routes ask of it. Run this in a process of its own (``python tests/vllm_contract.py --running OUT``): it
    sets environment variables vLLM reads, and builds apps that register metrics and handlers process-wide."""
    import importlib
    import importlib.util
    import os
    import tempfile
    from types import SimpleNamespace

    os.environ.update(RUNNING_ENV)
    import vllm
    import vllm.tasks

    def api_server() -> list[Any]:
        from vllm.config import ProfilerConfig
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        tasks = tuple(
            dict.fromkeys(
                (
                    *vllm.tasks.GENERATION_TASKS,
                    *vllm.tasks.POOLING_TASKS,
                    *getattr(vllm.tasks, "FRONTEND_TASKS", ()),
                )
            )
        )
        model_config = SimpleNamespace(get_pooling_task=lambda tasks: "embed", hf_config=SimpleNamespace(num_labels=1))
        apps = []
        for offline_docs in (False, True):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
            for name, value in RUNNING_FLAGS.items():
                setattr(args, name, value)
            args.enable_offline_docs = offline_docs
            # never written: the profiler runs only on a /start_profile request
            args.profiler_config = ProfilerConfig(
                profiler="torch", torch_profiler_dir=os.path.join(tempfile.gettempdir(), "lora_stream_unused_profile")
            )
            apps.append(build_app(args, tasks, model_config))
        return apps

    def with_stub(module: str, name: str) -> Any:
        # a health app whose handlers read the stand-in only when a request comes
        return lambda: [getattr(importlib.import_module(module), name)(SimpleNamespace(is_ready=True))]

    builders = {
        "vllm.entrypoints.launchers.app:build_app": api_server,
        "vllm.entrypoints.launchers.dp_supervisor:_build_dp_supervisor_app": with_stub(
            "vllm.entrypoints.launchers.dp_supervisor", "_build_dp_supervisor_app"
        ),
        "vllm.entrypoints.cli.preload:_build_health_app": with_stub(
            "vllm.entrypoints.cli.preload", "_build_health_app"
        ),
    }
    apps: dict[str, list[list[str]]] = {}
    for site, build in builders.items():
        module = site.split(":")[0]
        if importlib.util.find_spec(module) is None:
            continue  # not in this release (the test compares the apps built with the apps the sources build)
        routes: set[tuple[str, str]] = set()
        for app in build():
            routes |= app_routes(app.routes)
        apps[site] = sorted([m, p] for m, p in routes)
    return {"version": vllm.__version__, "apps": apps}


def main(argv: Sequence[str]) -> int:
    """Print each release's violations; exit 1 if any. ``--running OUT``: write :func:`running_routes` to ``OUT`` as
    JSON instead (for the installed vLLM, in this process)."""
    if argv[:1] == ["--running"]:
        import json

        Path(argv[1]).write_text(json.dumps(running_routes()))
        return 0
    bad = 0
    for path in argv:
        problems = check(path)
        print(f"{path}: {'ok' if not problems else f'{len(problems)} violation(s)'}")
        for p in problems:
            print(f"  - {p}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
