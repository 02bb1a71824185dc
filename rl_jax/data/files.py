"""Question/answer files (GSM8K and MATH formats) as tasks, read through tensorflow-datasets.

File formats (``gsm8k``, ``math``, ``auto``) and record parsing are in
``rl_jax.data.records``; its functions (``read_qa``, ``iter_qa``, ...) are re-exported here.

Pointing the trainer at a file: set ``data.task="file"`` and ``data.path`` (and optionally
``data.format``, ``data.template`` with a ``{question}`` field, ``data.eval_path``)::

    python -m rl_jax.train --config=configs/gsm8k_hf.py --workdir=/tmp/run \\
        --config.data.path=/data/gsm8k_train.jsonl --config.data.eval_path=/data/test.jsonl

Without ``eval_path`` a stable ``eval_fraction`` (5%) of the questions, chosen by a hash of
the question text, is held out as the ``"eval"`` split.

TFDS without TensorFlow: the first use of a file runs a ``tfds.core.GeneratorBasedBuilder``
(``rl_jax_qa``) that parses the file once and writes its ``train`` (and, for a hash split,
``eval``) records as ``array_record`` files; ``as_data_source()`` then gives random access.
Neither step imports TensorFlow. The TFDS cache lives under ``data_dir``: by default (and
always for the trainer) ``~/.cache/rl_jax/tfds`` (``DEFAULT_DATA_DIR``); in code, pass
``FileTask(data_dir=...)`` or ``get_task("file", data_dir=...)``::

    <data_dir>/rl_jax_qa/h<hash>/1.1.0/rl_jax_qa-train.array_record-00000-of-00001
                                      rl_jax_qa-eval.array_record-00000-of-00001
                                      dataset_info.json, features.json

where the builder config ``h<hash>`` hashes the file's bytes, the format and the held-out
fraction, so an edited file is prepared again and never read stale; later runs reuse the
directory (delete it to reclaim the space).

``FileTask.split`` returns a lazy ``ExampleView`` (a ``Sequence``): ``len()`` is known
up front and ``view[i]`` reads and formats one record on demand, so the trainer can index
it with the sampler's indices without loading the file. ``backend="memory"`` skips TFDS and
keeps the parsed records in a list (same interface; for small files and tests).

Usage::

    task = FileTask(path="/path/train.jsonl", format="auto", eval_path="/path/test.jsonl")
    train = task.split("train")              # Sequence[Example(prompt, answer)], lazy
    reward = task.verify(completion, train[0].answer)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import re
from typing import Any, Iterable, Sequence

from rl_jax import storage
from rl_jax.data import verifiers
from rl_jax.data.base import (SPLITS, EmptySplitError, Example, check_options, check_split,
                              split_of)
from rl_jax.data.records import (FIELDS, FORMATS, detect_format, gsm8k_reference, iter_qa,
                                 iter_records, read_qa, to_qa)

__all__ = [
    "DEFAULT_DATA_DIR", "FIELDS", "FORMATS", "ExampleView", "FileTask", "QASource",
    "detect_format", "file_digest", "gsm8k_reference", "iter_qa", "iter_records", "read_qa",
    "tfds_source", "to_qa",
]

# Where TFDS writes the prepared files unless a task names its own ``data_dir``.
DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rl_jax", "tfds")


# ------------------------------------------------------------------ TFDS data source
def file_digest(path: str, fmt: str, eval_fraction: float = 0.0) -> str:
  """Short content hash of (file bytes, format, held-out fraction): the builder config name."""
  h = hashlib.sha256(fmt.encode())
  if eval_fraction:
    h.update(f"|eval_fraction={float(eval_fraction)!r}|".encode())
  with storage.open_file(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return "h" + h.hexdigest()[:20]


def _in_split(qa: dict[str, str], split: str, eval_fraction: float) -> bool:
  return split_of(qa["question"], eval_fraction) == split


@functools.cache
def _builder_class():
  """The TFDS builder class (defined lazily so importing rl_jax does not import TFDS)."""
  import tensorflow_datasets as tfds

  class RlJaxQa(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Parsed question/reference/solution records of one local file.

    Splits: ``train`` and ``eval`` by question hash at ``eval_fraction`` (with 0, the whole
    file is ``train``). An empty split is not written (TFDS cannot write one).
    """

    # 1.1.0: a final answer given as a JSON number is read (1.0.0 skipped it)
    VERSION = tfds.core.Version("1.1.0")
    # No checksums file beside this class; also avoids TFDS probing the package with
    # importlib_resources, which is not a dependency here.
    code_path = None

    def __init__(self, *, path: str, fmt: str, eval_fraction: float = 0.0, **kwargs):
      self._path, self._fmt, self._eval_fraction = path, fmt, eval_fraction
      config = tfds.core.BuilderConfig(name=file_digest(path, fmt, eval_fraction))
      super().__init__(config=config, **kwargs)

    def _info(self):
      features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in FIELDS})
      return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)

    def _split_generators(self, dl_manager):
      del dl_manager
      if not self._eval_fraction:
        return {"train": self._generate_examples("train")}
      # One streaming pass to learn which splits are non-empty; records are not kept.
      counts = collections.Counter(split_of(qa["question"], self._eval_fraction)
                                   for qa in iter_qa(self._path, self._fmt))
      return {split: self._generate_examples(split) for split in SPLITS if counts[split]}

    def _generate_examples(self, split):
      for i, qa in enumerate(iter_qa(self._path, self._fmt)):
        if _in_split(qa, split, self._eval_fraction):
          yield i, qa

  return RlJaxQa


