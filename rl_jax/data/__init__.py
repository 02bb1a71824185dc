"""Data: synthetic tasks, local GSM8K/MATH files, tokenizers, rewards and prompt selection.

Modules, each importing only those before it (no import cycles):
  ``base``         ``Example``, the ``Task`` interface, the hash split ``split_of``.
  ``expressions``  safe integer expressions and the countdown reward.
  ``synthetic``    arithmetic, countdown and sorting tasks with difficulty presets.
  ``mixed``        ``sort_mix``: easy, learnable and impossible prompts (selection studies).
  ``verifiers``    final-answer extraction and math-verify checking.
  ``records``      GSM8K/MATH records streamed from JSONL or Parquet.
  ``files``        file tasks: TFDS array_record data sources read lazily (``FileTask``).
  ``tasks``        the task registry: ``get_task(name, ...)``, ``register_task``.
  ``tokenizers``   char and HF tokenizers.
  ``rewards``      isolated time-limited rewards, named components, DAPO overlong shaping.
  ``group_rewards`` group reward functions (``reward.group_fn``): majority vote (TTRL).
  ``selection``    uniform sampler, GRESO, Beta posterior, DAPO dynamic sampling.

Axis letters: the package legend (``rl_jax/__init__.py``).
"""

from rl_jax.data import (base, expressions, files, group_rewards, mixed, records, rewards,
                         selection, synthetic, tasks, tokenizers, verifiers)
from rl_jax.data.base import Example, Task
from rl_jax.data.rewards import compute_rewards, overlong_penalty
from rl_jax.data.tasks import get_task, register_task
from rl_jax.data.tokenizers import load_tokenizer

__all__ = [
    "Example", "Task", "base", "compute_rewards", "expressions", "files", "get_task",
    "group_rewards",
    "load_tokenizer", "mixed", "overlong_penalty", "records", "register_task", "rewards", "selection",
    "synthetic", "tasks", "tokenizers", "verifiers",
]
