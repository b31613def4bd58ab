"""The layout by process, held against the code's imports (read with ``ast``, nothing imported).

- ``lora_stream.engine`` is what runs inside the inference engine's processes: it imports nothing of the trainer's
  side (no sink, no stream, not the trainer's half of the transfer), only what both sides agree on.
- vLLM's worker internals (its model executor, forward context, parallel state, LoRA worker manager, ...) are imported
  by ``lora_stream.engine`` alone; the trainer's side uses vLLM's public API only.
- A sink never imports another sink: code several sinks share lives in a module of its own.
- ``import lora_stream`` works with neither vLLM nor DeepSpeed nor TRL installed (each is imported where it is used).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "lora_stream"

#: What the engine side may import of lora_stream: itself, the errors, and the transfer's shared parts.
ENGINE_MAY_IMPORT = (
    "lora_stream.engine",
    "lora_stream.errors",
    "lora_stream.units",
    "lora_stream.transfer.protocol",
    "lora_stream.transfer.group",
    "lora_stream.transfer.packing",
    # The element encodings both halves of an element sync speak (it imports only torch).
    "lora_stream.element_codec",
    # The merge math both halves run (the merge in the engine runs the trainer's own Merge code on its base).
    "lora_stream.engine_merge",
    "lora_stream.buffers",
    "lora_stream.fingerprint",
    # The fingerprint both halves of an element sync prove with (it imports only torch).
    "lora_stream.linear_fingerprint",
)
#: vLLM's public API, the only part of vLLM the trainer's side imports.
TRAINER_MAY_IMPORT_OF_VLLM = (
    "vllm",  # SamplingParams
    "vllm.inputs",
    "vllm.lora.request",
    "vllm.lora.peft_helper",
    "vllm.distributed.weight_transfer.base",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in ``path``, inside functions included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from . import x` / `from pkg import mod`: the names may be modules
            out.append((node.lineno, mod))
            out += [
                (node.lineno, f"{mod}.{a.name}") for a in node.names if (SRC.parent / mod.replace(".", "/")).is_dir()
            ]
    return out


def under(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_layout_is_read() -> None:
    """The checks below see the package (a moved tree would make them pass vacuously)."""
    names = {module_name(p) for p in sources()}
    assert {"lora_stream.engine.receiver", "lora_stream.engine.reload", "lora_stream.sinks.vllm_server"} <= names
    assert "lora_stream.engine.reload" in {m for _, m in imports(SRC / "engine" / "receiver.py")}, imports(
        SRC / "engine" / "receiver.py"
    )


@pytest.mark.parametrize("path", [p for p in sources() if p.is_relative_to(SRC / "engine")], ids=module_name)
def test_the_engine_side_imports_nothing_of_the_trainer_side(path: Path) -> None:
    wrong = [f"line {line}: {mod}" for line, mod in imports(path) if mod.startswith("lora_stream")]
    wrong = [w for w in wrong if not under(w.split(": ")[1], ENGINE_MAY_IMPORT)]
    assert not wrong, f"{module_name(path)} runs in vLLM's processes and imports the trainer's side: {wrong}"


@pytest.mark.parametrize("path", [p for p in sources() if not p.is_relative_to(SRC / "engine")], ids=module_name)
def test_only_the_engine_side_imports_vllm_internals(path: Path) -> None:
    wrong = [
        f"line {line}: {mod}"
        for line, mod in imports(path)
        if under(mod, ("vllm",)) and mod not in TRAINER_MAY_IMPORT_OF_VLLM
    ]
    assert not wrong, f"{module_name(path)} is trainer-side and imports vLLM's internals: {wrong}"


def sink_modules() -> set[str]:
    out = set()
    for path in (SRC / "sinks").glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ClassDef) and n.name.endswith("Sink") and n.name != "Sink" for n in tree.body):
            out.add(module_name(path))
    return out


def test_no_sink_imports_another() -> None:
    sinks = sink_modules()
    assert {"lora_stream.sinks.vllm_colocated", "lora_stream.sinks.vllm_server", "lora_stream.sinks.vllm_lora"} <= sinks
    wrong = []
    for path in (SRC / "sinks").glob("*.py"):
        me = module_name(path)
        if me in sinks:
            wrong += [f"{me} line {line}: {mod}" for line, mod in imports(path) if mod in sinks - {me}]
    assert not wrong, f"shared code belongs in a module of its own, not in a sink: {wrong}"


#: Run in a fresh interpreter: vLLM, DeepSpeed and TRL made unimportable, then the package and its public names.
_WITHOUT_OPTIONAL = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"vllm", "deepspeed", "trl"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
import lora_stream
missing = [n for n in lora_stream.__all__ if not hasattr(lora_stream, n)]
assert not missing, missing
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"vllm", "deepspeed", "trl"})
assert not loaded, loaded
"""


def test_the_package_imports_without_vllm_deepspeed_or_trl() -> None:
    """The trainer's side must import where only torch and peft are installed (``nox -s wheel`` checks the same in
    a clean virtualenv; this catches a stray module-level import in the fast tier)."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", _WITHOUT_OPTIONAL], capture_output=True, text=True, timeout=120, env=None
    )
    assert done.returncode == 0, done.stderr[-4000:]


#: The largest a file in src/ may grow: one room, one responsibility (a file past it holds two things).
MAX_LINES = 600


def test_no_file_in_src_is_over_the_limit() -> None:
    over = {module_name(p): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"split these by responsibility (at most {MAX_LINES} lines each): {over}"


def import_graph() -> dict[str, set[str]]:
    """Module -> the lora_stream modules it imports (at the top, inside functions, or for type checking only: a
    loop of any of them is a circle a reader walks), a package's import counted as its ``__init__``'s."""
    names = {module_name(p) for p in sources()}
    graph: dict[str, set[str]] = {}
    for path in sources():
        me = module_name(path)
        graph[me] = {mod for _, mod in imports(path) if mod in names and mod != me}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    """No two modules of src/ depend on each other, directly or around a loop, by any import. A package's
    ``__init__`` that re-exports its modules is left out: importing the package is importing what it names."""
    graph = import_graph()
    packages = {module_name(p) for p in sources() if p.name == "__init__.py"}
    graph = {m: {d for d in deps if d not in packages} for m, deps in graph.items() if m not in packages}
    assert not circles(graph), circles(graph)


def test_the_circle_check_finds_a_circle() -> None:
    """The check above on a graph with one loop of three and one of two: it names both, and nothing else."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e", "f"]]
