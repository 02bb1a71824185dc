"""A synthetic task with easy, learnable and impossible prompts, for prompt-selection studies.

``"copy 31:"`` -> ``"31"`` (easy: solved after a short supervised warm start),
``"sort 31:"`` -> ``"13"`` (learnable by RL), ``"hash 31:"`` -> a fixed pseudo-random string
of the same length (impossible: nothing in the prompt predicts it, so its group rewards are
almost always all zero). One third of the prompts is each kind; held-out prompts never
appear in training.

Difficulty: 0 two digits (300 prompts), 1 three digits (3000 prompts), 2 eight digits
from a fixed pool of 100 strings (300 prompts, longer responses).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Iterator

import numpy as np

from rl_jax.data.base import Example
from rl_jax.data.synthetic import SyntheticTask, by_difficulty, option

__all__ = ["KINDS", "MixedSorting"]

KINDS = ("copy", "sort", "hash")  # easy, learnable, impossible


def _hashed(s: str) -> str:
  """A fixed pseudo-random digit string of ``len(s)`` from ``s``."""
  h = hashlib.sha256(s.encode()).digest()
  return "".join(str(b % 10) for b in h[:len(s)])


@dataclasses.dataclass(frozen=True)
class MixedSorting(SyntheticTask):
  """Copy / sort / hash a string of ``length`` digits (see the module docstring)."""

  length: int = option(2, minimum=1)
  pool: int = option(0, minimum=0)  # > 0: only this many seeded digit strings

  name = "sort_mix"
  presets = by_difficulty(length=(2, 3, 8), pool=(0, 0, 100))

  def _strings(self) -> list[str]:
    if not self.pool:
      return ["".join(c) for c in itertools.product("0123456789", repeat=self.length)]
    rng = np.random.default_rng([self.seed, 7])
    return sorted({"".join(str(int(d)) for d in rng.integers(0, 10, self.length))
                   for _ in range(self.pool)})

  def _space_size(self) -> int:
    return len(KINDS) * (self.pool or 10**self.length)

  def _make(self, kind: str, s: str) -> Example:
    answer = {"copy": s, "sort": "".join(sorted(s)), "hash": _hashed(s)}[kind]
    return Example(f"{kind} {s}:", answer)

  def _enumerate(self) -> Iterator[Example]:
    strings = self._strings()
    for kind in KINDS:
      for s in strings:
        yield self._make(kind, s)

  def _sample(self, rng: np.random.Generator) -> Example:
    kind = KINDS[int(rng.integers(0, len(KINDS)))]
    return self._make(kind, "".join(str(int(d)) for d in rng.integers(0, 10, self.length)))
