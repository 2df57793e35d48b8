#!/usr/bin/env python
"""Transport between a front end and the engine-core process: ZeroMQ (ipc://) vs a
multiprocessing pipe, for msgspec-encoded messages of ``engine/messages.py``.

    python tools/bench/bench_transport.py [--rtt 3000] [--batches 20000] [--streams 64] [--rounds 3]

Round trip: the front end sends one ``AddRequest`` (a 128-token prompt), the core answers one
``StepOutputs`` of one delta (p50 / p99 microseconds). Throughput: the core sends ``StepOutputs``
of ``--streams`` one-token deltas as fast as it can; the front end decodes them (batches/s and
deltas/s). Each side encodes and decodes, as in the engine. The two transports run as
``--rounds`` interleaved rounds (``harness.interleaved``); each figure is the median round's,
``--json`` keeps every round's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable
from typing import Any

import msgspec

from deltaserve.engine.messages import AddRequest, CoreMessage, FrontMessage, StepOutputs, TokenDelta
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.tools.bench.harness import (
    Bench,
    bench_parser,
    describe_box,
    interleaved,
    repeat,
    spread,
    timed,
)


def _reply(n: int) -> StepOutputs:
    return StepOutputs([TokenDelta(f"0:{i}", [1000 + i], num_prompt_tokens=128) for i in range(n)])


def _core_zmq(address: str, rtt: int, batches: int, streams: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what passes its high-water mark
    sock.bind(address)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FrontMessage)
    one = enc.encode(_reply(1))
    ident = b""
    for _ in range(rtt):
        ident, data = sock.recv_multipart()
        dec.decode(data)
        sock.send_multipart([ident, one])
    batch = _reply(streams)
    for _ in range(batches):
        sock.send_multipart([ident, enc.encode(batch)])
    sock.recv_multipart()  # the front end has read them all


def _core_pipe(conn: Any, rtt: int, batches: int, streams: int) -> None:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FrontMessage)
    one = enc.encode(_reply(1))
    for _ in range(rtt):
        dec.decode(conn.recv_bytes())
        conn.send_bytes(one)
    batch = _reply(streams)
    for _ in range(batches):
        conn.send_bytes(enc.encode(batch))
    conn.recv_bytes()


def _front(send: Any, recv: Any, rtt: int, batches: int) -> dict[str, float]:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreMessage)
    add = AddRequest("0:0", list(range(128)), SamplingParams(max_tokens=64))

    def round_trip() -> None:
        send(enc.encode(add))
        dec.decode(recv())

    times = sorted(repeat(round_trip, rtt))
    deltas = 0

    def stream() -> None:
        nonlocal deltas
        for _ in range(batches):
            deltas += len(dec.decode(recv()).deltas)  # type: ignore[union-attr]

    dt, _ = timed(stream)
    send(b"done")
    return {
        "rtt_p50_us": spread(times)["median"] * 1e6,
        "rtt_p99_us": times[int(0.99 * len(times))] * 1e6,
        "batches_per_s": batches / dt,
        "deltas_per_s": deltas / dt,
    }


def bench_zmq(rtt: int, batches: int, streams: int) -> dict[str, float]:
    import zmq

    address = f"ipc://{tempfile.gettempdir()}/deltaserve-bench-{os.getpid()}"
    p = mp.get_context("spawn").Process(target=_core_zmq, args=(address, rtt, batches, streams))
    p.start()
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    try:
        return _front(sock.send, sock.recv, rtt, batches)
    finally:
        p.join()
        sock.close(linger=0)


def bench_pipe(rtt: int, batches: int, streams: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_core_pipe, args=(theirs, rtt, batches, streams))
    p.start()
    try:
        return _front(mine.send_bytes, mine.recv_bytes, rtt, batches)
    finally:
        p.join()


def main() -> None:
    ap = bench_parser(__doc__, rounds=3)
    ap.add_argument("--rtt", type=int, default=3000, help="round trips (default %(default)s)")
    ap.add_argument("--batches", type=int, default=20000, help="step messages (default %(default)s)")
    ap.add_argument("--streams", type=int, default=64, help="deltas per step message (default %(default)s)")
    args = ap.parse_args()
    bench = Bench("bench_transport", args)
    rounds: dict[str, list[dict[str, float]]] = {"zmq-ipc": [], "mp-pipe": []}

    def case(name: str, fn: Callable[[int, int, int], dict[str, float]]) -> Callable[[], None]:
        return lambda: rounds[name].append(fn(args.rtt, args.batches, args.streams))

    interleaved({"zmq-ipc": case("zmq-ipc", bench_zmq), "mp-pipe": case("mp-pipe", bench_pipe)}, args.rounds)
    print(f"{'transport':<10} {'rtt p50 us':>11} {'rtt p99 us':>11} {'steps/s':>10} {'deltas/s':>11}")
    results = {}
    for name, rs in rounds.items():
        r = results[name] = {k: spread([x[k] for x in rs]) for k in rs[0]}
        print(
            f"{name:<10} {r['rtt_p50_us']['median']:>11.1f} {r['rtt_p99_us']['median']:>11.1f} "
            f"{r['batches_per_s']['median']:>10.0f} {r['deltas_per_s']['median']:>11.0f}"
        )
    print(f"(medians of {args.rounds} interleaved rounds)")
    print(describe_box(bench.before))
    bench.write(args.json, {name: {"median": r, "rounds": rounds[name]} for name, r in results.items()})


if __name__ == "__main__":
    main()
