"""The weight-transfer group: a process group of its own (gloo or nccl) between the trainer and every vLLM worker,
formed through a store the trainer hosts, which only holders of the group's secret can use.

Both halves of the transfer build one (the trainer as rank 0, each worker as rank 1..N). The store listens only on the
trainer's ``master_address``; ``docs/security.md`` says what the secret stops and what it does not.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from .protocol import STORE_PREFIX, TRANSPORTS

__all__ = ["TransferGroup"]


class _SealedStore(dist.Store):  # type: ignore[misc,name-defined]
    """The group's view of the trainer's store: every key renamed, and every value authenticated, with the group's
    secret.

    A key is stored as ``STORE_PREFIX/<HMAC-SHA256(secret, key)>``, so the names a store client can list
    (``TCPStore.list_keys``) reveal neither the secret nor, before they exist, the names a member will write or
    wait for; a value is stored with an HMAC-SHA256 tag over its stored name and bytes, and :meth:`get` refuses a
    value whose tag does not verify. A secret used as a plain key prefix would not do: ``list_keys`` shows it.
    ``add`` counters are renamed only (the store does the arithmetic); gloo's rendezvous uses ``set``/``get``/
    ``wait`` only.
    """

    def __init__(self, store: Any, secret: str) -> None:
        super().__init__()
        self._store = store
        self._key = secret.encode()

    def _name(self, key: str) -> str:
        return f"{STORE_PREFIX}/{hmac.new(self._key, b'name:' + key.encode(), hashlib.sha256).hexdigest()[:32]}"

    def _tag(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._key, b"value:" + name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        name = self._name(key)
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(name, data + self._tag(name, data))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        data = bytes(self._store.get(name))
        value, tag = data[:-32], data[-32:]
        if len(data) < 32 or not hmac.compare_digest(tag, self._tag(name, value)):
            raise RuntimeError(
                "lora_stream: a value in the weight-transfer group's store failed authentication: a process without "
                "the group's secret wrote to the trainer's store; the group is not formed"
            )
        return value

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check([self._name(k) for k in keys]))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(self._name(key), amount))

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(self._name(key)))

    def num_keys(self) -> int:
        return int(self._store.num_keys())


def _sockaddr(address: str, port: int) -> tuple[socket.AddressFamily, Any]:
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    return family, sockaddr


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_unspecified
    except ValueError:
        return False


class TransferGroup:
    """A gloo process group of its own between the trainer (rank 0) and the vLLM workers, with its store.

    Not torch.distributed's default group: the trainer has its own, and vLLM's workers theirs.

    Who can take part: rank 0 hosts the ``TCPStore`` on a socket bound to ``address`` only (:meth:`listen`; never
    every interface), and every member reaches the rendezvous through :class:`_SealedStore` with the group's
    ``secret``, so a process that reaches the store's port without the secret cannot join: its own group creation
    times out, and anything it writes over a member's key fails that member's rendezvous with an error instead of
    being used. Each member's gloo listener binds the address on its route to ``address`` (rank 0: ``address``
    itself), unless ``GLOO_SOCKET_IFNAME`` names interfaces, as torch does. gloo's own connections carry no
    authentication (``docs/security.md``).
    """

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        secret: str,
        listener: socket.socket | None = None,
        transport: str = "gloo",
    ) -> None:
        if not secret:
            raise ValueError(
                "lora_stream: the weight-transfer group needs the group's secret (the trainer's lora_stream sends it "
                "with /init_weight_transfer_engine; an older trainer does not): refusing an unauthenticated group"
            )
        if transport not in TRANSPORTS:
            raise ValueError(f"lora_stream: transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "nccl" and not torch.cuda.is_available():
            raise RuntimeError(
                f"lora_stream: the nccl transport needs a CUDA device on every member (rank {rank} has none); use "
                "backend='gloo'"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        self.transport = transport
        #: Where chunks live while they travel: host memory for gloo, this process's current GPU for nccl.
        self.device = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else torch.device("cpu")
        if rank == 0:
            # The store must outlive the group; rank 0 (the trainer) hosts it, on a socket bound to `address` only.
            if listener is None:
                listener = self.listen(address, port)
            port = int(listener.getsockname()[1])
            # torch owns the descriptor from here on, and closes it with the store or when the store fails.
            fd = listener.detach()
            raw = dist.TCPStore(  # type: ignore[attr-defined]
                address, port, world_size, is_master=True, timeout=timeout, use_libuv=False, master_listen_fd=fd
            )
        else:
            raw = dist.TCPStore(  # type: ignore[attr-defined]
                address, port, world_size, is_master=False, timeout=timeout, use_libuv=False
            )
        self.port = port
        self._tcp_store = raw
        #: The group's view of the store (keys renamed and values authenticated with the secret).
        self.store: Any = _SealedStore(raw, secret)
        if transport == "nccl":
            # The same rendezvous (the sealed store), another collective: NCCL finds its peers through the store.
            options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(self.store, rank, world_size, options)  # type: ignore[attr-defined]
            # NCCL forms its communicator at the first collective; form it now, as gloo does at construction, so
            # that a member that cannot join fails the group's setup (prepare), not the first chunk of a sync.
            self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()
            torch.cuda.synchronize(self.device)
        else:
            self.pg = self._process_group(self.store, address, port, rank, world_size, timeout)

    @staticmethod
    def listen(address: str, port: int = 0) -> socket.socket:
        """A listening socket bound to ``(address, port)`` only, IPv4 or IPv6 by the address's family; port 0: an
        ephemeral port, read from the socket. Rank 0's store takes it over (``listener=``), so the port is never
        closed and re-bound: no other process can take it in between."""
        family, sockaddr = _sockaddr(address, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"lora_stream: cannot bind the weight-transfer store to {address!r} port {port}: {exc.strerror} "
                    "(master_address must be an address of the trainer's machine that the server reaches)",
                ) from exc
            sock.listen()
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def _process_group(store: Any, address: str, port: int, rank: int, world_size: int, timeout: Any) -> Any:
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)  # torch binds the interfaces named
        family, sockaddr = _sockaddr(address, port)
        if rank == 0:
            host = sockaddr[0]  # the store's own address: one of this machine's
        else:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)  # sends nothing: picks the local address on the route to the trainer
                host = probe.getsockname()[0]
        if _unspecified(host):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)  # a wildcard address: torch's default
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._threads = 2  # what torch gives one device
        return dist.ProcessGroupGloo(store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0; returns the work to wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        """Tear the group down, so that a peer blocked in a broadcast fails at once instead of at the timeout.

        Dropping the last reference destroys the gloo group, which closes its connections: a peer waiting in a
        broadcast raises "Connection closed by peer" within a second. gloo's ``abort()`` and ``shutdown()`` leave
        the connections open (measured with torch 2.13: the peer waited out its whole timeout either way).
        Idempotent.
        """
        self.pg = None

    @property
    def closed(self) -> bool:
        return self.pg is None
