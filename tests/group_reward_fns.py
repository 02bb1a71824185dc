"""Group reward functions and a task with named reward components, for
``tests/test_group_rewards.py`` (a group function is named by import path:
``reward.group_fn=tests.group_reward_fns:first_char_parity``).
"""

from rl_jax.data import tasks

# every group's rewards as first_char_parity returned them, in call order
CALLS: list[list[float]] = []


def first_char_parity(completions, example):
  """1.0 for completions whose first character has an odd code (about half of an untrained
  policy's), 0.5 bonus when the group holds a completion equal to the reference; records
  its rewards in ``CALLS``."""
  bonus = 0.5 if any(c.strip() == example.answer for c in completions) else 0.0
  out = [float(ord(c[0]) % 2) + bonus if c else bonus for c in completions]
  CALLS.append(out)
  return out


def one_short(completions, example):
  """A broken group function: one reward too few."""
  del example
  return [0.0] * (len(completions) - 1)


def parts(completions, example):
  """Per-row named components: ``exact`` (the reference) and ``odd`` (first character)."""
  return [{"exact": float(c.strip() == example.answer),
           "odd": float(bool(c) and ord(c[0]) % 2)} for c in completions]


class PartsSorting:
  """The sorting task whose verifier returns named components: ``odd`` (first character has
  an odd code) and ``length`` (as long as the answer); ``mismatch=True`` names them
  differently on rows that start with an even character."""

  def __init__(self, mismatch=False, difficulty=0, seed=0):
    self._task = tasks.get_task("sorting", difficulty=difficulty, seed=seed)
    self._mismatch = mismatch

  def split(self, which, size=None):
    return self._task.split(which, size)

  def verify(self, completion, answer):
    odd = float(bool(completion) and ord(completion[0]) % 2)
    out = {"odd": odd, "length": float(len(completion.strip()) == len(answer))}
    if self._mismatch and completion and not odd and completion != answer:
      out["extra"] = 1.0
    return out


tasks.register_task("sorting_parts", lambda difficulty=0, seed=0, **kw: PartsSorting(
    difficulty=difficulty, seed=seed, **kw), replace=True)
tasks.register_task("sorting_parts_mismatch", lambda difficulty=0, seed=0, **kw: PartsSorting(
    mismatch=True, difficulty=difficulty, seed=seed, **kw), replace=True)

