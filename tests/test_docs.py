"""The documentation's code cannot rot: every example on the site is a file in examples/ that a test here runs.

- A Python block on a docs page holds only snippet includes (``--8<-- "examples/x.py:section"``) of those files, so
  the page shows exactly the code that runs; every include must name an existing, non-empty section.
- README.md (GitHub does not expand includes) and the public docstrings (``>>>`` lines, rendered in the API reference)
  may only show code that appears, statement for statement, in an executed example.
- Every example runs here, on the real stack, against a tiny random model: single-process ones directly, the
  distributed recipes under ``torchrun`` with 2 gloo ranks, the server recipe against a real vLLM server.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import clear_cpu_shm, require
from launch import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"

#: Every example file, and the test in this repository that executes it.
EXECUTED = {
    "stream_basics.py": "test_docs.py::test_stream_basics",
    "quickstart.py": "test_docs.py::test_quickstart",
    "recipe_zero3.py": "test_docs.py::test_recipe_zero3",
    "recipe_full_finetune.py": "test_docs.py::test_recipe_full_finetune",
    "recipe_fsdp2.py": "test_docs.py::test_recipe_fsdp2_into_a_server",
    "recipe_checkpoint.py": "test_docs.py::test_recipe_checkpoint",
    "recipe_adapter.py": "test_docs.py::test_recipe_adapter",
    "recipe_fleet.py": "test_vllm_fleet.py::test_the_fleet_recipe_keeps_both_servers_in_sync",
    "grpo_trl.py": "test_trl.py::test_the_example_runs",
    "tiny_model.py": "every test here (it writes their model)",
}
INCLUDE = re.compile(r'^\s*--8<--\s+"([^":]+)(?::([\w-]+))?"\s*$')
FENCE = re.compile(r"^```python\s*\n(.*?)^```\s*$", re.M | re.S)


#: A Python block shown inline (GitHub renders no includes), marked with the example section it must equal.
INLINE = re.compile(r"^<!-- example: ([^\s:]+):([\w-]+) -->\n```python\s*\n(.*?)^```\s*$", re.M | re.S)
#: The pages whose blocks of "the lines you add" are inline copies of a tested example's section.
INLINE_PAGES = ("trl.md", "gpus.md")


def python_blocks(path: Path) -> list[str]:
    """The page's Python blocks, except the inline copies (:data:`INLINE`, checked on their own)."""
    return FENCE.findall(INLINE.sub("", path.read_text()))


def section(path: Path, name: str) -> str:
    text = path.read_text()
    m = re.search(
        rf"--8<-- \[start:{re.escape(name)}\]\n(.*?)^[^\n]*--8<-- \[end:{re.escape(name)}\]", text, re.M | re.S
    )
    assert m, f"{path.name} has no section {name!r}"
    return m.group(1)


def statements(code: str) -> set[str]:
    """Every statement of ``code``, compound ones whole, as ``ast.unparse`` writes it: formatting and comments
    do not matter, the code does."""
    return {ast.unparse(node) for node in ast.walk(ast.parse(textwrap.dedent(code))) if isinstance(node, ast.stmt)}


def executed_statements() -> set[str]:
    return set().union(*(statements((EXAMPLES / f).read_text()) for f in EXECUTED))


def shown_statements(code: str) -> list[str]:
    return [ast.unparse(node) for node in ast.parse(textwrap.dedent(code)).body]


def docstring_code(doc: str) -> list[str]:
    """The doctest-style examples of a docstring, one code string per run of ``>>>`` / ``...`` lines."""
    blocks: list[list[str]] = []
    previous = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>> ", "... ")) or stripped in (">>>", "..."):
            if not previous:
                blocks.append([])
            blocks[-1].append(stripped[4:])
            previous = True
        else:
            previous = False
    return ["\n".join(b) for b in blocks]


def test_every_example_file_is_executed_by_a_test() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXECUTED)
    for where in EXECUTED.values():
        if "::" in where:
            module, test = where.split("::")
            assert f"def {test}(" in (ROOT / "tests" / module).read_text(), where


def test_every_python_block_on_the_site_is_an_included_example() -> None:
    pages = sorted(DOCS.rglob("*.md"))
    included = 0
    for page in pages:
        for block in python_blocks(page):
            for line in block.strip().splitlines():
                if not line.strip():
                    continue
                m = INCLUDE.match(line)
                assert m, (
                    f"{page.relative_to(ROOT)}: a Python block on the site must only include sections of examples/ "
                    f"(which tests run), not hold code of its own:\n{block}"
                )
                target = ROOT / m.group(1)
                assert target.parent == EXAMPLES and target.name in EXECUTED, (page, m.group(1))
                if m.group(2):
                    assert section(target, m.group(2)).strip(), (page, line)
                included += 1
    assert included >= 15, "the pages lost their examples"


