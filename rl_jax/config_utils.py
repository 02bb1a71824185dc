"""Loading and overriding ml-collections configs from the command line; the CLI error guard.

A config is a ``.py`` file defining ``get_config(arg=None) -> ConfigDict``. It is named on
the command line as ``--config=configs/x.py`` or ``--config=configs/x.py:arg`` (everything
after the first ``:`` is passed to ``get_config`` as one string) and refined with
``--config.KEY.PATH=VALUE`` overrides::

    python -m rl_jax.train --config=configs/quickstart.py:small --workdir=/tmp/run \\
        --config.model.num_layers=4 --config.rollout.temperature=0.7

Override values are parsed against the type of the field they replace:

  int     ``4``, ``-1``, ``0x10``                (not ``4.5``, not ``true``)
  float   ``0.5``, ``3e-4``, ``2``, ``inf``      (an int literal is widened)
  bool    ``true false t f 1 0`` (any case)
  str     taken verbatim; surrounding quotes are stripped
  tuple   ``(1, 2)``, ``1,2``, ``(fsdp,tensor)`` (bare words become strings)
  list    as tuple, with ``[...]``
  None    ``None`` / ``none`` / ``null``, allowed only where the field is a placeholder
          (``config_dict.placeholder(int)``) or currently None

int, float and bool use absl's flag parsers, the same ones ``config_flags`` applies. A field
whose current value is None and that is not a typed placeholder accepts any Python literal
(and otherwise the raw string). After overrides the config is locked, so a typo in code
(``config.modle``) fails loudly too.

Why not ``ml_collections.config_flags`` alone (each point is pinned by a test in
``tests/test_config_utils.py`` that runs ``config_flags`` on the same input):

  * it needs absl flag state (a ``FlagValues`` and an argv); ``load_config(path, overrides)``
    is a plain function for notebooks and scripts;
  * a missing config file parses fine and fails only at the first attribute access, and a
    failing ``get_config(arg)`` becomes a multi-line traceback inside the flag error;
  * an unknown key escapes as a raw ``AttributeError`` naming only its last part, and
    ``absl.app`` prints a flag error over several lines (exit 1); here each is one
    ``ConfigError`` that ``main_guard`` prints as one ``error:`` line (exit 2);
  * it cannot set a placeholder to None, cannot override a field that is None or a list, keeps
    the quotes of ``'text'`` in a str field, and turns ``(data,tensor)`` into the one-string
    tuple ``('(data,tensor)',)``.

Flags other than ``--config``/``--workdir`` are handed to absl, so absl's own flags
(``--verbosity`` ...) keep working.

Config files are plain Python files executed by path; they import what they need from the
installed package (``from rl_jax import config``), and nothing is added to ``sys.path``. The
directory of a loaded config file is remembered as a place to find the modules that the
config's import paths name (``env.name=my_env:make`` with ``my_env.py`` beside the config
file; ``rl_jax.imports``).

Free-form sections (``FREE_FORM``: ``env.kwargs``, the user's own environment settings) take
new keys from the command line too: ``--config.env.kwargs.size=8`` sets ``size`` whether or
not the config file defined it (a new key's value is a Python literal, else the raw string).

The declarative value checks (``check``, ``validate``, ``positive_int``, ``one_of`` ...) live
in ``rl_jax.config_checks`` and are importable from here too.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import uuid
from typing import Any, Callable, Iterable, Sequence

import ml_collections
from absl import flags
from ml_collections import config_dict

from rl_jax.config_checks import (Check, check, check_choice, get_value, in_range, is_int, is_number,
                                  nonnegative, nonnegative_int, one_of, optional, positive,
                                  positive_int, power_of_two, probability, resolve_parent,
                                  validate)
from rl_jax import imports
from rl_jax.errors import ConfigError, RLJaxError

__all__ = [
    "ConfigError", "USAGE", "load_config", "load_config_file", "split_config_spec", "apply_overrides",
    "set_value", "parse_value", "parse_cli", "main_guard", "get_value", "Check", "check",
    "check_choice", "validate",
    "positive_int", "power_of_two", "nonnegative_int", "positive", "nonnegative", "probability",
    "in_range", "one_of", "optional", "is_int", "is_number",
]

_NONE_WORDS = ("none", "null")
# The parsers config_flags itself uses for these field types (absl's): ``4`` / ``0x10`` for
# int (not ``4.5`` or ``true``), ``3e-4`` / ``2`` / ``inf`` for float, ``true t 1 false f 0``
# (any case) for bool.
_SCALAR_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(),
                   bool: flags.BooleanParser()}


# ------------------------------------------------------------------ loading config files
def split_config_spec(spec: str) -> tuple[str, str | None]:
  """``"configs/x.py:arg"`` -> ``("configs/x.py", "arg")``; no colon -> ``(path, None)``."""
  if not isinstance(spec, str) or not spec.strip():
    raise ConfigError(f"config must be a path like configs/x.py[:arg], got {spec!r}")
  path, sep, arg = spec.partition(":")
  return path, (arg if sep else None)


def _exec_module(path: str):
  """Executes a config file as a fresh module and returns it."""
  name = f"_rl_jax_config_{uuid.uuid4().hex[:8]}"
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise ConfigError(f"config file {path} is not a Python file")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # The config file itself is broken: report where, in one line.
    raise ConfigError(f"config file {path} failed to import: {type(e).__name__}: {e}") from e
  return module


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """Calls ``get_config(arg)`` (or ``get_config()`` when ``arg`` is None) from ``path``.

  Args:
    path: a ``.py`` file defining ``get_config``.
    arg: the string after ``:`` in ``--config=path:arg``, or None.

  Returns:
    The (unlocked) ConfigDict that ``get_config`` returned.

  Raises:
    ConfigError: the file is missing or broken, has no ``get_config``, rejects ``arg``, or
      does not return a ConfigDict.
  """
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  module = _exec_module(path)
  imports.remember_config_dir(path)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    raise ConfigError(f"config file {path} defines no get_config() function")
  call = f"get_config({arg!r})" if arg is not None else "get_config()"
  try:
    config = get_config(arg) if arg is not None else get_config()
  except TypeError as e:
    if arg is not None and _takes_no_argument(get_config):
      raise ConfigError(f"config file {path}: get_config() takes no argument, "
                        f"but ':{arg}' was given") from e
    raise ConfigError(f"config file {path}: {call} failed: TypeError: {e}") from e
  except Exception as e:  # get_config raised for a bad arg or a bug in the file.
    raise ConfigError(f"config file {path}: {call} failed: {type(e).__name__}: {e}") from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config file {path}: {call} returned {type(config).__name__}, "
                      "expected an ml_collections.ConfigDict")
  return config


def _takes_no_argument(fn: Callable[..., Any]) -> bool:
  try:
    return not inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def load_config(spec: str, overrides: Sequence[str] = (), *,
                lock: bool = True) -> ml_collections.ConfigDict:
  """Loads ``path[:arg]``, applies ``overrides`` and locks the result.

  Args:
    spec: ``"configs/x.py"`` or ``"configs/x.py:arg"``.
    overrides: strings ``"model.num_layers=4"``; a leading ``--config.`` or ``config.`` is
      accepted, so the CLI arguments can be passed through unchanged.
    lock: lock the config afterwards (no new keys can be added).

  Returns:
    The ConfigDict.

  Raises:
    ConfigError: see ``load_config_file`` and ``apply_overrides``.
  """
  path, arg = split_config_spec(spec)
  config = load_config_file(path, arg)
  apply_overrides(config, overrides)
  if lock:
    config.lock()
  return config


# ------------------------------------------------------------------ overrides
def _split_override(override: str) -> tuple[str, str]:
  """``"--config.a.b=3"`` -> ``("a.b", "3")``."""
  if not isinstance(override, str) or "=" not in override:
    raise ConfigError(f"config override {override!r} must look like KEY=VALUE, "
                      "e.g. model.num_layers=4")
  key, _, raw = override.partition("=")
  key = key.strip()
  for prefix in ("--config.", "-config.", "config."):
    if key.startswith(prefix):
      key = key[len(prefix):]
      break
  if not key or any(not part for part in key.split(".")):
    raise ConfigError(f"config override {override!r} has an empty key")
  return key, raw


def _literal(raw: str) -> Any:
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return raw


def _parse_sequence(raw: str) -> list[Any]:
  """``"(1, 2)"``, ``"1,2"``, ``"[a, b]"`` -> list of literals / bare strings."""
  text = raw.strip()
  value = _literal(text)
  if isinstance(value, (tuple, list)):
    return list(value)
  if text[:1] in "([" and text[-1:] in ")]":
    text = text[1:-1]
  if not text.strip():
    return []
  return [_literal(item.strip()) for item in text.split(",") if item.strip()]


def _strip_quotes(raw: str) -> str:
  if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
    return raw[1:-1]
  return raw


def parse_value(raw: str, field_type: type | None, *, key: str = "value",
                allow_none: bool = True) -> Any:
  """Parses the string ``raw`` as a value of ``field_type`` (None: any Python literal).

  Args:
    raw: the text after ``=`` on the command line.
    field_type: type of the field being replaced (``int``, ``float``, ``bool``, ``str``,
      ``tuple``, ``list``) or ``None``/``type(None)``/``object`` for an untyped field.
    key: the dotted key, used in error messages only.
    allow_none: whether ``None``/``none``/``null`` is accepted.

  Returns:
    The parsed value.

  Raises:
    ConfigError: ``raw`` is not a valid ``field_type``.
  """
  text = raw.strip()
  if text.lower() in _NONE_WORDS:
    if not allow_none:
      name = getattr(field_type, "__name__", str(field_type))
      raise ConfigError(f"config.{key} is a {name} field and cannot be None "
                        f"(declare it with config_dict.placeholder({name}) to allow None)")
    return None
  if field_type in (None, type(None), object):
    return _literal(text)
  if field_type in _SCALAR_PARSERS:
    try:
      return _SCALAR_PARSERS[field_type].parse(text)
    except (TypeError, ValueError):
      hint = " (use true or false)" if field_type is bool else ""
      article = "an" if field_type is int else "a"
      raise ConfigError(f"config.{key} is {article} {field_type.__name__} field; "
                        f"got {raw!r}{hint}") from None
  if field_type is str:
    return _strip_quotes(raw)
  if field_type in (tuple, list):
    return field_type(_parse_sequence(text))
  if isinstance(field_type, type) and issubclass(field_type, ml_collections.ConfigDict):
    raise ConfigError(f"config.{key} is a section; override its fields instead, "
                      f"e.g. config.{key}.<field>=...")
  raise ConfigError(f"config.{key} has type {getattr(field_type, '__name__', field_type)}, "
                    "which cannot be set from the command line")


def _field_info(parent: ml_collections.ConfigDict, leaf: str) -> tuple[type | None, bool]:
  """(type to parse against, whether None is allowed) for ``parent[leaf]``."""
  raw_field = parent._fields[leaf]  # pylint: disable=protected-access
  if isinstance(raw_field, config_dict.FieldReference):
    return raw_field.get_type(), True
  if raw_field is None:
    return None, True
  return type(raw_field), False


# sections whose keys are the user's own: an override may add a key (module docstring)
FREE_FORM = ("env.kwargs",)


def set_value(config: ml_collections.ConfigDict, key: str, raw: str) -> None:
  """Parses ``raw`` against the existing field at dotted ``key`` and assigns it (a new key
  of a ``FREE_FORM`` section: a Python literal, else the raw string)."""
  head, _, leaf = key.rpartition(".")
  if head in FREE_FORM and leaf not in get_value(config, head):
    get_value(config, head)[leaf] = _literal(raw.strip())
    return
  parent, leaf = resolve_parent(config, key)
  field_type, allow_none = _field_info(parent, leaf)
  value = parse_value(raw, field_type, key=key, allow_none=allow_none)
  try:
    parent[leaf] = value
  except (TypeError, ValueError, AttributeError, KeyError) as e:
    raise ConfigError(f"config.{key}: cannot set {raw!r}: {e}") from e


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
  """Applies ``KEY=VALUE`` overrides in order (in place); see the module docstring."""
  if isinstance(overrides, str):
    raise ConfigError("config overrides must be a list of KEY=VALUE strings, not one string")
  with config.unlocked() if config.is_locked else contextlib.nullcontext():
    for override in overrides:
      key, raw = _split_override(override)
      set_value(config, key, raw)


# ------------------------------------------------------------------ command line
def _take_value(argv: Sequence[str], i: int, name: str) -> tuple[str, int]:
  """Value of ``--name=v`` or ``--name v`` at ``argv[i]``; returns (value, next index)."""
  arg = argv[i]
  if "=" in arg:
    return arg.split("=", 1)[1], i + 1
  if i + 1 >= len(argv) or (argv[i + 1].startswith("-") and not _is_number_text(argv[i + 1])):
    raise ConfigError(f"--{name} needs a value")
  return argv[i + 1], i + 2


def _is_number_text(text: str) -> bool:
  return is_number(_literal(text))


def _flag_name(arg: str) -> str:
  return arg.lstrip("-").split("=", 1)[0]


USAGE = """\
usage: python -m rl_jax.train --config=FILE[:ARG] --workdir=DIR [--config.KEY=VALUE ...]

  --config=FILE[:ARG]   a Python file defining get_config(arg=None) -> ConfigDict; the
                        repository ships configs/quickstart.py (a tiny sorting policy on a
                        CPU) and configs/gsm8k_hf.py (a GSM8K-format file with a Hugging Face model);
                        the text after the first ':' is passed to get_config
  --workdir=DIR         metrics.jsonl, tensorboard/, checkpoints/, curves.png and hf/ go
                        here; rerunning the same command resumes from the newest checkpoint
  --config.KEY=VALUE    override one field, parsed against its type, e.g.
                        --config.train.steps=10 --config.rollout.temperature=0.7
                        --config.mesh.shape.fsdp=2; an unknown key fails with a hint

