"""Probe: the raw round trip of one ZMQ ipc:// message between two processes (PUSH/PULL pairs,
polled as the engine's loops poll), for comparing with the hops the latency probe measures.

    python3 benchmarks/results/h200/runtime/probes/zmq_pingpong.py
"""

import multiprocessing as mp
import statistics
import tempfile
import time

import zmq


def echo(a: str, b: str, n: int) -> None:
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    rx.bind(a)
    tx.connect(b)
    poller = zmq.Poller()
    poller.register(rx, zmq.POLLIN)
    for _ in range(n):
        while not rx.poll(0):
            poller.poll(20)
        tx.send(rx.recv())


if __name__ == "__main__":
    mp.set_start_method("spawn")
    d = tempfile.mkdtemp()
    a, b, n = f"ipc://{d}/a", f"ipc://{d}/b", 3000
    proc = mp.Process(target=echo, args=(a, b, n))
    proc.start()
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    rx.bind(b)
    tx.connect(a)
    time.sleep(0.5)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        tx.send(b"x" * 200)
        rx.recv()
        lat.append(1e6 * (time.perf_counter() - t))
        if i % 10 == 0:
            time.sleep(0.001)
    proc.join()
    lat.sort()
    print(f"pingpong round trip us: p50 {lat[n // 2]:.0f} p90 {lat[int(0.9 * n)]:.0f} "
          f"p99 {lat[int(0.99 * n)]:.0f} mean {statistics.mean(lat):.0f}")
