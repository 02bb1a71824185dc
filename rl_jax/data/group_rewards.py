"""Group reward functions: rewards that are a function of a prompt's whole group.

A group function is called once per group (``reward.group_fn``) as

    fn(completions: list[str], example: Example) -> Sequence[float | Mapping[str, float]]

with the M decoded completions of one prompt (in sampling order) and that prompt's
``Example`` (``example.answer``, the reference, is there for functions that want it; a
label-free method ignores it), and returns M rewards, one per completion, each a number or
named components ``{name: number}`` (their sum is the row's reward, as for a verifier,
``rl_jax.data.rewards``). Its rewards replace the per-row verifier's for training; held-out
evaluation still scores with the task's verifier against the references.

Each call is isolated and time-limited like a verifier call (``data.reward_timeout_s`` per
group): one that raises or runs past the limit scores its group 0 and is counted
(``reward_exceptions`` / ``reward_timeouts``). One that returns the wrong number of values,
or a value that is not a finite number (or a mapping of them), is a bug in the function:
one ``RLJaxError`` line naming it and what it returned.

Built in (``GROUP_FNS``): ``majority_vote``, the label-free reward of test-time RL.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Sequence

from rl_jax import imports
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import verifiers
from rl_jax.errors import RLJaxError

__all__ = ["GROUP_FNS", "GroupFn", "answer_key", "check_group_values", "majority_vote",
           "resolve", "score_groups"]

GroupFn = Callable[[list, Any], Sequence[Any]]


def answer_key(completion: str) -> str | None:
  """The final answer of a completion, normalised for voting; None when it has none.

  In order: the last ``\\boxed{...}``, the text after the last ``####``, the whole completion
  when it is one word (no whitespace: the synthetic tasks', e.g. sorting's ``"0123"``), the
  last number. Normalised as the math verifier does (spaces, ``$``, a trailing ``.`` and
  thousands commas dropped), so ``"1,000"`` and ``"1000"`` are one answer; answers are
  compared as strings (``"0.5"`` and ``"1/2"`` are two).
  """
  text = completion.strip()
  for value in (verifiers.last_boxed(text), verifiers.after_hashes(text),
                text if text and not any(ch.isspace() for ch in text) else None,
                verifiers.last_number(text)):
    if value:
      key = verifiers.normalise_answer(value)
      if key:
        return key
  return None


def majority_vote(completions: Sequence[str], example: Any = None) -> list[float]:
  """Test-time RL's majority-vote reward: 1.0 for completions whose answer is the group's
  most frequent, 0.0 otherwise; no reference answer is read.

  Each completion's answer is ``answer_key``'s; completions without an answer get 0 and do
  not vote. Ties between equally frequent answers go to the answer that appears first among
  the completions (in sampling order), so the vote is deterministic. A group without any
  answer scores 0 everywhere.

  Args:
    completions: the M completions of one prompt.
    example: the prompt's ``Example`` (unused: the pseudo-label comes from the votes).

  Returns:
    M floats in {0.0, 1.0}.
  References: Zuo et al. 2025, "TTRL: Test-Time Reinforcement Learning" (majority voting as
    the pseudo-label, rule-based reward against it).
  """
  del example
  keys = [answer_key(c) for c in completions]
  votes = collections.Counter(k for k in keys if k is not None)
  if not votes:
    return [0.0] * len(keys)
  label = max(votes, key=lambda k: (votes[k], -keys.index(k)))
  return [float(k == label) for k in keys]


# reward.group_fn built-in names -> functions (rl_jax.settings.GROUP_FNS lists the names)
GROUP_FNS: dict[str, GroupFn] = {"majority_vote": majority_vote}


def resolve(name: str, key: str = "reward.group_fn") -> GroupFn:
  """The group function ``name`` names: a built-in (``GROUP_FNS``) or an import path
  ``module:fn`` (``rl_jax.imports``; mistakes are one ConfigError line naming ``key``)."""
  if name in GROUP_FNS:
    return GROUP_FNS[name]
  return imports.resolve(name, key)


def _short(x: Any, limit: int = 80) -> str:
  text = " ".join(repr(x).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def check_group_values(values: Any, M: int, who: str) -> list[float | dict[str, float]]:
  """A group function's return as M row values (a float or ``{name: float}`` each).

  Raises:
    RLJaxError: one line naming ``who`` and what it returned: not a sequence of M, or an
      entry that is not a finite number or a mapping of names to finite numbers.
  """
  if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
    raise RLJaxError(f"{who} returned {_short(values)} for a group of {M} completions; it "
                     f"must return a sequence of {M} rewards (numbers or {{name: number}})")
  values = list(values)
  if len(values) != M:
    raise RLJaxError(f"{who} returned {len(values)} rewards for a group of {M} completions "
                     f"({_short(values)}); it must return one per completion")
  out = [rewards_lib.reward_value(v, lenient=False) for v in values]
  bad = [i for i, v in enumerate(out) if v is None]
  if bad:
    raise RLJaxError(f"{who} returned {_short(values[bad[0]])} for completion {bad[0]} "
                     f"({_short(values)}); each reward must be a finite number or a mapping "
                     "{name: finite number}")
  return out


def score_groups(fn: GroupFn, completions: Sequence[str], examples: Sequence[Any], M: int,
                 who: str, timeout_s: float = 5.0, isolation: str = "auto"
                 ) -> tuple[list[float | dict[str, float] | None], dict[str, int]]:
  """The row values of ``len(examples)`` groups of M completions each ([G·M], group-major),
  ``fn`` called once per group, isolated and time-limited; a group whose call raises or
  times out is None on each row (reward 0), counted in ``{"exceptions", "timeouts"}`` (the
  first distinct failures' texts in ``"errors"``, ``rewards.failure``).

  Raises:
    RLJaxError: a call returned the wrong number of values or a bad value
      (``check_group_values``).
  """
  if len(completions) != len(examples) * M:
    raise ValueError(f"{len(completions)} completions for {len(examples)} groups of {M}")
  out: list[float | dict[str, float] | None] = []
  stats = {"exceptions": 0, "timeouts": 0}
  for g, example in enumerate(examples):
    group = list(completions[g * M:(g + 1) * M])
    try:
      values = rewards_lib.call_isolated(lambda: fn(group, example), timeout_s, isolation)
    except rewards_lib.VerifierTimeout:
      stats["timeouts"] += 1
      rewards_lib.failure(stats, f"a call took longer than data.reward_timeout_s="
                                 f"{timeout_s:g} s")
      out += [None] * M
      continue
    except RLJaxError:
      raise
    except Exception as e:  # noqa: BLE001 -- a failing call is reward 0, counted
      stats["exceptions"] += 1
      rewards_lib.failure(stats, f"{type(e).__name__}: {e}")
      out += [None] * M
      continue
    out += check_group_values(values, M, who)
  return out, stats
