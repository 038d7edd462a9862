"""A small name -> object registry that fails loudly.

Algorithms, models and attention backends register here by name. Registering a name twice
raises, and looking up an unknown name raises with the list of known names: there is never a
silent default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (`kind` names that kind in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: register the object under `name` (default: its `__name__`)."""

        def deco(obj: T) -> T:
            self.add(name or obj.__name__, obj)  # type: ignore[attr-defined]
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise KeyError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "(none)"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