def test_inline_blocks_equal_their_tested_example_section() -> None:
    """GitHub shows a snippet include as a literal line: on the pages that tell users which lines to add, each such
    block is the code itself, character for character the example section a test runs."""
    for name in INLINE_PAGES:
        text = (DOCS / name).read_text()
        assert "--8<--" not in text, f"docs/{name} shows a snippet include, which GitHub renders as a literal line"
        blocks = INLINE.findall(text)
        assert blocks, f"docs/{name} shows no inline example"
        assert len(blocks) == len(FENCE.findall(text)), f"docs/{name}: a Python block without its example marker"
        for path, sec, code in blocks:
            target = ROOT / path
            assert target.parent == EXAMPLES and target.name in EXECUTED, (name, path)
            expected = textwrap.dedent(section(target, sec))
            assert code == expected, f"docs/{name}: the block marked {path}:{sec} differs from the example:\n{code}"


def test_readme_shows_only_executed_code() -> None:
    executed = executed_statements()
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 3
    for block in blocks:
        for stmt in shown_statements(block):
            assert stmt in executed, f"README.md shows code no example runs:\n{stmt}"


def test_docstring_examples_are_executed_code() -> None:
    import lora_stream
    import lora_stream.integrations.trl

    executed = executed_statements()
    seen = 0
    public: list[object] = []  # what the API reference renders (its ::: entries): the public surface and the rest
    for path in re.findall(r"^::: (lora_stream(?:\.\w+)+)$", (DOCS / "api.md").read_text(), re.M):
        module, _, name = path.rpartition(".")
        try:
            public.append(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError as exc:  # verl's module needs verl (tests_verl runs where it is installed)
            if exc.name is None or exc.name.split(".")[0] == "lora_stream":
                raise
    assert len(public) >= len(lora_stream.__all__), "docs/api.md lost its entries"
    objects: list[object] = [lora_stream, lora_stream.integrations.trl]
    for obj in public:  # our classes and functions, and their members
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("lora_stream"):
            objects.append(obj)
            members = vars(obj).values() if inspect.isclass(obj) else []
            objects += [
                m.fget if isinstance(m, property) else m
                for m in members
                if inspect.isfunction(m) or isinstance(m, property)
            ]
    for obj in objects:
        for code in docstring_code(inspect.getdoc(obj) or ""):
            for stmt in shown_statements(code):
                seen += 1
                name = getattr(obj, "__name__", obj)
                assert stmt in executed, f"{name}'s docstring shows code no example runs:\n{stmt}"
    assert seen >= 8, seen


def test_the_api_reference_renders_every_public_name() -> None:
    import lora_stream

    rendered = set(re.findall(r"^::: lora_stream\.(\w+)$", (DOCS / "api.md").read_text(), re.M))
    missing = [name for name in lora_stream.__all__ if name not in rendered]
    assert not missing, f"docs/api.md lacks {missing}: a public name without a reference entry"


def test_examples_parse() -> None:
    for f in EXECUTED:
        ast.parse((EXAMPLES / f).read_text())


# -- running them --------------------------------------------------------------------------------------------------

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def run(args: list[str], timeout: float = 400, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        args,
        env={**os.environ, **ENV, **(env or {})},
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def torchrun(script: str, *args: str, timeout: float = 400) -> str:
    return run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(EXAMPLES / script),
            *args,
        ],
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("docs") / "tiny-llama")
    run([sys.executable, str(EXAMPLES / "tiny_model.py"), path], timeout=120)
    return path


def steps(output: str, what: str) -> list[str]:
    lines = [line for line in output.splitlines() if what in line]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"], output[-3000:]
    return lines


def assert_only_changes_after_the_first(lines: list[str]) -> None:
    """21 tensors the first time; then the 14 LoRA-merged ones, the 7 frozen (embeddings, norms, lm_head) skipped."""
    assert "synced 21 tensors (0 unchanged, skipped)" in lines[0], lines
    assert all("synced 14 tensors (7 unchanged, skipped)" in line for line in lines[1:]), lines


def test_stream_basics() -> None:
    assert run([sys.executable, str(EXAMPLES / "stream_basics.py")], timeout=120).startswith("ok: 21 tensors")


def test_quickstart(tiny_model: str) -> None:
    require("vllm")
    out = run([sys.executable, str(EXAMPLES / "quickstart.py"), tiny_model])
    assert_only_changes_after_the_first(steps(out, "synced"))
    steps(out, "vLLM now generates")


def test_recipe_zero3(tiny_model: str) -> None:
    require("deepspeed")
    require("vllm")
    clear_cpu_shm()
    out = torchrun("recipe_zero3.py", tiny_model)
    assert_only_changes_after_the_first(steps(out, "synced"))
    steps(out, "vLLM now generates")


