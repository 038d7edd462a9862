"""Write an lm-eval task folder whose task `gsm8k_local` is lm-eval's own `gsm8k` task (its
prompt, stop strings, filters and metric, included from the installed lm-eval) read from the
GSM8K copy shipped in benchmarks/data/gsm8k instead of the Hugging Face hub (no download).

    python -m benchmarks.lm_eval_task --out /tmp/lm_eval_tasks
    lm_eval --model local-completions --include_path /tmp/lm_eval_tasks --tasks gsm8k_local ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DATA_DIR


def task_yaml(gsm8k_yaml: Path, data_dir: Path) -> str:
    return (f"include: {gsm8k_yaml}\n"
            f"task: gsm8k_local\n"
            f"dataset_path: json\n"
            f"dataset_name: null\n"
            f"dataset_kwargs:\n"
            f"  data_files:\n"
            f"    train: {data_dir / 'train.jsonl'}\n"
            f"    test: {data_dir / 'test.jsonl'}\n")


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write gsm8k_local.yaml into")
    p.add_argument("--data-dir", default=str(DATA_DIR), help="GSM8K train.jsonl / test.jsonl")
    ns = p.parse_args(argv)
    import lm_eval  # the installed lm-eval's own task file is included, not copied

    gsm8k_yaml = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gsm8k_local.yaml"
    path.write_text(task_yaml(gsm8k_yaml, Path(ns.data_dir).resolve()))
    print(path)
    return path


if __name__ == "__main__":
    main()
