"""The gloo weight-transfer group: both engines' shutdown tears it down, so a peer blocked in a broadcast fails at
once (shutdown used to call a method the group does not have, and the error was swallowed); and only the trainer and
the server's workers can take part: the store listens on the given address only, and joining needs the group's
secret (``docs/security.md``)."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import struct
import threading
import time
from typing import Any

import pytest
import torch
from helpers import require

SECRET = secrets.token_hex(16)


def _start(rank: int, groups: dict[int, Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """Join the group as ``rank`` on a thread; the group (or the exception) lands in ``groups[rank]``."""
    from lora_stream.transfer.group import TransferGroup

    def join() -> None:
        try:
            groups[rank] = TransferGroup(*args, **kwargs)
        except Exception as exc:
            groups[rank] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread


def _pair(timeout_s: float, address: str = "127.0.0.1") -> dict[int, Any]:
    from lora_stream.transfer.group import TransferGroup

    listener = TransferGroup.listen(address)
    port, groups = listener.getsockname()[1], {}
    threads = [
        _start(0, groups, address, port, 0, 2, timeout_s, secret=SECRET, listener=listener),
        _start(1, groups, address, port, 1, 2, timeout_s, secret=SECRET),
    ]
    for t in threads:
        t.join()
    for g in groups.values():
        if isinstance(g, Exception):
            raise g
    return groups


def _received(sender: Any, receiver: Any) -> torch.Tensor:
    """A broadcast from rank 0 (``sender``) as rank 1 (``receiver``) receives it."""
    out = torch.zeros(6)
    pending = receiver.broadcast(out)
    sender.broadcast(torch.arange(6.0)).wait()
    pending.wait()
    return out


def _listening() -> dict[int, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (bound address, port), from /proc."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if m:
            mine.add(int(m.group(1)))
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or int(cols[9]) not in mine:  # 0A: LISTEN
                    continue
                host, port = cols[1].split(":")
                raw = bytes.fromhex(host)
                # /proc prints the address as 32-bit words in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                out[int(cols[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return out


def _other_addresses() -> list[str]:
    """This machine's addresses other than loopback (IPv4 from the interfaces, global IPv6 from /proc)."""
    out = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", name.encode()[:15])
                out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))  # SIOCGIFADDR
            except OSError:
                continue
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                addr, _, _, scope, _, _ = line.split()
                if scope == "00":  # global scope
                    out.append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(addr)))
    except OSError:
        pass
    return [a for a in out if not a.startswith("127.") and a != "::1"]


def test_the_store_and_the_gloo_listeners_bind_only_the_given_address() -> None:
    before = _listening()
    groups = _pair(timeout_s=30.0)
    try:
        port = groups[0].port
        new = {inode: bound for inode, bound in _listening().items() if inode not in before}
        stores = [host for host, p in new.values() if p == port]
        # The store, and every gloo listener the two members opened, on loopback: not 0.0.0.0 or ::.
        assert stores == ["127.0.0.1"], new
        assert all(host == "127.0.0.1" for host, _ in new.values()), new
        for address in _other_addresses():  # unreachable on the machine's other addresses
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(2)
                with pytest.raises(OSError):
                    s.connect((address, port))
        assert _received(groups[0], groups[1]).tolist() == list(range(6))
    finally:
        for g in groups.values():
            g.close()


def test_an_ipv6_address_binds_an_ipv6_socket() -> None:
    from lora_stream.transfer.group import TransferGroup

    try:
        listener = TransferGroup.listen("::1")
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with listener:
        assert listener.family == socket.AF_INET6 and listener.getsockname()[0] == "::1"
        assert listener.getsockname()[1] != 0


def _the_member_joins_and_both_broadcast(trainer: Any, groups: dict[int, Any], port: int) -> None:
    """The second member, with the secret, joins the group ``trainer`` (rank 0) opened on ``port``; a broadcast
    reaches it."""
    _start(1, groups, "127.0.0.1", port, 1, 2, 30.0, secret=SECRET).join()
    trainer.join()
    assert not any(isinstance(g, Exception) for g in groups.values()), groups
    try:
        assert _received(groups[0], groups[1]).tolist() == list(range(6))
    finally:
        for g in groups.values():
            g.close()


def test_a_process_without_the_secret_cannot_join_and_the_members_still_broadcast() -> None:
    from lora_stream.transfer.group import TransferGroup

    listener = TransferGroup.listen("127.0.0.1")
    port, groups, intruder = listener.getsockname()[1], {}, {}
    trainer = _start(0, groups, "127.0.0.1", port, 0, 2, 30.0, secret=SECRET, listener=listener)
    # Knows the port, not the secret: its group creation fails at its (short) timeout.
    start = time.monotonic()
    _start(1, intruder, "127.0.0.1", port, 1, 2, 2.0, secret=secrets.token_hex(16)).join()
    assert isinstance(intruder[1], Exception), intruder
    assert time.monotonic() - start < 20
    _the_member_joins_and_both_broadcast(trainer, groups, port)


