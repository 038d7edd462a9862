"""Probe (written 2026-12-03, not yet run on the H200): per-request timestamps in every engine
process (front, scheduler, worker), for where a request's turnaround goes between its client's
send and its first forward, and between its last forward and its client's next send. Each
process appends (monotonic time, event, rid, uid) rows to $LAT_PROBE/ev.<pid>.jsonl;
lat_join.py joins them by request.

    LAT_PROBE=/tmp/lat PYTHONPATH=benchmarks/results/h200/runtime/probes/latency:. \\
        python3 benchmarks/runtime_bench.py --suite default-heldout --settings fdfo ...
    python3 benchmarks/results/h200/runtime/probes/latency/lat_join.py /tmp/lat

Events: F_submit / F_deliver (the front sends a request / delivers its finished output),
S_recv / S_admit / S_report / S_out (the scheduler receives it / sends its Admit / takes a
worker report / emits its finished output), W_admit / W_first / W_report (the worker applies
the Admit / first launches a forward with it / returns a report with retired blocks).
"""

import os

if os.environ.get("LAT_PROBE"):
    import atexit
    import json
    import time
    from typing import Any

    from dllm_serve.managers import messages as m
    from dllm_serve.managers import scheduler as s
    from dllm_serve.managers import tokenizer_manager as tm
    from dllm_serve.managers import worker as w

    _events: list[tuple[Any, ...]] = []
    _seen: set[int] = set()

    def _dump() -> None:
        if _events:
            path = os.path.join(os.environ["LAT_PROBE"], f"ev.{os.getpid()}.jsonl")
            with open(path, "a") as f:
                f.write("".join(json.dumps(e) + "\n" for e in _events))
            _events.clear()

    def _rec(*event: Any) -> None:
        _events.append((time.monotonic(), *event))
        if len(_events) >= 500:  # processes may be killed at the end: write as we go
            _dump()

    def _wrap(cls: type, name: str, before: Any = None, after: Any = None) -> None:
        orig = getattr(cls, name)

        def wrapped(self: Any, *args: Any) -> Any:
            if before is not None:
                before(self, *args)
            out = orig(self, *args)
            if after is not None:
                after(self, out)
            return out

        setattr(cls, name, wrapped)

    def _f_send(_: Any, msg: Any) -> None:
        if isinstance(msg, m.GenerateReq):
            _rec("F_submit", msg.rid)

    def _f_deliver(_: Any, out: Any) -> None:
        if out.finished:
            _rec("F_deliver", out.rid)

    def _s_handle(_: Any, msg: Any) -> None:
        if isinstance(msg, m.GenerateReq):
            _rec("S_recv", msg.rid)

    def _s_items(sched: Any, items: list[Any]) -> None:
        for it in items:
            if isinstance(it, m.Admit):
                req = sched.running.get(it.uid)
                _rec("S_admit", None if req is None else req.rid, it.uid)

    def _s_outputs(_: Any, outs: list[Any]) -> None:
        for o in outs:
            if isinstance(o, m.ReqOutput) and o.finished:
                _rec("S_out", o.rid)

    def _w_apply(_: Any, item: Any) -> None:
        if isinstance(item, m.Admit):
            _rec("W_admit", None, item.uid)

    def _w_launch(_: Any, launch: Any) -> None:
        for r in launch.layout.reqs:
            if not r.hole and r.uid not in _seen:
                _seen.add(r.uid)
                _rec("W_first", None, r.uid)

    def _w_iterate(_: Any, rep: Any) -> None:
        if rep is not None and rep.retired is not None and len(rep.retired):
            _rec("W_report", None)

    _wrap(tm.TokenizerManager, "_send", before=_f_send)
    _wrap(tm.TokenizerManager, "_deliver", before=_f_deliver)
    _wrap(tm.TokenizerManager, "shutdown", before=lambda _: _dump())
    _wrap(s.Scheduler, "handle", before=_s_handle)
    _wrap(s.Scheduler, "take_worker_items", after=_s_items)
    _wrap(s.Scheduler, "on_report", before=lambda _, rep: _rec("S_report", None))
    _wrap(s.Scheduler, "take_outputs", after=_s_outputs)
    _wrap(w.Worker, "apply", before=_w_apply)
    _wrap(w.Worker, "launch", after=_w_launch)
    _wrap(w.Worker, "iterate", after=_w_iterate)
    atexit.register(_dump)
