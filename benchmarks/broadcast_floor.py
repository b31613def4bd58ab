"""The server benchmark's floor (started by bench_server.py): a raw gloo broadcast of the same bytes, in the same
chunks, between two processes of this machine, with a copy into a destination on the receiver.

Usage: broadcast_floor.py RANK PORT OUT CHUNK_BYTES [CHUNK_BYTES ...]
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    chunks = [int(x) for x in sys.argv[4:]]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=120))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    buffers = [torch.ones(n, dtype=torch.uint8) for n in chunks]
    dest = [torch.zeros(n, dtype=torch.uint8) for n in chunks] if rank == 1 else []
    times = []
    for _ in range(5):
        pg.barrier().wait()
        t0 = time.perf_counter()
        for i, buf in enumerate(buffers):
            pg.broadcast([buf], opts).wait()
            if rank == 1:
                dest[i].copy_(buf)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"broadcast_floor_s": statistics.median(times), "bytes": sum(chunks)}, f)


if __name__ == "__main__":
    main()