def test_a_process_that_lists_the_store_keys_learns_neither_the_secret_nor_a_way_in() -> None:
    """``TCPStore.list_keys`` shows every key to any client: a secret used as a plain key prefix would be read there
    and the intruder would join with it. The keys and values hold no secret, and the prefixes they show do not let
    a process into the group."""
    import datetime

    import torch.distributed as dist

    from lora_stream.transfer.group import TransferGroup

    listener = TransferGroup.listen("127.0.0.1")
    port, groups = listener.getsockname()[1], {}
    trainer = _start(0, groups, "127.0.0.1", port, 0, 2, 30.0, secret=SECRET, listener=listener)
    timeout = datetime.timedelta(seconds=2)
    spy = dist.TCPStore("127.0.0.1", port, 2, False, timeout, use_libuv=False)  # counts as the second member
    deadline = time.monotonic() + 20
    while not spy.list_keys() and time.monotonic() < deadline:
        time.sleep(0.02)  # the trainer's rendezvous key appears
    keys = spy.list_keys()
    assert keys
    for key in keys:
        assert SECRET not in key and SECRET.encode() not in spy.get(key), key
    prefixes = {p for key in keys for p in (key.rsplit("/", 1)[0], key.rsplit("/", 2)[0], key)}
    for prefix in prefixes:
        with pytest.raises(Exception):  # noqa: B017 - gloo's timeout surfaces as RuntimeError or DistError
            dist.ProcessGroupGloo(dist.PrefixStore(prefix, spy), 1, 2, timeout)
    _the_member_joins_and_both_broadcast(trainer, groups, port)


def test_a_value_written_without_the_secret_is_refused_not_used() -> None:
    import torch.distributed as dist

    from lora_stream.transfer.group import _SealedStore

    raw = dist.HashStore()
    sealed = _SealedStore(raw, SECRET)
    sealed.set("0/1", b"address of rank 1")
    assert sealed.get("0/1") == b"address of rank 1" and sealed.check(["0/1"])
    (name,) = [k for k in raw.list_keys()]
    assert "0/1" not in name and SECRET not in name
    raw.set(name, b"an intruder's address")  # overwritten by a store client without the secret
    with pytest.raises(RuntimeError, match="failed authentication"):
        sealed.get("0/1")
    sealed.set("0/0", b"address of rank 0")  # a sealed value moved to another key is refused too
    raw.set(name, raw.get(sealed._name("0/0")))
    with pytest.raises(RuntimeError, match="failed authentication"):
        sealed.get("0/1")
    other = _SealedStore(raw, secrets.token_hex(16))  # another group's secret: other names, nothing readable
    assert not other.check(["0/0"])


def test_a_group_without_a_secret_is_refused() -> None:
    from lora_stream.transfer.group import TransferGroup

    with pytest.raises(ValueError, match="secret"):
        TransferGroup("127.0.0.1", 1, 1, 2, 1.0, secret="")


def test_the_sink_binds_the_port_it_sends_and_a_new_secret_for_every_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sink's engine: the port sent to the server is the one the store's socket was bound to (no
    close-and-reuse: no port number is picked before the socket is bound), with a fresh 128-bit secret, hidden from
    ``repr``."""
    require("vllm")
    from lora_stream.sinks import vllm_server
    from lora_stream.sinks.server_route import ServerRoute
    from lora_stream.transfer.group import TransferGroup
    from lora_stream.transfer.protocol import TransferInitInfo

    real_listen = TransferGroup.listen

    def listen(address: str, port: int = 0) -> Any:
        assert port == 0, "a port number was picked before its socket was bound"
        return real_listen(address, port)

    monkeypatch.setattr(TransferGroup, "listen", staticmethod(listen))

    class Server:
        """The server's side of /init_weight_transfer_engine, without a server: its one worker joins."""

        def __init__(self) -> None:
            self.payloads: list[dict[str, Any]] = []
            self.workers: list[TransferGroup] = []

        def world_size(self) -> int:
            return 1

        def init_weight_transfer_engine(self, payload: dict[str, Any]) -> None:
            self.payloads.append(payload)
            info = TransferInitInfo(**payload)
            assert "secret" not in repr(info) and info.secret not in repr(info)
            self.workers.append(
                TransferGroup(
                    info.master_address, info.master_port, 1, info.world_size, info.timeout_s, secret=info.secret
                )
            )

    server = Server()
    engines = []
    try:
        for _ in range(2):
            sink = vllm_server.VLLMServerSink("http://127.0.0.1:9", rank=0, timeout=30.0)
            replica = sink.replicas[0]
            replica.client = server  # type: ignore[assignment]
            ServerRoute(sink, sink._memory)._ensure_engine(replica)  # what a sync's decide step runs
            engines.append(replica.engine)
        for engine, payload, worker in zip(engines, server.payloads, server.workers):
            assert payload["master_port"] == engine.group.port == engine.init_info.master_port != 0
            assert re.fullmatch(r"[0-9a-f]{32}", payload["secret"])
            assert _received(engine.group, worker).tolist() == list(range(6))
        assert server.payloads[0]["secret"] != server.payloads[1]["secret"]
    finally:
        for engine in engines:
            engine.shutdown()
        for worker in server.workers:
            worker.close()


