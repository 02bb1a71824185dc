"""Final-answer extraction and math answer checking (math-verify) for file-based tasks.

A completion's final answer is, in order of preference: the last ``\\boxed{...}``, the text
after the last ``####``, or the last number. The reference comes from the data files
(``rl_jax.data.files``). Comparison uses ``math_verify.parse``/``verify`` (symbolic and
numeric equality) after a cheap exact-string check.

math-verify's own time limits use ``signal.alarm`` and fail outside the main thread, and
they would also cancel an outer alarm; they are therefore switched off here. Run this
verifier through ``rl_jax.data.rewards.compute_rewards``, which bounds its time.
"""

from __future__ import annotations

import re

__all__ = ["after_hashes", "final_answer", "last_boxed", "last_number", "math_equal",
           "math_reward", "normalise_answer"]

# A number: optional sign, digits with optional thousands commas, optional decimals, or a
# simple fraction a/b.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

  Args:
    text: any string.

  Returns:
    The content, or None if there is no complete boxed expression.
  """
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    # "\boxed 5" form: the token after a space.
    m = re.match(r"\\boxed\s+(\S+)", text[start:])
    return m.group(1).rstrip("$.") if m else None
  depth = 0
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j].strip()
  return None


def after_hashes(text: str) -> str | None:
  """Text after the last ``####`` up to the end of that line, stripped; None if absent."""
  k = text.rfind("####")
  if k < 0:
    return None
  value = text[k + 4:].strip().split("\n", 1)[0].strip()
  return value or None


def last_number(text: str) -> str | None:
  """The last number in ``text`` (commas removed), or None."""
  found = _NUMBER.findall(text)
  return found[-1].replace(",", "") if found else None


def final_answer(completion: str) -> str | None:
  """The completion's final answer: last boxed, else after ``####``, else the last number.

  Args:
    completion: decoded model output.

  Returns:
    The answer string, or None if none is found.
  """
  for extract in (last_boxed, after_hashes, last_number):
    value = extract(completion)
    if value:
      return value
  return None


def _normalise(s: str) -> str:
  s = s.strip().strip("$").strip()
  s = s.replace(" ", "").replace("\\!", "").replace("\\,", "")
  if re.fullmatch(r"-?\d[\d,]*(\.\d+)?", s):
    s = s.replace(",", "")
  return s.rstrip(".")


def normalise_answer(answer: str) -> str:
  """``answer`` as the exact-string check compares it: spaces, ``$``, ``\\!``, ``\\,`` and a
  trailing ``.`` dropped, thousands commas removed from plain numbers."""
  return _normalise(answer)


def math_equal(reference: str, candidate: str) -> bool:
  """Whether two final answers are mathematically equal (math-verify, no internal timeout).

  Args:
    reference: gold answer string (LaTeX or plain).
    candidate: extracted answer string.

  Returns:
    True if they match as strings after normalisation or under math-verify.
  """
  if _normalise(reference) == _normalise(candidate):
    return True
  import math_verify  # lazy: sympy import takes ~0.5 s

  gold = math_verify.parse(f"${reference}$", parsing_timeout=None)
  pred = math_verify.parse(f"${candidate}$", parsing_timeout=None)
  if not gold or not pred:
    return False
  return bool(math_verify.verify(gold, pred, timeout_seconds=None))


def math_reward(completion: str, reference: str) -> float:
  """1.0 if the completion's final answer equals the reference, else 0.0.

  Args:
    completion: decoded model output (answer in ``\\boxed{}``, after ``####``, or last).
    reference: the reference answer extracted from the data file.

  Returns:
    1.0 or 0.0.
  References: math-verify (Hugging Face); GSM8K (Cobbe et al. 2021); MATH (Hendrycks et
    al. 2021).
  """
  candidate = final_answer(completion)
  if candidate is None:
    return 0.0
  return float(math_equal(reference, candidate))
