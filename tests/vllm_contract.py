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
"""

from __future__ import annotations

import ast
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

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
    "Source",
    "Value",
    "check",
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
            self._trees[rel] = None if text is None else ast.parse(text, rel)
        return self._trees[rel]

    def module_tree(self, module: str) -> ast.Module | None:
        rel = self.module_file(module)
        return None if rel is None else self.tree(rel)


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
    """An HTTP route registered in vLLM's API server sources (``@router.post("/path")`` anywhere under
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
    Value(f"{_RELOAD}.meta", "SKIP_LOAD_TENSORS", None, "lora_stream.engine.reload (_expected_numel)"),
    Function(f"{_RELOAD}.utils", "get_tensor_load_numel", Call(1), "lora_stream.engine.reload (_expected_numel)"),
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
        "lora_stream.engine.reload (_experts_relaid_after_load)",
        methods={"process_weights_after_loading": Call(1)},
    ),
    Class(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts",
        "lora_stream.engine.reload (RELAYOUT_REPEATED names it)",
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


@cache
def _routes(src: Source) -> dict[tuple[str, str], list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every ``@x.get/post/put/delete("/path")`` handler under ``vllm/entrypoints``, by (METHOD, path)."""
    routes: dict[tuple[str, str], list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for rel in src.files_under("vllm/entrypoints/"):
        tree = src.tree(rel)
        if tree is None:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for d in fn.decorator_list:
                if (
                    isinstance(d, ast.Call)
                    and isinstance(d.func, ast.Attribute)
                    and d.func.attr in ("get", "post", "put", "delete")
                    and d.args
                    and isinstance(d.args[0], ast.Constant)
                    and isinstance(d.args[0].value, str)
                ):
                    routes.setdefault((d.func.attr.upper(), d.args[0].value), []).append(fn)
    return routes


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
    if not handlers:
        return [f"route {entry.method} {entry.path}: not registered by the API server (used by {entry.used_by})"]
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


def main(argv: Sequence[str]) -> int:
    """Print each release's violations; exit 1 if any."""
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