@pytest.mark.parametrize("side", ["trainer", "worker"])
def test_shutdown_tears_the_group_down_and_a_waiting_peer_fails_at_once(side: str) -> None:
    require("vllm")
    from lora_stream.engine.receiver import WorkerTransferEngine
    from lora_stream.transfer.sender import TrainerTransferEngine

    groups = _pair(timeout_s=30.0)
    mine, peer = (groups[0], groups[1]) if side == "trainer" else (groups[1], groups[0])
    cls = TrainerTransferEngine if side == "trainer" else WorkerTransferEngine
    engine = cls.__new__(cls)  # only shutdown() is exercised: no server or model is needed for it
    engine.group = mine
    pending = peer.pg.broadcast([torch.zeros(4)], _root_from(0 if side == "trainer" else 1))  # waits for `mine`
    start = time.monotonic()
    threading.Timer(0.5, engine.shutdown).start()
    with pytest.raises(RuntimeError):
        pending.wait()
    assert time.monotonic() - start < 10, "the peer waited for its timeout: the group was not torn down"
    assert engine.group is None and mine.closed
    mine.close()  # idempotent


def _root_from(rank: int):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    opts.rootTensor = 0
    return opts


def test_a_forged_rendezvous_value_fails_the_worker_and_the_trainer_with_an_error() -> None:
    """A store client without the secret overwrites the trainer's rendezvous value before the server's worker joins:
    the worker raises instead of connecting to the forged address, and the trainer's engine raises too (the sink
    joins the group while it prepares a sync, so every rank raises before anything is sent); nobody hangs."""
    require("vllm")
    import datetime

    import torch.distributed as dist

    from lora_stream.transfer.group import TransferGroup
    from lora_stream.transfer.sender import TrainerTransferEngine, TrainerTransferInitInfo

    worker: dict[int, Any] = {}

    class Server:
        def init_weight_transfer_engine(self, payload: dict[str, Any]) -> None:
            port = payload["master_port"]
            spy = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=5), use_libuv=False)
            deadline = time.monotonic() + 20
            while not spy.list_keys() and time.monotonic() < deadline:
                time.sleep(0.02)
            for key in spy.list_keys():
                spy.set(key, b"an intruder's address")
            try:
                worker[1] = TransferGroup("127.0.0.1", port, 1, 2, 5.0, secret=payload["secret"])
            except Exception as exc:
                worker[1] = exc
                raise

    start = time.monotonic()
    # gloo retries the trainer's wait for a worker's connection 5 times: a short timeout keeps the test short.
    info = TrainerTransferInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=1.0, rank=0)
    with pytest.raises(Exception) as raised:  # the server's refusal, as TransferError or as it raised it
        TrainerTransferEngine.trainer_init(info, client=Server())
    assert "failed authentication" in str(worker[1]), worker
    assert "failed authentication" in str(raised.value), raised.value
    assert time.monotonic() - start < 20


def test_the_nccl_transport_is_refused_where_a_member_has_no_gpu_before_the_group_forms() -> None:
    """nccl and gloo share the rendezvous and everything above it; a member without CUDA refuses nccl at once, with
    the alternative, instead of failing inside NCCL (or waiting for peers). An unknown transport is refused too."""
    require("vllm")
    from lora_stream.transfer.group import TransferGroup

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for members without one")
    with pytest.raises(RuntimeError, match=r"nccl transport needs a CUDA device.*rank 1.*backend='gloo'"):
        TransferGroup("127.0.0.1", 1, 1, 2, 1.0, secret=SECRET, transport="nccl")
    with pytest.raises(ValueError, match="transport must be one of"):
        TransferGroup("127.0.0.1", 1, 1, 2, 1.0, secret=SECRET, transport="tcp")
