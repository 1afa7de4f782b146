"""Per-step cost of sending the SchedulerOutput from tensor-parallel rank 0 to a worker.

Two ranks joined by gloo (one torch thread each), as the engine runs them at TP=2 on the
CPU. Each timed iteration is what starts a step: rank 0 sends the step message, then both
ranks enter a one-float all-reduce (the step's first collective, which waits for the worker
to have received and decoded the message). The per-step cost of a transport is the median
iteration time minus the median of the same loop with no message (`none`).

Messages (`engine.core.step_io` dataclasses, as the scheduler builds them):
  decode1 / decode32 / decode256   a decode step of 1, 32, 256 running requests (plus the
                                   tokens rank 0 sampled the step before)
  prefill4x512                     four new requests of 512 prompt tokens

Transports:
  pipe-dataclasses   multiprocessing Pipe, the dataclasses pickled as they are
  pipe               multiprocessing Pipe, the flat encoding the engine uses
                     (engine.worker.distributed.transport.encode_step / decode_step)
  shm                the same bytes through the engine's shared-memory ring (StepWriter /
                     StepReader: slots in shared memory, a semaphore wakes the worker)
  broadcast          the same bytes through torch.distributed.broadcast_object_list (gloo)

    python bench/tp_transport.py [--iters 300] [--rounds 5]

Prints a table of medians (µs) and appends a JSON line to bench/results/tp_transport.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import LoadMeter, base_record, idle_snapshot, write_jsonl  # noqa: E402

TRANSPORTS = ("none", "pipe-dataclasses", "pipe", "shm", "broadcast")


def make_messages() -> dict[str, tuple]:
    """name -> (SchedulerOutput, sampled request ids, sampled token ids)."""
    from engine.core.step_io import CachedRequestData, NewRequestData, SchedulerOutput
    from engine.sampling_params import SamplingParams

    out = {}
    for batch in (1, 32, 256):
        so = SchedulerOutput()
        ids = [f"req-{i:06d}" for i in range(batch)]
        for i, rid in enumerate(ids):
            new_blocks = [1000 + i] if i % 16 == 0 else []  # a block fills every 16 tokens
            so.scheduled_cached_reqs.append(CachedRequestData(rid, new_blocks, [], 300 + i))
            so.num_scheduled_tokens[rid] = 1
        so.total_num_scheduled_tokens = batch
        out[f"decode{batch}"] = (so, ids, list(range(batch)))
    so = SchedulerOutput()
    for i in range(4):
        rid = f"new-{i}"
        blocks = list(range(32 * i, 32 * i + 32))
        params = SamplingParams(max_tokens=128, temperature=0.7, seed=i)
        so.scheduled_new_reqs.append(NewRequestData(rid, list(range(512)), [], params, blocks, 0))
        so.num_scheduled_tokens[rid] = 512
    so.total_num_scheduled_tokens = 2048
    out["prefill4x512"] = (so, [], [])
    return out


def _join(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


def worker(port: int, conn, ring) -> None:
    """Rank 1: receives with the transport rank 0 names, then joins the all-reduce."""
    import torch
    import torch.distributed as dist

    from engine.worker.distributed.transport import StepReader, decode_step

    _join(1, port)
    reader = StepReader(ring, conn)
    one = torch.zeros(1)
    while (cmd := conn.recv()) is not None:
        transport, iters = cmd
        recv_us = []
        for _ in range(iters):
            t0 = time.perf_counter()
            if transport == "pipe-dataclasses":
                conn.recv()
            elif transport == "pipe":
                decode_step(conn.recv_bytes())
            elif transport == "shm":
                decode_step(reader.recv())
            elif transport == "broadcast":
                box = [None]
                dist.broadcast_object_list(box, src=0)
                decode_step(box[0])
            recv_us.append((time.perf_counter() - t0) * 1e6)
            dist.all_reduce(one)
        conn.send(recv_us)
    reader.close()


def run(iters: int, rounds: int) -> dict:
    import multiprocessing as mp

    import torch
    import torch.distributed as dist

    from engine.worker.distributed.transport import StepWriter, encode_step

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ours, theirs = ctx.Pipe()
    ring = StepWriter(ctx, ours)
    proc = ctx.Process(target=worker, args=(store.port, theirs, ring.handle), daemon=True)
    proc.start()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    one = torch.zeros(1)
    messages = make_messages()
    step_us: dict[tuple[str, str], list[float]] = {}
    send_us: dict[tuple[str, str], list[float]] = {}
    recv_us: dict[tuple[str, str], list[float]] = {}
    sizes = {name: len(encode_step(*m)) for name, m in messages.items()}
    with LoadMeter() as load:
        for _ in range(rounds):  # rounds interleave the transports: they share the noise
            for name, (so, ids, toks) in messages.items():
                for transport in TRANSPORTS:
                    key = (name, transport)
                    ours.send((transport, iters))
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        if transport == "pipe-dataclasses":
                            ours.send((so, ids, toks))
                        elif transport == "pipe":
                            ours.send_bytes(encode_step(so, ids, toks))
                        elif transport == "shm":
                            ring.send(encode_step(so, ids, toks), timeout_s=60)
                        elif transport == "broadcast":
                            dist.broadcast_object_list([encode_step(so, ids, toks)], src=0)
                        t1 = time.perf_counter()
                        dist.all_reduce(one)
                        t2 = time.perf_counter()
                        send_us.setdefault(key, []).append((t1 - t0) * 1e6)
                        step_us.setdefault(key, []).append((t2 - t0) * 1e6)
                    recv_us.setdefault(key, []).extend(ours.recv())
    ours.send(None)
    proc.join(30)
    dist.destroy_process_group()
    ring.close()
    table = {}
    for name in messages:
        base = statistics.median(step_us[(name, "none")])
        table[name] = {"bytes": sizes[name], "baseline_allreduce_us": round(base, 1)}
        for transport in TRANSPORTS[1:]:
            key = (name, transport)
            table[name][transport] = {
                "per_step_us": round(statistics.median(step_us[key]) - base, 1),
                "send_us": round(statistics.median(send_us[key]), 1),
                "recv_decode_us": round(statistics.median(recv_us[key]), 1),
            }
    return {"results": table, "load": load.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="iterations per transport per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp_transport.jsonl"))
    args = ap.parse_args()
    record = base_record("tp_transport")
    record["idle_cores_before"] = idle_snapshot()
    record.update(run(args.iters, args.rounds))
    record["iters"], record["rounds"] = args.iters, args.rounds
    write_jsonl(args.out, record)
    print(f"other_cores {record['load']['other_cores']} (0 = quiet box)")
    head = f"{'message':<14}{'bytes':>7}{'allreduce':>10}"
    print(head + "".join(f"{t:>18}" for t in TRANSPORTS[1:]))
    print(" " * 31 + "".join(f"{'step/send/recv µs':>18}" for _ in TRANSPORTS[1:]))
    for name, row in record["results"].items():
        cells = "".join(
            f"{row[t]['per_step_us']:>8.0f}/{row[t]['send_us']:.0f}/{row[t]['recv_decode_us']:.0f}"
            .rjust(18)
            for t in TRANSPORTS[1:]
        )  # fmt: skip
        print(f"{name:<14}{row['bytes']:>7}{row['baseline_allreduce_us']:>10.0f}{cells}")


if __name__ == "__main__":
    main()
