"""What every task shares: the ``Example`` record, the ``Task`` interface, split helpers.

This module imports nothing else from ``rl_jax.data``; the synthetic tasks
(``rl_jax.data.synthetic``), the file tasks (``rl_jax.data.files``) and the task registry
(``rl_jax.data.tasks``) all build on it, so the package's imports form a DAG.

A task is anything with ``split(which, size=None) -> Sequence[Example]`` and
``verify(completion, answer) -> float``. ``split`` may return a list (synthetic tasks) or a
lazily read random-access view (file tasks); callers index it, ``examples[i]``, and never
need the whole split in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, NamedTuple, Protocol, Sequence, runtime_checkable

__all__ = ["SPLITS", "EmptySplitError", "Example", "Task", "check_options", "check_split",
           "split_of"]

# The split names every task accepts.
SPLITS = ("train", "eval")


class Example(NamedTuple):
  """One prompt and its reference answer (for countdown: one valid solution)."""

  prompt: str
  answer: str


@runtime_checkable
class Task(Protocol):
  """What the trainer needs from a task."""

  def split(self, which: str, size: int | None = None) -> Sequence[Example]:
    """The examples of ``"train"`` or ``"eval"`` (at most ``size``), deterministic."""
    ...

  def verify(self, completion: str, answer: str) -> float:
    """Reward in [0, 1] of a completion against a reference answer; or named components
    ``{name: float}``, whose sum is the reward (``rl_jax.data.rewards``)."""
    ...


class EmptySplitError(ValueError):
  """A split of a task holds no example (e.g. no prompt of a small file hashes into
  ``eval``)."""


def split_of(prompt: str, eval_fraction: float) -> str:
  """Deterministic split of a prompt: ``"eval"`` for a stable ``eval_fraction`` of prompts.

  Args:
    prompt: the prompt string.
    eval_fraction: fraction of the prompt space held out, in [0, 1).

  Returns:
    ``"train"`` or ``"eval"``.
  """
  digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
  u = int.from_bytes(digest, "little") / 2.0**64
  return "eval" if u < eval_fraction else "train"


def check_split(which: str) -> str:
  """``which`` if it is a split name, else ValueError naming the valid ones."""
  if which not in SPLITS:
    raise ValueError(f"unknown split {which!r}; use 'train' or 'eval'")
  return which


def check_options(task: str, cls: type, options: Iterable[str],
                  exclude: Iterable[str] = ("seed",)) -> None:
  """ValueError unless every name in ``options`` is a field of the dataclass ``cls``.

  Args:
    task: task name for the message.
    cls: a dataclass.
    options: option names given by the caller.
    exclude: fields that may not be given as options.
  """
  fields = {f.name for f in dataclasses.fields(cls)} - set(exclude)
  unknown = set(options) - fields
  if unknown:
    raise ValueError(f"{task}: unknown options {sorted(unknown)}; valid: {sorted(fields)}")