def test_recipe_full_finetune(tiny_model: str) -> None:
    """The first sync is full; after it, every sync goes as elements: a few percent of the bfloat16 elements changed,
    a fraction of the whole bytes sent, nothing gathered, and the engine serves the new weights (the log-probability
    of its greedy completion moves with every step)."""
    require("deepspeed")
    require("vllm")
    clear_cpu_shm()
    out = torchrun("recipe_full_finetune.py", tiny_model)
    synced = steps(out, "synced")
    assert "synced whole (no sync committed" in synced[0], synced
    for line in synced[1:]:
        m = re.search(r"as elements \((\d+) tensors, ([\d.]+)% changed\): sent (\d+) bytes of (\d+) whole", line)
        assert m, synced
        tensors, changed, sent, whole = int(m[1]), float(m[2]), int(m[3]), int(m[4])
        assert tensors > 0 and 0 < changed < 20, line
        assert sent < whole / 4, line
        assert line.endswith("peak gathered 0 bytes"), line
    generated = steps(out, "vLLM now generates")
    logprobs = [float(re.search(r"log-prob (-?[\d.]+)\)", line)[1]) for line in generated]
    assert len(set(logprobs)) == 3, generated


def test_recipe_fsdp2_into_a_server(tiny_model: str) -> None:
    require("vllm")
    from vllm_server import Server

    server = Server(tiny_model).wait_ready()
    try:
        out = torchrun("recipe_fsdp2.py", tiny_model, server.url)
        assert [line.split("server version ")[1] for line in steps(out, "synced")] == ["step-0", "step-1", "step-2"]
        steps(out, "the server now generates")
        assert server.version() == "step-2"
    finally:
        server.stop()


def test_recipe_checkpoint(tiny_model: str, tmp_path: Path) -> None:
    out = run([sys.executable, str(EXAMPLES / "recipe_checkpoint.py"), tiny_model, str(tmp_path / "merged")])
    assert "the checkpoint equals peft's merge_and_unload()" in out, out
    assert (tmp_path / "merged" / "tokenizer.json").exists()


def test_recipe_adapter(tiny_model: str) -> None:
    require("vllm")
    out = run([sys.executable, str(EXAMPLES / "recipe_adapter.py"), tiny_model])
    assert all("synced 28 LoRA tensors" in line and "as policy" in line for line in steps(out, "synced"))
    steps(out, "through the adapter generates")


def _release_statements(text: str) -> list[tuple[str, str]]:
    """Each statement of a supported vLLM or TRL range in ``text``: (what, the range as stated)."""
    found: list[tuple[str, str]] = []
    for line in text.splitlines():
        lower = line.lower()
        for low, high in re.findall(r">=\s*(\d+\.\d+)(?:\.0)?\s*,\s*<\s*(\d+\.\d+)", line):
            what = "trl" if low.startswith("1.") else "vllm"
            if what == "vllm" and "vllm" not in lower and "unsupportedvllmerror" not in lower:
                continue
            found.append((what, f">={low},<{high}"))
        for low, high in re.findall(r"(?:accepts?|accepted|\(|supports?) vLLM (0\.\d+) to (0\.\d+)", line):
            found.append(("vllm-span", f"{low} to {high}"))
        for single in re.findall(r"vLLM outside (0\.\d+)\b(?! to)", line.replace("\n", " ")):
            found.append(("vllm-single", single))
    return found


def test_every_page_states_the_releases_the_guards_accept() -> None:
    """One statement of the supported vLLM and TRL releases, the guards' (SUPPORTED_VLLM, TESTED_TRL): a page that
    states a range, a span or a single release other than theirs fails here (a page once said vLLM outside 0.32 was
    refused, after the guard accepted 0.31 to 0.34)."""
    from lora_stream.engine.vllm_version import SUPPORTED_VLLM
    from lora_stream.integrations.trl import TESTED_TRL

    vllm_range = f">={SUPPORTED_VLLM[0].line},<0.{SUPPORTED_VLLM[-1].release[1] + 1}"
    trl_range = ">={},<{}".format(*(".".join(v.split(".")[:2]) for v in TESTED_TRL))
    expected = {
        "vllm": vllm_range,
        "trl": trl_range,
        "vllm-span": f"{SUPPORTED_VLLM[0].line} to {SUPPORTED_VLLM[-1].line}",
    }
    root = ROOT
    pages = [root / "README.md", *sorted(DOCS.glob("*.md"))]
    wrong = []
    seen = 0
    for page in pages:
        if page.name == "changelog.md":  # history: what was true then
            continue
        text = re.sub(r"\s*\n\s*", " ", page.read_text())  # statements wrap across lines
        for what, stated in _release_statements(text):
            seen += 1
            if stated != expected.get(what):
                wrong.append(f"{page.relative_to(root)}: {what} {stated!r}, the guard says {expected.get(what)!r}")
    assert not wrong, "\n".join(wrong)
    assert seen >= 5, "the statements were not found: the pattern no longer reads the pages"


def test_the_release_statement_reader_catches_each_form() -> None:
    """The reader of the test above, on each form a page could state another release in."""
    assert _release_statements("refuse any vLLM release outside `>=0.32,<0.33`") == [("vllm", ">=0.32,<0.33")]
    assert _release_statements("the hook accepts vLLM 0.32 to 0.33 only") == [("vllm-span", "0.32 to 0.33")]
    assert _release_statements("A vLLM outside 0.32 is refused") == [("vllm-single", "0.32")]
    assert _release_statements("naming the tested range `>=1.16,<1.17`") == [("trl", ">=1.16,<1.17")]
