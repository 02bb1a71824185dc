"""Reading GSM8K/MATH question-answer records from JSONL or Parquet files, one at a time.

Formats (one record per JSONL line or Parquet row):
  gsm8k  ``question``, ``answer`` — the final answer follows ``####`` in ``answer``.
  math   ``problem``, ``solution`` — the final answer is the last ``\\boxed{...}`` of
         ``solution`` (or the record's ``answer`` field when present).
  auto   decided from the first record's keys.

Every parsed record is ``{"question", "reference", "solution"}`` (all str). ``iter_qa``
streams them; ``rl_jax.data.files`` stores them for random access through TFDS.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from rl_jax import storage
from rl_jax.data import verifiers

__all__ = ["FIELDS", "FORMATS", "detect_format", "gsm8k_reference", "iter_qa",
           "iter_records", "read_qa", "to_qa"]

FORMATS = ("gsm8k", "math", "auto")
# The keys of a parsed record.
FIELDS = ("question", "reference", "solution")


def iter_records(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
  """Yield (line or row number starting at 1, record dict) from a JSONL or Parquet file.

  Args:
    path: ``*.jsonl``/``*.json`` (one JSON object per line) or ``*.parquet``.

  Yields:
    (number, record). Blank JSONL lines are skipped.

  Raises:
    FileNotFoundError: missing file.
    ValueError: unsupported extension, or a line that is not a JSON object (names the line).
  """
  if not storage.is_file(path):
    raise FileNotFoundError(f"data file not found: {path}")
  ext = os.path.splitext(path)[1].lower()
  if ext == ".parquet":
    import pyarrow.parquet as pq

    with storage.open_file(path, "rb") as f:
      table = pq.read_table(f)
    for i, row in enumerate(table.to_pylist(), start=1):
      yield i, row
  elif ext in (".jsonl", ".json"):
    with storage.open_file(path, "rb") as f:
      for i, raw in enumerate(f, start=1):
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise ValueError(f"{path}: line {i} is not UTF-8 text ({e.reason} at byte "
                           f"{e.start}); a data file is UTF-8 JSONL (not compressed) or "
                           "Parquet") from None
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
          raise ValueError(f"{path}: line {i} is not a JSON object")
        yield i, record
  else:
    raise ValueError(f"{path}: unsupported file type {ext!r}; use .jsonl or .parquet")


def detect_format(record: dict[str, Any]) -> str:
  """``"gsm8k"`` for question/answer records, ``"math"`` for problem/solution records."""
  if "question" in record and "answer" in record:
    return "gsm8k"
  if "problem" in record and ("solution" in record or "answer" in record):
    return "math"
  raise ValueError(f"cannot detect the format from keys {sorted(record)}; expected "
                   "question/answer (gsm8k) or problem/solution (math)")


def gsm8k_reference(answer: str) -> str | None:
  """Final answer after ``####`` with thousands commas removed, or None."""
  value = verifiers.after_hashes(answer)
  if value is None:
    return None
  return value.replace(",", "") if value.replace(",", "").lstrip("-").isdigit() else value


def _number_text(value: Any) -> str | None:
  """A JSON number (not a bool) as the text of a final answer ("7", "3.5"); None otherwise."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return str(value)


# what a record of each format needs (the error for a record without it)
NEEDS = {"gsm8k": "a 'question' string and an 'answer' that ends in '#### <final answer>' "
                  "(or is a number)",
         "math": "a 'problem' string and a final answer: an 'answer' string or number, or a "
                 "\\boxed{} in 'solution'"}


def to_qa(record: dict[str, Any], fmt: str) -> dict[str, str] | None:
  """Map a raw record to ``{question, reference, solution}``; None if no final answer. A
  final answer given as a JSON number is its text.

  Args:
    record: one raw record.
    fmt: ``"gsm8k"`` or ``"math"``.

  Returns:
    The parsed record, or None when the reference answer cannot be extracted.
  """
  if fmt == "gsm8k":
    question, solution = record.get("question"), record.get("answer")
    reference = (gsm8k_reference(solution) if isinstance(solution, str) else
                 _number_text(solution))
  else:
    question, solution = record.get("problem"), record.get("solution") or ""
    given = record.get("answer")
    given = _number_text(given) or given
    reference = given if isinstance(given, str) and given.strip() else (
        verifiers.last_boxed(solution) if isinstance(solution, str) else None)
  if not isinstance(question, str) or not reference:
    return None
  return {"question": question, "reference": str(reference).strip(),
          "solution": solution if isinstance(solution, str) else ""}


def iter_qa(path: str, fmt: str = "auto") -> Iterator[dict[str, str]]:
  """Stream a file as ``{question, reference, solution}`` dicts (file order), one at a time.

  Args:
    path: JSONL or Parquet file.
    fmt: ``"gsm8k"``, ``"math"`` or ``"auto"``.

  Yields:
    The parsed records.

  Raises:
    FileNotFoundError / ValueError: missing file, unknown format, malformed line, a record
      without a question or final answer (names the line), or an empty file.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
  empty = True
  for i, record in iter_records(path):
    if fmt == "auto":
      try:
        fmt = detect_format(record)
      except ValueError as e:
        raise ValueError(f"{path}: line {i}: {e}") from None
    qa = to_qa(record, fmt)
    if qa is None:
      raise ValueError(f"{path}: line {i} has no {fmt} question and final answer "
                       f"(keys {sorted(record)}; {fmt} needs {NEEDS[fmt]})")
    empty = False
    yield qa
  if empty:
    raise ValueError(f"{path}: no records")


def read_qa(path: str, fmt: str = "auto") -> list[dict[str, str]]:
  """All of ``iter_qa(path, fmt)`` as a list (the ``memory`` backend; small files)."""
  return list(iter_qa(path, fmt))
