"""Session 32's probe of the first prefill after a cold-cache start, inside the Engine's worker.

With this folder on PYTHONPATH every Python process (the spawned worker included) runs this file
at start. Nothing happens unless one of these is set:
- DLLM_PROBE_PREFILL=1: the first SHOWN prefills print (stderr: the worker's log) the host
  milliseconds of `ModelRunner.prefill` and of its pieces (`MetaWriter.write`, `copy_to_device`,
  `CUDAGraph.replay`), the thread's CPU time over it, and the page faults, context switches,
  gc counts and Python threads around it;
- DLLM_PROBE_PROFILE=1 (with the above): prefills #0 and #1 also run under cProfile, printed in
  microseconds by own time;
- DLLM_PROBE_ITEMS=1: the first three trace items (`Tracer.run`, the test's "host launch" window)
  print their wall and thread CPU time with the change of this thread's schedstat, /proc/vmstat's
  numa / compaction / fault counters and the system's irq, softirq and steal ticks;
- DLLM_PROBE_CPU=1: every prefill trace item prints its wall and thread CPU time, taken just
  outside `Tracer.run` and nothing else (a thread CPU time short of the wall time is time the
  thread did not run: descheduled, or its vCPU not running; it and DLLM_PROBE_ITEMS patch the
  same method: set one of them. The round trace now records this itself, as `cpu_ms`);
- DLLM_PROBE_PMU=1 (session 33): every prefill trace item prints its wall and thread CPU time
  with the thread's own user-space hardware counters over it (perf_event_open: cycles,
  reference cycles, instructions, cache misses, dTLB load misses), so a slow first launch
  shows whether it ran more instructions, ran them at a lower clock (cycles / ref-cycles), or
  stalled on misses. It too patches `Tracer.run`;
- DLLM_PROBE_SPIN=1 (session 33; the device's guest has no PMU: perf_event_open gives ENOENT):
  before each of the first prefill trace items, five back-to-back runs of a fixed Python loop
  (20k iterations, register-bound once hot), each timed, then the item's wall and CPU time.
  A clock or vCPU slow to wake shows as slow first spins; a cold working set does not slow
  them, and then the launch still stalls after them. It too patches `Tracer.run`;
- DLLM_PROBE_DRY=1 (session 33): right after the warm-up's `replay_each`, one prefill through
  `run_prefill` itself (the served path: metadata from real segments, ids, copy, replay) at the
  largest bucket, every block a one-block segment at position 0 of the scratch slot (its K/V
  writes land on the scratch page, as pad blocks' do), its host time printed. If the stall
  is the served path's first run after the compiles, it moves here, before ready;
- DLLM_PROBE_EARLY=1: torch and the model modules are imported at interpreter start (call 2's
  probe did this; its stall did not show);
- DLLM_PROBE_TRIM=1: glibc's malloc_trim(0) right after the warm-up's last step.
The patches land when their module is first imported (an import hook), so without
DLLM_PROBE_EARLY nothing is imported sooner than the engine imports it.
"""

import os

