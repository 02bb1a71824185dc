"""Responses packed into fewer rows: the host's plan of which response goes where.

The packed prompt-once layout (``grouped.py``) gives every response of a group its own R
positions, R the step's trained length (``train.trim_floor``). When responses end at
different lengths, most of those positions are padding that the learner still runs through
every layer. Here a group's M responses are packed, whole and in order of decreasing length
(first-fit decreasing), into M' rows of R positions each, several short ones sharing a row:

    [prompt_g (P)][row_1: resp_a | resp_b | pad][row_2: resp_c | pad]...

A response keeps its positions len_g + j and attends to the group's prompt and to its own
earlier tokens only (a segment mask inside the row), so its log-probs are those of the
layout it came from, to float rounding (``tests/test_packing.py``). The plan is two index
arrays computed on the host from the lengths, so the programs see only static shapes:

* ``src`` int32 [G,M',R]: for each packed position the response position it holds, as the
  flat index i·R + j into the group's [M,R] responses, or -1 for padding;
* ``dst`` int32 [G,M,R]: for each response position j < len_i of response i its flat packed
  index r·R + c; 0 past the response's end (those positions are masked everywhere).

M' is the most rows any group needs, rounded up to a multiple of ``ceil(M / 8)`` so that a run
compiles few shapes: as the trainer packs only when that saves a quarter of the rows, at most
6 row counts per response length beside one response per row (each compiles the passes once).
Multiples of M/4 would compile fewer but cost more: at 16 x 256 the update took 1.55 s with
them against 1.22 s (``docs/BENCHMARKS.md``).

References: sequence packing without cross-contamination (Krell et al., 2021): several
sequences per row, attention kept within each.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["Packing", "first_fit_rows", "plan", "row_count"]


class Packing(NamedTuple):
  """Where each response of a group sits in the packed rows (module docstring).

  src int32 [G,M',R]: flat response position i·R + j held at each packed position (-1: pad);
  dst int32 [G,M,R]: flat packed position r·R + c of each response position (0 past its end).
  """

  src: np.ndarray
  dst: np.ndarray


def first_fit_rows(lengths: np.ndarray, R: int) -> list[list[int]]:
  """First-fit decreasing: the responses of one group (``lengths`` int [M], each in [0, R])
  as rows of response indices, each row's lengths summing to at most R. Ties are taken in
  index order, so the plan is a function of the lengths alone."""
  order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
  rows: list[list[int]] = []
  room: list[int] = []
  for i in order:
    n = int(lengths[i])
    for r, free in enumerate(room):
      if n <= free:
        rows[r].append(i)
        room[r] -= n
        break
    else:
      rows.append([i])
      room.append(R - n)
  return rows


def row_count(lengths: np.ndarray, R: int) -> int:
  """M': the rows the packed layout of ``lengths`` int [G,M] needs, rounded up to a multiple
  of ceil(M / 8) (at most M)."""
  G, M = lengths.shape
  need = max((len(first_fit_rows(lengths[g], R)) for g in range(G)), default=1)
  step = math.ceil(M / 8)
  return min(M, step * math.ceil(need / step))


def plan(lengths: np.ndarray, R: int, rows: int) -> Packing:
  """The ``Packing`` of ``lengths`` int [G,M] (each in [0, R]; tokens up to each response's
  end) into ``rows`` rows of R positions per group (at least ``row_count``)."""
  G, M = lengths.shape
  src = np.full((G, rows, R), -1, np.int32)
  dst = np.zeros((G, M, R), np.int32)
  for g in range(G):
    packed = first_fit_rows(lengths[g], R)
    if len(packed) > rows:
      raise ValueError(f"group {g} needs {len(packed)} rows of {R}, more than {rows}")
    for r, members in enumerate(packed):
      col = 0
      for i in members:
        n = int(lengths[g, i])
        src[g, r, col:col + n] = i * R + np.arange(n)
        dst[g, i, :n] = r * R + col + np.arange(n)
        col += n
  return Packing(src, dst)
