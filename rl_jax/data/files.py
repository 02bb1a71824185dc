"""Question/answer files (GSM8K and MATH formats) as tasks, read through tensorflow-datasets.

Formats (one record per JSONL line or Parquet row):
  gsm8k  ``question``, ``answer`` — the final answer follows ``####`` in ``answer``.
  math   ``problem``, ``solution`` — the final answer is the last ``\\boxed{...}`` of
         ``solution`` (or the record's ``answer`` field when present).
  auto   decided from the first record's keys.

TFDS without TensorFlow: a ``tfds.core.GeneratorBasedBuilder`` writes the parsed records
once to ``array_record`` files under ``data_dir`` (one builder config per file content
hash, so an edited file is rebuilt) and ``as_data_source()`` gives random access; neither
step imports TensorFlow. ``backend="memory"`` skips TFDS and keeps the records in a list
(same interface).

Usage (config: ``data.path=/path/train.jsonl``, ``data.format="gsm8k"``)::

    task = FileTask(path="/path/train.jsonl", format="auto", eval_path="/path/test.jsonl")
    train = task.split("train")              # Sequence[Example(prompt, answer)]
    reward = task.verify(completion, train[0].answer)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np

from rl_jax.data import tasks as tasks_lib
from rl_jax.data import verifiers

FORMATS = ("gsm8k", "math", "auto")
_FIELDS = ("question", "reference", "solution")
_DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rl_jax", "tfds")


# ------------------------------------------------------------------ reading raw records
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
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file not found: {path}")
  ext = os.path.splitext(path)[1].lower()
  if ext == ".parquet":
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
      yield i, row
  elif ext in (".jsonl", ".json"):
    with open(path, encoding="utf-8") as f:
      for i, line in enumerate(f, start=1):
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


def to_qa(record: dict[str, Any], fmt: str) -> dict[str, str] | None:
  """Map a raw record to ``{question, reference, solution}``; None if no final answer.

  Args:
    record: one raw record.
    fmt: ``"gsm8k"`` or ``"math"``.

  Returns:
    The parsed record, or None when the reference answer cannot be extracted.
  """
  if fmt == "gsm8k":
    question, solution = record.get("question"), record.get("answer")
    reference = gsm8k_reference(solution) if isinstance(solution, str) else None
  else:
    question, solution = record.get("problem"), record.get("solution") or ""
    given = record.get("answer")
    reference = given if isinstance(given, str) and given.strip() else (
        verifiers.last_boxed(solution) if isinstance(solution, str) else None)
  if not isinstance(question, str) or not reference:
    return None
  return {"question": question, "reference": str(reference).strip(),
          "solution": solution if isinstance(solution, str) else ""}


def read_qa(path: str, fmt: str = "auto") -> list[dict[str, str]]:
  """Parse a whole file into ``{question, reference, solution}`` dicts (file order).

  Args:
    path: JSONL or Parquet file.
    fmt: ``"gsm8k"``, ``"math"`` or ``"auto"``.

  Returns:
    The parsed records.

  Raises:
    FileNotFoundError / ValueError: missing file, unknown format, malformed line, a record
      without a question or final answer (names the line), or an empty file.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
  out = []
  for i, record in iter_records(path):
    if fmt == "auto":
      fmt = detect_format(record)
    qa = to_qa(record, fmt)
    if qa is None:
      raise ValueError(f"{path}: line {i} has no {fmt} question and final answer "
                       f"(keys {sorted(record)})")
    out.append(qa)
  if not out:
    raise ValueError(f"{path}: no records")
  return out


# ------------------------------------------------------------------ TFDS data source
def file_digest(path: str, fmt: str) -> str:
  """Short content hash of (file bytes, format): the TFDS builder config name."""
  h = hashlib.sha256(fmt.encode())
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return "h" + h.hexdigest()[:20]


