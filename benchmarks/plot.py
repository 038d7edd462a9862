"""PNG plots from the JSON results of the other benchmarks.

    python -m benchmarks.plot results/*.json --out-dir results/plots

Writes, for whatever the inputs hold:
- throughput_vs_concurrency.png: output tokens/s against concurrency (offline: max_running_requests;
  serving: max_concurrency), one line per benchmark and mode;
- latency_vs_concurrency.png: median end-to-end latency (solid) and TTFT / time to first block
  (dashed) against concurrency, same lines;
- forwards_per_block.png: the distribution of forwards each committed block took, per run;
- accuracy_vs_tpf.png: GSM8K accuracy against tokens per forward, one point per run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import mode_name, run_cli

Point = tuple[float, float | None, float | None, float | None]  # x, tok/s, e2e s, ttft s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("inputs", nargs="+", help="JSON files written by the benchmarks (or folders)")
    p.add_argument("--out-dir", default="plots")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Path]:
    ns = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    results = load(ns.inputs)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [*plot_concurrency(results, out), *plot_forwards(results, out),
               *plot_accuracy(results, out)]
    print(f"{len(results)} results -> {len(written)} plots in {out}: "
          + ", ".join(p.name for p in written))
    return written


def load(inputs: list[str]) -> list[dict[str, Any]]:
    files = [f for i in inputs for f in (sorted(Path(i).glob("*.json")) if Path(i).is_dir()
                                         else [Path(i)])]
    results = [json.loads(f.read_text()) for f in files]
    return [r for r in results if r.get("benchmark") in ("offline_throughput", "serving", "gsm8k")]


def model_name(path: str | None) -> str:
    """A short label for a checkpoint: its folder name (the built-in model's is default_model)."""
    return Path(path).name if path else "default_model"


def concurrency_series(results: list[dict[str, Any]]) -> dict[str, list[Point]]:
    """One line per (benchmark, mode, checkpoint[, dataset and rate]). Serving runs without
    --max-concurrency sit at the concurrency they reached (mean requests in flight)."""
    series: dict[str, list[Point]] = defaultdict(list)
    for r in results:
        c = r["config"]
        if r["benchmark"] == "offline_throughput":
            for run in r["runs"]:
                series[f"offline {run['mode']} ({model_name(c['model_path'])})"].append((
                    run["max_running_requests"], run["output_throughput"],
                    run["e2e_latency_s"]["median"], run["time_to_first_block_s"]["median"]))
        elif r["benchmark"] == "serving":
            res = r["results"]
            model = model_name((c.get("server_info") or {}).get("model_path"))
            label = (f"serving {c['server_mode']} {c['dataset']} rate={c['request_rate']:g} "
                     f"({model})")
            series[label].append((
                c["max_concurrency"] or res["concurrency"], res["output_throughput"],
                _s(res["e2e_latency_ms"]["median"]), _s(res["ttft_ms"]["median"])))
    return {k: sorted(v) for k, v in series.items()}


def _s(ms: float | None) -> float | None:
    return ms / 1000.0 if ms is not None else None


def plot_concurrency(results: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    series = concurrency_series(results)
    if not series:
        return []
    paths = []
    for name, ylabel, cols in (
            ("throughput_vs_concurrency", "output tokens / s", (1,)),
            ("latency_vs_concurrency", "latency (s): median e2e (solid), first block (dashed)",
             (2, 3))):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for i, (label, pts) in enumerate(series.items()):
            for col, style in zip(cols, ("-o", "--x"), strict=False):
                xs = [p[0] for p in pts if p[col] is not None]
                ys = [p[col] for p in pts if p[col] is not None]
                ax.plot(xs, ys, style, color=f"C{i % 10}",
                        label=label if col == cols[0] else "_nolegend_")
        ax.set_xlabel("concurrency (max_running_requests / max_concurrency)")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths.append(_save(fig, out / f"{name}.png"))
    return paths


def plot_forwards(results: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    dists = {}
    for r in results:
        if r["benchmark"] == "offline_throughput":
            model = model_name(r["config"]["model_path"])
            for run in r["runs"]:
                key = f"offline {run['mode']} mrr={run['max_running_requests']} ({model})"
                dists[key] = run["forwards_per_block"]
        elif r["benchmark"] == "gsm8k" and r["results"].get("forwards_per_block"):
            dists[f"gsm8k {_gsm8k_label(r)}"] = r["results"]["forwards_per_block"]
    same: dict[tuple[int, ...], list[str]] = defaultdict(list)  # runs with identical counts
    for label, values in dists.items():
        if values:
            same[tuple(sorted(values))].append(label)
    dists = {names[0] + (f" (+{len(names) - 1} identical)" if len(names) > 1 else ""):
             list(values) for values, names in same.items()}
    if not dists:
        return []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    top = max(max(v) for v in dists.values())
    bins = [b + 0.5 for b in range(0, top + 1)]
    for label, values in dists.items():
        ax.hist(values, bins=bins, histtype="step", density=True, label=label)
    ax.set_xlabel("forwards per committed block")
    ax.set_ylabel("fraction of blocks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return [_save(fig, out / "forwards_per_block.png")]


def plot_accuracy(results: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    points = [(r["results"]["tokens_per_forward"], r["results"]["accuracy"], _gsm8k_label(r))
              for r in results if r["benchmark"] == "gsm8k"
              and r["results"].get("tokens_per_forward") is not None]
    if not points:
        return []
    labels: dict[tuple[float, float], list[str]] = defaultdict(list)
    for tpf, acc, label in points:  # runs that land on the same point share one annotation
        labels[(round(tpf, 3), round(acc, 3))].append(label)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    middle = (min(t for t, _ in labels) + max(t for t, _ in labels)) / 2
    for (tpf, acc), names in labels.items():
        ax.scatter([tpf], [acc])
        right = tpf > middle  # text toward the inside of the axes
        ax.annotate("\n".join(names), (tpf, acc), fontsize=6, xytext=(-4 if right else 4, 4),
                    textcoords="offset points", ha="right" if right else "left")
    ax.margins(x=0.15)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("GSM8K accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "accuracy_vs_tpf.png")]


def _gsm8k_label(r: dict[str, Any]) -> str:
    info = r["config"].get("server_info") or {}
    return (f"{info.get('dllm_algorithm', '?')} {mode_name(info)} "
            f"mrr={info.get('max_running_requests', '?')} ({model_name(info.get('model_path'))}, "
            f"{r['config']['backend']})")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


if __name__ == "__main__":
    run_cli(main)
