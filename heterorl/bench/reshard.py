"""``heterorl bench reshard``: a sharded learner's weights reaching its workers two ways, side by side in one run:

- **gather**: every rank takes part in gathering the whole model onto rank 0 (FSDP2's full state dict, gloo),
  which packs it and sends it to every worker (`runtime.weights_fanout=gather`);
- **reshard**: every rank sends the slices it owns straight to every worker on its own weights channel, and each
  worker places them (`runtime.weights_fanout=reshard`, `heterorl.transport.weights.shards`).

The model: ``--ranks`` real processes (gloo, CPU) holding a stack of ``--dim`` x ``--dim`` linear layers sharded
with FSDP2 (``--mb`` MB in bf16 on the wire, twice that as the float32 master); ``--workers`` `WorkerClient`
threads in rank 0's process, each loading every version into its own bf16 copy. Each version follows a change
of every weight on every rank (an optimizer step's worth); it is timed from the moment every rank has finished
that step (a barrier) until the slowest worker has loaded the version. Version 0 reaches the workers first,
untimed; the figure is the median of ``--versions`` versions. Deltas are off (whole versions: what resharding
is about; slices travel as deltas too when they are on).

Links: loopback as it is, and each learner rank behind an uplink of ``--bandwidths`` bits/s shared by all its
transfers (`heterorl.delay.DelayLink`, a constant latency of ``--latency-ms``): rank 0 holds each worker's
version notice back until every uplink has carried what that worker fetches from its rank. Gathered, rank 0's
uplink carries the whole version once per worker; resharded, every uplink carries its rank's slices once per
worker. The ideal ratio when the uplinks are the bottleneck is the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from heterorl.addresses import parse_host_port
from heterorl.bench.weight_workers import applied_times, load_versions

BF16 = torch.bfloat16
TIMEOUT_S = 300.0


def synthetic_model(mb: float, dim: int, seed: int = 0) -> torch.nn.Module:
    """Linear layers of ``dim`` x ``dim`` (no bias) whose bf16 bytes add up to about ``mb`` MB."""
    layers = max(1, round(mb * 1e6 / (2 * dim * dim)))
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]))


class Uplinks:
    """Every learner rank's outgoing link (one `DelayLink` each), shared by its transfers to all workers. As a
    `LearnerServer` weights link (``schedule``): a worker's notice is due when every rank's uplink has carried
    ``size`` bytes for it (the ranks' slices are the same size: FSDP's equal chunks). Not armed: no delay."""

    def __init__(self, ranks: int, bytes_per_s: float, latency_s: float) -> None:
        from heterorl.config import LinkDelayConfig
        from heterorl.delay.links import DelayLink

        config = LinkDelayConfig(kind="constant", constant_s=latency_s, bandwidth_bytes_per_s=bytes_per_s)
        self.links = [DelayLink(config, f"rank{r}/uplink") for r in range(ranks)]
        self.armed = False

    def schedule(self, now_s: float, size_bytes: int) -> float | None:
        if not self.armed:
            return now_s
        return max(link.schedule(now_s, size_bytes) for link in self.links)


def _own_copy():
    """A worker's load: each version copied into its own bf16 tensors (made at the first)."""
    target: dict[str, torch.Tensor] = {}

    def load(state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if name not in target:
                target[name] = torch.empty_like(tensor)
            target[name].copy_(tensor)

    return load


def _publish(mode: str, version: int, model, rank: int, world: int, endpoint) -> None:
    from heterorl.training.sharding import gather_full_state
    from heterorl.transport.weights.shards import describer, slices_of

    if mode == "gather":
        state = gather_full_state(model, {})
        if rank == 0:
            endpoint.publish(version, state, dtype=BF16)
        return
    slices, shapes, boxes = slices_of(model.state_dict(), rank, world)
    if rank == 0:
        endpoint.publish(version, slices, dtype=BF16, describe=describer(0, world, shapes, boxes))
    else:
        endpoint.publish(version, slices, shapes, boxes, dtype=BF16)


def _servers(mode: str, rank: int, world: int, bits: float, latency_s: float, config):
    """Rank 0: (its `LearnerServer`, the uplinks or None); the others: (their `ShardServer` or None, None)."""
    import torch.distributed as dist

    from heterorl.transport import LearnerServer
    from heterorl.transport.weights.shards import ShardServer

    uplinks, server, port = None, None, 0
    if rank > 0 and mode == "reshard":  # a free port of its own, told to rank 0
        server = ShardServer("tcp://127.0.0.1:0", rank, world, config)
        port = parse_host_port(server.endpoint, f"rank {rank}'s weights endpoint", "tcp://127.0.0.1:0")[1]
    ports = [0] * world
    dist.all_gather_object(ports, port)
    if rank == 0:
        ranks = world if mode == "reshard" else 1
        uplinks = Uplinks(ranks, bits / 8, latency_s) if bits else None
        server = LearnerServer("tcp://127.0.0.1:0", config, shard_ranks=ranks, shard_ports=ports[1:ranks],
                               weights_delay=(lambda _: uplinks.schedule) if uplinks else None)
    return server, uplinks


def _measure(mode: str, workers: int, bits: float, args, model, rank: int, world: int) -> list[float]:
    """Seconds from every rank's step done to every worker's version loaded, per timed version (rank 0)."""
    import torch.distributed as dist

    from heterorl.config import TransportConfig
    from heterorl.transport import WorkerClient

    config = TransportConfig(weights_deltas=False, allow_plaintext=True)
    server, uplinks = _servers(mode, rank, world, bits, args.latency_ms / 1e3, config)
    clients, reports, seconds = [], queue.Queue(), []
    try:
        if rank == 0:
            clients = [WorkerClient(server.control_endpoint, f"w{i}", config) for i in range(workers)]
            for client in clients:
                client.wait_ready(TIMEOUT_S)
                threading.Thread(target=load_versions, args=(client, _own_copy(), args.versions, TIMEOUT_S, reports),
                                 daemon=True).start()
        for version in range(args.versions + 1):
            with torch.no_grad():
                for p in model.parameters():  # every weight changes, as after an optimizer step
                    local = p.to_local()  # (this rank's slice, in place: DTensor random ops warn on CPU)
                    local.add_(torch.randn_like(local) * 1e-3)
            dist.barrier()
            start = time.perf_counter()
            if uplinks is not None:
                uplinks.armed = version > 0
            _publish(mode, version, model, rank, world, server)
            if rank == 0:
                done = applied_times(reports, version, workers, TIMEOUT_S)
                if version > 0:
                    seconds.append(max(done) - start)
            dist.barrier()  # (the next step starts once every worker has this version)
    finally:
        for client in clients:
            client.close()
        if server is not None:
            server.close()
    return seconds


def _rank_main(rank: int, world: int, folder: str, args) -> None:
    import torch.distributed as dist

    from heterorl.training.sharding import fully_shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        model = fully_shard_model(synthetic_model(args.mb, args.dim))
        rows = []
        for bits in args.bandwidths:
            for workers in args.workers:
                row = {"bits": bits, "workers": workers}
                for mode in ("gather", "reshard"):
                    row[mode] = _measure(mode, workers, bits, args, model, rank, world)
                rows.append(row)
                if rank == 0:
                    print(_line(row, world, args), flush=True)
        if rank == 0:
            Path(folder, "rows.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _line(row: dict, world: int, args) -> str:
    gather, reshard = statistics.median(row["gather"]), statistics.median(row["reshard"])
    link = f"{row['bits'] / 1e6:g} Mbit/s per rank" if row["bits"] else "loopback"
    ideal = f"{world:.2f}x" if row["bits"] else "  -  "
    return (f"  {link:>22} | {row['workers']} worker(s) | gather {gather:7.3f} s | reshard {reshard:7.3f} s | "
            f"gather / reshard {gather / reshard:5.2f}x (ideal {ideal})")


def _list_of(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="heterorl bench reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="learner ranks (processes; default 2)")
    parser.add_argument("--workers", type=_list_of(int), default=[1, 2, 4], help="workers per row (default 1,2,4)")
    parser.add_argument("--mb", type=float, default=120.0, help="model size in bf16 MB (default 120)")
    parser.add_argument("--dim", type=int, default=2048, help="width of its square layers (default 2048)")
    parser.add_argument("--bandwidths", type=_list_of(float), default=[0.0, 1e9],
                        help="each rank's uplink in bits/s, 0 for loopback as it is (default 0,1e9)")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the uplinks' latency (default 5 ms)")
    parser.add_argument("--versions", type=int, default=3, help="timed versions per figure (default 3)")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error("--ranks: a sharded learner has at least 2 ranks")
    import torch.multiprocessing as mp

    layers = max(1, round(args.mb * 1e6 / (2 * args.dim ** 2)))
    print(f"{args.ranks} learner ranks (FSDP2, gloo) of {layers} layers {args.dim}x{args.dim}: "
          f"{layers * args.dim ** 2 * 2 / 1e6:.0f} MB in bf16 on the wire; median of {args.versions} versions, "
          "from every rank's step done to the slowest worker's version loaded", flush=True)
    with tempfile.TemporaryDirectory(prefix="heterorl-reshard-") as folder:
        mp.start_processes(_rank_main, args=(args.ranks, folder, args), nprocs=args.ranks, start_method="spawn")
        rows = json.loads(Path(folder, "rows.json").read_text())
    linked = [r for r in rows if r["bits"]]
    if linked:
        worst = min(statistics.median(r["gather"]) / statistics.median(r["reshard"]) for r in linked)
        print(f"behind the uplinks, resharding is at least {worst:.2f}x faster than gathering "
              f"(ideal {args.ranks}x: each uplink carries 1/{args.ranks} of the bytes)")
    return 0


__all__ = ["Uplinks", "main", "synthetic_model"]