def tfds_source(path: str, fmt: str = "auto", data_dir: str | None = None,
                split: str = "train", eval_fraction: float = 0.0):
  """Prepare (once) and open one split of a file as a TFDS ``ArrayRecordDataSource``.

  Args:
    path: JSONL or Parquet file.
    fmt: ``"gsm8k"``, ``"math"`` or ``"auto"``.
    data_dir: where TFDS writes the array_record files (default ``DEFAULT_DATA_DIR``).
    split: ``"train"`` or ``"eval"`` (records whose question hashes into it).
    eval_fraction: held-out fraction in [0, 1); 0 puts the whole file in ``"train"``.

  Returns:
    A random-access source; ``source[i]`` is a dict of bytes for ``question``,
    ``reference``, ``solution``.

  Raises:
    ValueError: unknown format or split, bad fraction, or an empty split.
    FileNotFoundError: missing file.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown data format {fmt!r}; choose from {FORMATS}")
  check_split(split)
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
  if not storage.is_file(path):
    raise FileNotFoundError(f"data file not found: {path}")
  import tensorflow_datasets as tfds

  tfds.disable_progress_bar()
  local = not storage.is_remote(path)
  builder = _builder_class()(path=os.path.abspath(path) if local else path, fmt=fmt,
                             eval_fraction=eval_fraction,
                             data_dir=data_dir or DEFAULT_DATA_DIR, file_format="array_record")
  builder.download_and_prepare()
  if split not in builder.info.splits:
    raise EmptySplitError(f"{path}: split {split!r} is empty (eval_fraction={eval_fraction})")
  return builder.as_data_source(split=split)


def _decode(item: dict[str, Any]) -> dict[str, str]:
  return {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in item.items()}


def _position(i: Any, n: int) -> int:
  """A non-negative position from an int-like index in [-n, n); IndexError otherwise."""
  i = int(i)
  if not -n <= i < n:
    raise IndexError(f"index {i} out of range for {n} records")
  return i % n


def _read_many(source: Sequence[Any], keys: list[int]) -> list[Any]:
  """``source.__getitems__(keys)`` where the source batches reads, else one read per key."""
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__(keys))
  return [source[k] for k in keys]


class QASource(Sequence):
  """Random access to one split of a file's parsed records; items are str dicts.

  ``backend="tfds"`` reads records on demand from the TFDS array_record files;
  ``backend="memory"`` parses the split into a list. ``split``/``eval_fraction`` as in
  ``tfds_source`` (the defaults give the whole file).
  """

  def __init__(self, path: str, fmt: str = "auto", backend: str = "tfds",
               data_dir: str | None = None, *, split: str = "train",
               eval_fraction: float = 0.0):
    if backend == "tfds":
      self._src = tfds_source(path, fmt, data_dir, split, eval_fraction)
    elif backend == "memory":
      check_split(split)
      self._src = [qa for qa in iter_qa(path, fmt) if _in_split(qa, split, eval_fraction)]
    else:
      raise ValueError(f"unknown data backend {backend!r}; use 'tfds' or 'memory'")
    if len(self._src) == 0:  # pylint: disable=g-explicit-length-test
      raise EmptySplitError(f"{path}: split {split!r} is empty (eval_fraction={eval_fraction})")

  def __len__(self) -> int:
    return len(self._src)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.__getitems__(range(*i.indices(len(self))))
    return _decode(self._src[_position(i, len(self))])

  def __getitems__(self, keys: Iterable[int]) -> list[dict[str, str]]:
    """Several records in one read (TFDS batches the lookups)."""
    keys = [_position(k, len(self)) for k in keys]
    return [_decode(item) for item in _read_many(self._src, keys)]


class ExampleView(Sequence):
  """The first ``size`` records of a source as ``Example``s, read and formatted on demand.

  ``view[i]`` reads one record; ``view.__getitems__(indices)`` reads several in one call
  (the form TFDS data sources and ``grain`` use); a slice gives a list of that range only.
  """

  def __init__(self, source: Sequence[dict[str, str]], template: str,
               size: int | None = None):
    self._source, self._template = source, template
    self._len = len(source) if size is None else max(0, min(int(size), len(source)))

  def __len__(self) -> int:
    return self._len

  def _example(self, qa: dict[str, str]) -> Example:
    prompt = self._template.replace("{question}", qa["question"])  # other braces stay literal
    return Example(prompt, qa["reference"])

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.__getitems__(range(*i.indices(len(self))))
    return self._example(self._source[_position(i, len(self))])

  def __getitems__(self, keys: Iterable[int]) -> list[Example]:
    keys = [_position(k, len(self)) for k in keys]
    return [self._example(qa) for qa in _read_many(self._source, keys)]

  def __repr__(self) -> str:
    return f"ExampleView(len={len(self)}, template={self._template!r})"


@dataclasses.dataclass(frozen=True)
class FileTask:
  """A task over local GSM8K/MATH-format files, verified with math-verify.

  Attributes:
    path: training file (JSONL or Parquet).
    format: ``"gsm8k"``, ``"math"`` or ``"auto"``.
    eval_path: optional held-out file; without it a stable ``eval_fraction`` of the
      training questions (by question hash) is held out instead.
    eval_fraction: used only without ``eval_path``.
    template: prompt template with ``{question}``.
    backend: ``"tfds"`` (array_record data source) or ``"memory"``.
    data_dir: TFDS data directory (default ``DEFAULT_DATA_DIR``).
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
    if "{{question}}" in self.template.replace(" ", ""):  # jinja2's way, not this one
      raise ValueError(f"prompt template {self.template!r}: write the field as {{question}}, "
                       "in one pair of braces (other braces stay as written)")
    if "{question}" not in self.template:
      raise ValueError(f"prompt template {self.template!r} has no {{question}} field")
    fields = re.findall(r"(?<!\w)\{(\w+)\}", self.template)  # not \boxed{x}'s braces
    unfilled = sorted(set(fields) - {"question"})
    if unfilled:
      raise ValueError(f"prompt template {self.template!r} has the field {{{unfilled[0]}}}, "
                       "which nothing fills: {question} is the only field")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")

  @classmethod
  def from_options(cls, seed: int = 0, **options: Any) -> FileTask:
    """``FileTask(seed=seed, **options)`` with a ValueError (not TypeError) on unknown ones."""
    check_options(cls.name, cls, options)
    return cls(seed=seed, **options)

  def split(self, which: str, size: int | None = None) -> ExampleView:
    """Examples of ``"train"`` or ``"eval"`` in file order (``size`` truncates), lazily.

    Returns:
      An ``ExampleView`` over the TFDS data source (or the in-memory records).

    Raises:
      ValueError: unknown split name or an empty split.
    """
    check_split(which)
    if self.eval_path is not None:
      path, split, fraction = (self.path if which == "train" else self.eval_path), "train", 0.0
    else:
      path, split, fraction = self.path, which, self.eval_fraction
    source = QASource(path, self.format, self.backend, self.data_dir, split=split,
                      eval_fraction=fraction)
    view = ExampleView(source, self.template, size)
    if not len(view):  # pylint: disable=g-explicit-length-test
      raise EmptySplitError(f"file task: split {which!r} of {self.path} is empty")
    return view

  def verify(self, completion: str, answer: str) -> float:
    """math-verify equality of the completion's final answer and ``answer`` (1.0 / 0.0)."""
    return verifiers.math_reward(completion, answer)