@functools.cache
def _builder_class():
  """The TFDS builder class (defined lazily so importing rl_jax does not import TFDS)."""
  import tensorflow_datasets as tfds

  class RlJaxQa(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Parsed question/reference/solution records of one local file."""

    VERSION = tfds.core.Version("1.0.0")
    # No checksums file beside this class; also avoids TFDS probing the package with
    # importlib_resources, which is not a dependency here.
    code_path = None

    def __init__(self, *, path: str, fmt: str, **kwargs):
      self._path, self._fmt = path, fmt
      super().__init__(config=tfds.core.BuilderConfig(name=file_digest(path, fmt)), **kwargs)

    def _info(self):
      features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in _FIELDS})
      return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)

    def _split_generators(self, dl_manager):
      del dl_manager
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      for i, qa in enumerate(read_qa(self._path, self._fmt)):
        yield i, qa

  return RlJaxQa


def tfds_source(path: str, fmt: str = "auto", data_dir: str | None = None):
  """Prepare (once) and open a file as a TFDS ``ArrayRecordDataSource``.

  Args:
    path: JSONL or Parquet file.
    fmt: ``"gsm8k"``, ``"math"`` or ``"auto"``.
    data_dir: where TFDS writes the array_record files (default ``~/.cache/rl_jax/tfds``).

  Returns:
    A random-access source; ``source[i]`` is a dict of bytes for ``question``,
    ``reference``, ``solution``.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file not found: {path}")
  import tensorflow_datasets as tfds

  tfds.disable_progress_bar()
  builder = _builder_class()(path=os.path.abspath(path), fmt=fmt,
                             data_dir=data_dir or _DEFAULT_DATA_DIR, file_format="array_record")
  builder.download_and_prepare()
  return builder.as_data_source(split="train")


class QASource(Sequence):
  """Random access to parsed records, from TFDS or from memory; items are str dicts."""

  def __init__(self, path: str, fmt: str = "auto", backend: str = "tfds",
               data_dir: str | None = None):
    if backend == "tfds":
      self._src = tfds_source(path, fmt, data_dir)
    elif backend == "memory":
      self._src = read_qa(path, fmt)
    else:
      raise ValueError(f"unknown data backend {backend!r}; use 'tfds' or 'memory'")
    if len(self._src) == 0:
      raise ValueError(f"{path}: no records")

  def __len__(self) -> int:
    return len(self._src)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    i = int(i)
    if not -len(self) <= i < len(self):
      raise IndexError(f"index {i} out of range for {len(self)} records")
    item = self._src[i % len(self)]
    return {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in item.items()}


class _ExampleView(Sequence):
  """Examples at ``indices`` of a source, formatted lazily."""

  def __init__(self, source: QASource, indices: np.ndarray, template: str):
    self._source, self._indices, self._template = source, indices, template

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    qa = self._source[int(self._indices[i])]
    prompt = self._template.replace("{question}", qa["question"])  # other braces stay literal
    return tasks_lib.Example(prompt, qa["reference"])


@dataclasses.dataclass(frozen=True)
class FileTask:
  """A task over local GSM8K/MATH-format files, verified with math-verify.

  Attributes:
    path: training file (JSONL or Parquet).
    format: ``"gsm8k"``, ``"math"`` or ``"auto"``.
    eval_path: optional held-out file; without it a stable ``eval_fraction`` of the
      training questions (by prompt hash) is held out instead.
    eval_fraction: used only without ``eval_path``.
    template: prompt template with ``{question}``.
    backend: ``"tfds"`` (array_record data source) or ``"memory"``.
    data_dir: TFDS data directory.
    seed: unused (file order is kept); present for ``get_task`` symmetry.
  """

  path: str = ""
  format: str = "auto"
  eval_path: str | None = None
  eval_fraction: float = 0.05
  template: str = "{question}"
  backend: str = "tfds"
  data_dir: str | None = None
  seed: int = 0

  name = "file"

  def __post_init__(self):
    if not self.path:
      raise ValueError("file task needs data.path (a .jsonl or .parquet file)")
    if self.format not in FORMATS:
      raise ValueError(f"unknown data format {self.format!r}; choose from {FORMATS}")
    if "{question}" not in self.template:
      raise ValueError(f"prompt template {self.template!r} has no {{question}} field")

  def _source(self, path: str) -> QASource:
    return QASource(path, self.format, self.backend, self.data_dir)

  def split(self, which: str, size: int | None = None) -> Sequence[tasks_lib.Example]:
    """Examples of ``"train"`` or ``"eval"`` in file order (``size`` truncates).

    Raises:
      ValueError: unknown split name or an empty split.
    """
    if which not in ("train", "eval"):
      raise ValueError(f"unknown split {which!r}; use 'train' or 'eval'")
    if self.eval_path is not None:
      source = self._source(self.path if which == "train" else self.eval_path)
      indices = np.arange(len(source))
    else:
      source = self._source(self.path)
      keep = [tasks_lib.split_of(source[i]["question"], self.eval_fraction) == which
              for i in range(len(source))]
      indices = np.flatnonzero(keep)
    indices = indices[:size]
    if len(indices) == 0:
      raise ValueError(f"file task: split {which!r} of {self.path} is empty")
    return _ExampleView(source, indices, self.template)

  def verify(self, completion: str, answer: str) -> float:
    """math-verify equality of the completion's final answer and ``answer`` (1.0 / 0.0)."""
    return verifiers.math_reward(completion, answer)
