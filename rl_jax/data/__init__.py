"""Data: synthetic tasks, local GSM8K/MATH files, tokenizers, rewards and prompt selection.

Modules: ``tasks`` (synthetic tasks and ``get_task``), ``files`` (JSONL/Parquet via TFDS),
``tokenizers`` (char and HF), ``verifiers`` (final-answer extraction, math-verify),
``rewards`` (isolated time-limited rewards, DAPO overlong shaping), ``selection``
(uniform sampler, GRESO, Beta posterior, DAPO dynamic sampling).
"""

from rl_jax.data import files, rewards, selection, tasks, tokenizers, verifiers
from rl_jax.data.rewards import compute_rewards, overlong_penalty
from rl_jax.data.tasks import Example, get_task
from rl_jax.data.tokenizers import load_tokenizer

__all__ = [
    "Example", "compute_rewards", "files", "get_task", "load_tokenizer", "overlong_penalty",
    "rewards", "selection", "tasks", "tokenizers", "verifiers",
]
