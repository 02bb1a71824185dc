"""Safe integer expressions: parsing without ``eval``, rendering, and the countdown reward.

Used by the synthetic arithmetic and countdown tasks (``rl_jax.data.synthetic``). Only
``+ - * /``, parentheses and non-negative integer literals are accepted; everything else
(names, calls, unary minus, floats, ``**``) is a ``ValueError``, never executed.
"""

from __future__ import annotations

import ast
import collections
import fractions
from typing import Any

__all__ = ["MAX_EXPRESSION_CHARS", "countdown_reward", "parse_expression",
           "render_expression"]

# Completions longer than this are rejected by the expression verifier before parsing.
MAX_EXPRESSION_CHARS = 256

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def parse_expression(text: str) -> tuple[fractions.Fraction, list[int]]:
  """Evaluate an integer expression with only ``+ - * /``, parentheses and literals; no eval.

  Args:
    text: e.g. ``"(3+5)*2"``.

  Returns:
    (exact value as a Fraction, the integer literals in order of appearance).

  Raises:
    ValueError: on anything else (names, calls, unary minus, floats, division by zero,
      over-long input).
  """
  if len(text) > MAX_EXPRESSION_CHARS:
    raise ValueError("expression too long")
  try:
    tree = ast.parse(text.strip(), mode="eval")
  except (SyntaxError, RecursionError, MemoryError) as e:
    raise ValueError(f"not an expression: {e}") from None
  literals: list[int] = []

  def walk(node: ast.AST) -> fractions.Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
      literals.append(node.value)
      return fractions.Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      a, b = walk(node.left), walk(node.right)
      op = _OPS[type(node.op)]
      if op == "+":
        return a + b
      if op == "-":
        return a - b
      if op == "*":
        return a * b
      if b == 0:
        raise ValueError("division by zero")
      return a / b
    raise ValueError(f"disallowed syntax: {type(node).__name__}")

  try:
    value = walk(tree.body)
  except RecursionError:
    raise ValueError("expression nested too deeply") from None
  return value, literals


def render_expression(node: Any) -> str:
  """Expression tree (``int | (op, left, right)``) to a string with minimal parentheses.

  Args:
    node: an int literal or a tuple ``(op, left, right)`` with op in ``+ - * /``.

  Returns:
    e.g. ``"(3+5)*2"`` for ``("*", ("+", 3, 5), 2)``.
  """
  if isinstance(node, int):
    return str(node)
  op, left, right = node

  def side(child, is_right):
    s = render_expression(child)
    if isinstance(child, int):
      return s
    cp = _PRECEDENCE[child[0]]
    if cp < _PRECEDENCE[op] or (is_right and cp == _PRECEDENCE[op] and op in "-/"):
      return f"({s})"
    return s

  return f"{side(left, False)}{op}{side(right, True)}"


def countdown_reward(completion: str, reference: str) -> float:
  """1.0 iff ``completion`` evaluates to the reference's value using its numbers at most once.

  Args:
    completion: the model's expression; text after a first ``=`` is ignored.
    reference: a solution that uses every allowed number exactly once.

  Returns:
    1.0 or 0.0. Never raises on bad completions.
  """
  target, allowed = parse_expression(reference)
  try:
    value, used = parse_expression(completion.split("=", 1)[0])
  except ValueError:
    return 0.0
  if collections.Counter(used) - collections.Counter(allowed):
    return 0.0
  return float(value == target)
