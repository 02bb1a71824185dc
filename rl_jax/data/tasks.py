"""Tasks by name: a registry over the synthetic tasks and local question/answer files.

Built in: ``"arithmetic"``, ``"countdown"``, ``"sorting"`` (``rl_jax.data.synthetic``) and
``"file"`` (GSM8K/MATH JSONL or Parquet through TFDS, ``rl_jax.data.files``). A project can
add its own with ``register_task(name, factory)``; anything with ``split`` and ``verify``
(``rl_jax.data.base.Task``) will do.

Usage::

    task = get_task("arithmetic", difficulty=0, seed=0)
    train, held_out = task.split("train"), task.split("eval")
    reward = task.verify(completion, train[0].answer)

    task = get_task("file", path="/data/gsm8k_train.jsonl", format="gsm8k")

The names defined in ``base``, ``expressions`` and ``synthetic`` (``Example``,
``split_of``, ``parse_expression``, ``countdown_reward``, ``Arithmetic``, ...) are also
importable from here.
"""

from __future__ import annotations

from typing import Any, Callable

from rl_jax.data import files
from rl_jax.data.base import Example, Task, split_of
from rl_jax.data.expressions import countdown_reward, parse_expression
from rl_jax.data.mixed import MixedSorting
from rl_jax.data.synthetic import TASKS, Arithmetic, Countdown, Sorting, SyntheticTask

__all__ = [
    "TASKS", "Arithmetic", "Countdown", "Example", "Sorting", "SyntheticTask", "Task",
    "TaskFactory", "countdown_reward", "get_task", "parse_expression", "register_task",
    "split_of", "task_names",
]

# ``factory(difficulty=..., seed=..., **options) -> Task``.
TaskFactory = Callable[..., Task]

_REGISTRY: dict[str, TaskFactory] = {}


def register_task(name: str, factory: TaskFactory, *, replace: bool = False) -> None:
  """Make ``get_task(name, ...)`` call ``factory(difficulty=, seed=, **options)``.

  Args:
    name: the task name (``data.task``).
    factory: builds the task; raises ValueError on bad options.
    replace: allow replacing an existing name.

  Raises:
    ValueError: the name is taken and ``replace`` is False.
  """
  if name in _REGISTRY and not replace:
    raise ValueError(f"task {name!r} is already registered")
  _REGISTRY[name] = factory


def task_names() -> list[str]:
  """The registered task names, sorted."""
  return sorted(_REGISTRY)


def get_task(name: str, difficulty: int = 0, seed: int = 0, **options: Any) -> Task:
  """Build a task by name.

  Args:
    name: a registered name: ``"arithmetic"``, ``"countdown"``, ``"sorting"``, or
      ``"file"`` (then pass ``path=...`` and optionally ``format=``, ``eval_path=``,
      ``template=``, ``backend=``, ``data_dir=`` — see ``rl_jax.data.files.FileTask``).
    difficulty: preset index for synthetic tasks (0 is easiest); ignored by ``"file"``.
    seed: orders / draws the examples of each split.
    **options: task fields overriding the preset (e.g. ``digits=3``, ``eval_fraction``).

  Returns:
    A task with ``split(which, size=None) -> Sequence[Example]`` and
    ``verify(completion, answer) -> float``.

  Raises:
    ValueError: unknown task name, difficulty out of range, or unknown option.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown task {name!r}; choose from {task_names()}")
  return _REGISTRY[name](difficulty=difficulty, seed=seed, **options)


def _file_task(difficulty: int = 0, seed: int = 0, **options: Any) -> files.FileTask:
  del difficulty  # a file has one difficulty
  return files.FileTask.from_options(seed=seed, **options)


for _name, _cls in TASKS.items():
  register_task(_name, _cls.from_preset)
register_task("file", _file_task)
register_task(MixedSorting.name, MixedSorting.from_preset)
del _name, _cls
