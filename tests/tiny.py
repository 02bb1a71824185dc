"""The quickstart config and a tiny model for trainer tests (one layer, width 32)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
TINY_MODEL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
]


class ParityTask:
  """A task wrapper whose reward an untrained policy earns about half the time (the parity of
  the first generated character), so every group has reward variance and every objective
  makes a non-zero update."""

  def __init__(self, task):
    self._task = task

  def split(self, which, size=None):
    return self._task.split(which, size)

  def verify(self, completion, answer):
    del answer
    return float(ord(completion[0]) % 2) if completion else 0.0
