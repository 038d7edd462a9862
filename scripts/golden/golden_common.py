"""Helpers shared by the golden-fixture scripts (scripts/golden/make_*_golden.py).

Each script runs an independent public implementation (read at run time from a fetched copy of
its repository, never copied into ours) on a tiny checkpoint written by our own builder, and
saves what it computed as one small safetensors file under tests/fixtures/: the input ids, fp32
logits of a short block-causal forward (a fixed subset of vocabulary columns, plus each row's
argmax and logsumexp over the whole vocabulary), and the greedy tokens of a short generation.
The file's metadata records where the code came from, the library versions and the settings;
tests/test_golden.py checks our model against it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
FIXTURES = REPO / "tests" / "fixtures"


def git_file(repo: Path, path: str) -> str:
    """The text of `path` at HEAD of the git directory `repo` (a `fetch`ed mirror)."""
    return subprocess.run(["git", "--git-dir", str(repo), "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def git_head(repo: Path) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def functions_from_source(source: str, names: tuple[str, ...],
                          namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute only the top-level `def`s named `names` of a module's source in `namespace`
    (for a module whose imports pull in a whole framework we do not need)."""
    tree = ast.parse(source)
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {d.name for d in defs}
    if missing:
        raise ValueError(f"functions not found: {sorted(missing)}")
    exec(compile(ast.Module(body=defs, type_ignores=[]), "<golden>", "exec"), namespace)
    return namespace


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def block_causal_allowed(length: int, block: int) -> torch.Tensor:
    """(L, L) float 1/0: tril(ones(nb, nb)) repeat-interleaved by the block size."""
    nb = -(-length // block)
    full = torch.tril(torch.ones(nb, nb)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return full[:length, :length]


def logit_columns(vocab: int, must: list[int], count: int, seed: int) -> torch.Tensor:
    """Sorted vocabulary columns: the `must` ones plus `count` drawn at random (fixed seed)."""
    drawn = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:count]
    return torch.unique(torch.cat([torch.tensor(must, dtype=torch.int64), drawn]))


def logits_record(input_ids: torch.Tensor, logits: torch.Tensor, must: list[int],
                  columns: int = 2048) -> dict[str, torch.Tensor]:
    """input_ids (L,), logits (L, V) fp32 -> the fixture's forward tensors."""
    vocab = logits.shape[-1]
    cols = (torch.arange(vocab) if vocab <= columns
            else logit_columns(vocab, must + logits.argmax(-1).tolist(), columns, seed=0))
    return {"input_ids": input_ids.to(torch.int64), "columns": cols,
            "logits": logits[:, cols].float().contiguous(),
            "argmax": logits.argmax(-1), "logsumexp": logits.float().logsumexp(-1)}


def save_fixture(name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"golden_{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"golden": json.dumps(meta, sort_keys=True)})
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return path


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}