Every field, its default and its meaning: rl_jax/settings.py (rl_jax/config.py builds the
config from it). Multi-process jobs run the same command on every process
(rl_jax.distributed).
"""

HELP_FLAGS = ("-h", "--help", "--helpfull", "-help")


def parse_cli(argv: Sequence[str], *, require_workdir: bool = True,
              lock: bool = True) -> tuple[ml_collections.ConfigDict, str | None]:
  """Parses ``prog --config=FILE[:ARG] --workdir=DIR [--config.KEY=VALUE ...]``.

  ``-h`` / ``--help`` prints ``USAGE`` and exits. Arguments other than these are handed to absl's flag parser (so absl's own flags such as
  ``--verbosity`` keep working); an unknown one is a ConfigError.

  Args:
    argv: the full ``sys.argv`` (``argv[0]`` is the program name).
    require_workdir: whether ``--workdir`` is mandatory.
    lock: lock the returned config.

  Returns:
    ``(config, workdir)``; ``workdir`` is None only when not required and not given.

  Raises:
    ConfigError: a missing/unknown flag, or anything ``load_config`` rejects.
  """
  argv = list(argv)
  if any(a in HELP_FLAGS for a in argv[1:]):
    print(USAGE, end="")
    sys.exit(0)
  spec, workdir, overrides, rest = None, None, [], argv[:1]
  i = 1
  while i < len(argv):
    arg = argv[i]
    name = _flag_name(arg) if arg.startswith("-") else None
    if name == "config":
      spec, i = _take_value(argv, i, "config")
    elif name == "workdir":
      workdir, i = _take_value(argv, i, "workdir")
    elif name is not None and name.startswith("config."):
      value, i = _take_value(argv, i, name)
      overrides.append(f"{name[len('config.'):]}={value}")
    else:
      rest.append(arg)
      i += 1
  if spec is None:
    raise ConfigError("missing --config=FILE[:ARG], e.g. --config=configs/quickstart.py")
  if require_workdir and not workdir:
    raise ConfigError("missing --workdir=DIR (where metrics, checkpoints and exports go)")
  # a shell expands ~ at the start of a word, not after --workdir=
  spec, workdir = os.path.expanduser(spec), workdir and os.path.expanduser(workdir)
  _parse_absl_flags(rest)
  return load_config(spec, overrides, lock=lock), workdir


def _parse_absl_flags(argv: list[str]) -> None:
  """Lets absl parse the remaining flags; turns its errors into one-line ConfigErrors."""
  try:
    leftover = flags.FLAGS(argv, known_only=False)
  except flags.Error as e:
    raise ConfigError(f"command line: {str(e).splitlines()[0]}") from e
  if len(leftover) > 1:
    raise ConfigError(f"unexpected positional arguments {leftover[1:]}")


def main_guard(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a CLI entry point: an ``RLJaxError`` prints ``error: <msg>`` and exits with 2.

  Any other exception is a bug and propagates with its traceback. Use as a decorator or as
  ``main_guard(main)()``.
  """

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    try:
      return fn(*args, **kwargs)
    except RLJaxError as e:
      message = " ".join(str(e).split()) or type(e).__name__
      print(f"error: {message}", file=sys.stderr, flush=True)
      sys.exit(2)

  return wrapper