if any(os.environ.get(f"DLLM_PROBE_{k}") for k in ("PREFILL", "ITEMS", "TRIM", "EARLY", "CPU",
                                                   "PMU", "SPIN", "DRY")):
    import cProfile
    import ctypes
    import gc
    import importlib.abc
    import importlib.util
    import resource
    import sys
    import threading
    import time

    SHOWN = 8
    state = {"n": 0, "cur": None, "items": 0}

    def kernel_view():
        """This thread's schedstat (ns on cpu, ns waiting, slices), /proc/vmstat's numa,
        compaction, thp, fault and tlb counters, and the system's irq / softirq / steal ticks."""
        out = {}
        run, wait, slices = open("/proc/thread-self/schedstat").read().split()
        out.update(sched_run_ns=int(run), sched_wait_ns=int(wait), sched_slices=int(slices))
        for line in open("/proc/vmstat"):
            key, value = line.split()
            if key.startswith(("numa", "compact", "thp", "pgfault", "pgmajfault", "tlb")):
                out[key] = int(value)
        cpu = open("/proc/stat").readline().split()
        out.update(irq=int(cpu[6]), softirq=int(cpu[7]), steal=int(cpu[8]))
        return out

    def changed(k0, k1):
        return " ".join(f"{k} {k1[k] - k0[k]}" for k in k0 if k1.get(k, 0) != k0[k])

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if state["cur"] is not None:
                state["cur"][name] = state["cur"].get(name, 0.0) + 1e3 * (time.perf_counter() - t)
            return out
        return wrapper

    def print_profile(prof, n):
        prof.create_stats()
        for (file, line, fn), (_, nc, tt, ct, _) in sorted(
                prof.stats.items(), key=lambda kv: -kv[1][2])[:18]:
            print(f"PROFILE #{n} own {1e6 * tt:8.1f} us  incl {1e6 * ct:8.1f} us  x{nc}  {fn} "
                  f"{file.split('/')[-1]}:{line}", file=sys.stderr)

    def patch_runner(module):
        import torch

        from dllm_serve.model import cuda_graph, graph_layout

        prefill = module.ModelRunner.prefill

        def whole(self, *args, **kwargs):
            n = state["n"]
            if n >= SHOWN:
                return prefill(self, *args, **kwargs)
            state["cur"] = {}
            prof = (cProfile.Profile(time.perf_counter_ns, 1e-9)
                    if n < 2 and os.environ.get("DLLM_PROBE_PROFILE") else None)
            r0, t, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), \
                time.thread_time()
            if prof is not None:
                prof.enable()
            out = prefill(self, *args, **kwargs)
            if prof is not None:
                prof.disable()
            ms, cpu_ms = 1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - c0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cur, state["cur"] = state["cur"], None
            print(f"PROBE prefill #{n} at {time.monotonic():.3f}: whole {ms:.3f} ms (thread cpu "
                  f"{cpu_ms:.3f}) " + " ".join(f"{k} {v:.3f}" for k, v in cur.items())
                  + f" minflt {r1.ru_minflt - r0.ru_minflt} majflt {r1.ru_majflt - r0.ru_majflt}"
                  f" nvcsw {r1.ru_nvcsw - r0.ru_nvcsw} nivcsw {r1.ru_nivcsw - r0.ru_nivcsw}"
                  f" gc {gc.get_count()} threads {[th.name for th in threading.enumerate()]}",
                  file=sys.stderr, flush=True)
            if prof is not None:
                print_profile(prof, n)
            state["n"] += 1
            return out

        module.ModelRunner.prefill = whole
        graph_layout.MetaWriter.write = timed("write", graph_layout.MetaWriter.write)
        cuda_graph.copy_to_device = timed("copy", cuda_graph.copy_to_device)
        torch.cuda.CUDAGraph.replay = timed("replay", torch.cuda.CUDAGraph.replay)

    def patch_trace(module):
        trace_run = module.Tracer.run

        def run(self, kind, fn, rows=0):
            n = state["items"]
            if n >= 3:
                return trace_run(self, kind, fn, rows)
            k0, t, c0 = kernel_view(), time.perf_counter(), time.thread_time()
            out = trace_run(self, kind, fn, rows)
            ms, cpu_ms = 1e3 * (time.perf_counter() - t), 1e3 * (time.thread_time() - c0)
            print(f"PROBE item #{n} {kind}: wall {ms:.3f} ms, thread cpu {cpu_ms:.3f}; "
                  + changed(k0, kernel_view()), file=sys.stderr, flush=True)
            state["items"] += 1
            return out

        module.Tracer.run = run

    def patch_trace_cpu(module):
        trace_run = module.Tracer.run

        def run(self, kind, fn, rows=0):
            t0 = time.perf_counter()
            c0 = time.thread_time()
            out = trace_run(self, kind, fn, rows)
            c1 = time.thread_time()
            t1 = time.perf_counter()
            if kind == "prefill":
                n = state["items"]
                state["items"] += 1
                print(f"PROBE cpu prefill #{n}: wall {1e3 * (t1 - t0):.3f} ms, thread cpu "
                      f"{1e3 * (c1 - c0):.3f} ms", file=sys.stderr, flush=True)
            return out

        module.Tracer.run = run

    PMU = (("cycles", 0, 0), ("ref_cycles", 0, 9), ("instructions", 0, 1),
           ("cache_misses", 0, 3), ("dtlb_misses", 3, 3 | (1 << 16)))

    def open_counters():
        """This thread's user-space counters (name, fd), or the error of the first that fails."""
        libc = ctypes.CDLL(None, use_errno=True)
        fds = []
        for name, kind, config in PMU:
            attr = (ctypes.c_uint64 * 8)()  # perf_event_attr, PERF_ATTR_SIZE_VER0 = 64 bytes
            attr[0] = kind | (64 << 32)  # type, size
            attr[1] = config
            attr[5] = (1 << 5) | (1 << 6)  # exclude_kernel, exclude_hv
            fd = libc.syscall(298, ctypes.byref(attr), 0, -1, -1, 0)  # this thread, any cpu
            if fd < 0:
                return f"perf_event_open {name}: errno {ctypes.get_errno()}"
            fds.append((name, fd))
        return fds

    def read_counters(fds):
        return {name: int.from_bytes(os.read(fd, 8), "little") for name, fd in fds}

    def patch_trace_pmu(module):
        trace_run = module.Tracer.run

        def run(self, kind, fn, rows=0):
            if kind != "prefill" or state["items"] >= 12:
                return trace_run(self, kind, fn, rows)
            if "pmu" not in state:
                state["pmu"] = open_counters()
                if isinstance(state["pmu"], str):
                    print(f"PROBE pmu: {state['pmu']}", file=sys.stderr, flush=True)
            fds = state["pmu"] if isinstance(state["pmu"], list) else []
            k0, t0, c0 = read_counters(fds), time.perf_counter(), time.thread_time()
            out = trace_run(self, kind, fn, rows)
            c1, t1, k1 = time.thread_time(), time.perf_counter(), read_counters(fds)
            n = state["items"]
            state["items"] += 1
            print(f"PROBE pmu prefill #{n}: wall {1e3 * (t1 - t0):.3f} ms, thread cpu "
                  f"{1e3 * (c1 - c0):.3f} ms, " + ", ".join(
                      f"{k} {k1[k] - k0[k]}" for k in k0), file=sys.stderr, flush=True)
            return out

        module.Tracer.run = run

    def spin():
        t = time.perf_counter()
        for _ in range(20000):
            pass
        return 1e3 * (time.perf_counter() - t)

    def patch_trace_spin(module):
        trace_run = module.Tracer.run

        def run(self, kind, fn, rows=0):
            if kind != "prefill" or state["items"] >= 8:
                return trace_run(self, kind, fn, rows)
            spins = [spin() for _ in range(5)]
            t0, c0 = time.perf_counter(), time.thread_time()
            out = trace_run(self, kind, fn, rows)
            c1, t1 = time.thread_time(), time.perf_counter()
            n = state["items"]
            state["items"] += 1
            print(f"PROBE spin prefill #{n}: spins ms {' '.join(f'{x:.3f}' for x in spins)}; "
                  f"launch wall {1e3 * (t1 - t0):.3f} ms, thread cpu {1e3 * (c1 - c0):.3f}",
                  file=sys.stderr, flush=True)
            return out

        module.Tracer.run = run

    def patch_warm_up(module):
        replay_each = module.PrefillGraphs.replay_each

        def replay_then_trim(self):
            replay_each(self)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            print("PROBE malloc_trim(0) after warm-up", file=sys.stderr, flush=True)

        module.PrefillGraphs.replay_each = replay_then_trim

    def patch_dry(module):
        import numpy as np

        replay_each = module.PrefillGraphs.replay_each

        def replay_then_dry(self):
            replay_each(self)
            k, n = self.layout.block_size, self.buckets[-1]
            ids = [np.full(k, self.pad_id, dtype=np.int64) for _ in range(n)]
            for i in range(2):
                t, c = time.perf_counter(), time.thread_time()
                ran = self.run_prefill([self.scratch_slot] * n, [0] * n, ids)
                print(f"PROBE dry prefill {i} ({n} blocks, ran {ran}): "
                      f"{1e3 * (time.perf_counter() - t):.3f} ms, thread cpu "
                      f"{1e3 * (time.thread_time() - c):.3f}", file=sys.stderr, flush=True)

        module.PrefillGraphs.replay_each = replay_then_dry

    targets = {}
    if os.environ.get("DLLM_PROBE_PREFILL"):
        targets["dllm_serve.model.runner"] = patch_runner
    if os.environ.get("DLLM_PROBE_ITEMS"):
        targets["dllm_serve.managers.round_trace"] = patch_trace
    if os.environ.get("DLLM_PROBE_CPU"):
        targets["dllm_serve.managers.round_trace"] = patch_trace_cpu
    if os.environ.get("DLLM_PROBE_PMU"):
        targets["dllm_serve.managers.round_trace"] = patch_trace_pmu
    if os.environ.get("DLLM_PROBE_SPIN"):
        targets["dllm_serve.managers.round_trace"] = patch_trace_spin
    if os.environ.get("DLLM_PROBE_DRY"):
        targets["dllm_serve.model.prefill_graphs"] = patch_dry
    if os.environ.get("DLLM_PROBE_TRIM"):
        targets["dllm_serve.model.prefill_graphs"] = patch_warm_up

    class Hook(importlib.abc.MetaPathFinder):
        """Patches a target module right after it executes (first import)."""

        def find_spec(self, name, path, target=None):
            if name not in targets:
                return None
            after = targets.pop(name)
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if targets:
                sys.meta_path.insert(0, self)
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                after(module)

            spec.loader.exec_module = exec_then_patch
            return spec

    if targets:
        sys.meta_path.insert(0, Hook())
    if os.environ.get("DLLM_PROBE_EARLY"):
        import torch  # noqa: F401

        import dllm_serve.model.cuda_graph  # noqa: F401
        import dllm_serve.model.graph_layout  # noqa: F401
        import dllm_serve.model.runner  # noqa: F401
