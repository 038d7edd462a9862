"""How a model's parameters map onto checkpoint tensor names: data declared by each model file.

A parameter whose name is not covered by a `PackedWeight` rule loads from the HF tensor of the
same name. A packed parameter is filled from several HF tensors, each into its own slice:
- without "{e}" in the sources, the sources are stacked along dim 0 in the order listed
  (e.g. `gate_up_proj.weight` (2I, hidden) <- gate_proj.weight (I, hidden), up_proj.weight),
  in equal parts unless `sizes` gives each source's rows (e.g. q/k/v projections of GQA);
  a rule with one source renames (e.g. LLaDA2's `attention.dense` -> `self_attn.o_proj`);
- with "{e}", dim 0 is the expert index e in [0, E) and the sources stack along dim 1
  (e.g. `experts.w13` (E, 2I, hidden) <- experts.{e}.gate_proj.weight, experts.{e}.up_proj.weight).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackedWeight:
    param: str  # suffix of the model parameter name, after a module boundary
    sources: tuple[str, ...]  # suffixes of the HF tensor names, in packing order
    sizes: tuple[int, ...] = ()  # rows of each source along the packed dim; (): equal parts

    def __post_init__(self) -> None:
        if self.sizes and len(self.sizes) != len(self.sources):
            raise ValueError(f"{self.param}: {len(self.sizes)} sizes for "
                             f"{len(self.sources)} sources")

    def matches(self, name: str) -> bool:
        return name == self.param or name.endswith("." + self.param)

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.sources[0]


@dataclass(frozen=True)
class WeightMap:
    packed: tuple[PackedWeight, ...] = ()
    # (alias, source): the alias names the same parameter as source (tied weights); the
    # checkpoint may omit the alias, and if it has it, it must equal the source.
    tied: tuple[tuple[str, str], ...] = ()
    # Checkpoint tensors whose name contains one of these are skipped (non-persistent buffers).
    ignored: tuple[str, ...] = ()
    # Parameters whose name ends with one of these stay fp32 whatever the model dtype.
    fp32: tuple[str, ...] = ()

    def rule_for(self, name: str) -> PackedWeight | None:
        return next((rule for rule in self.packed if rule.matches(name)), None)

    def is_fp32(self, name: str) -> bool:
        return any(name.endswith(suffix) for suffix in self.fp32)

    def is_ignored(self, name: str) -> bool:
        return any(part in name for part in self.ignored)
