"""README.md names only what exists: every command it shows, every path and link it names,
every config field of its feature list and every docs section it points to.

``tests/test_readme.py`` pins the two set-up commands (CI runs the test one verbatim); this
file checks all of README's commands, statically and in seconds: no command is run, nothing is
compiled, no weights or data are read. A renamed flag, config field, extra, script or docs
section then fails here, naming the README line, instead of in a reader's terminal.

A command is a line of a fenced block (other than ```python) or an inline `code` span that
starts with ``python``, ``python3``, ``pip`` or ``bash``; a fenced line (backslash
continuations joined) is split at ``&&``, ``||`` and ``;``. An inline span that starts with
``--`` continues the command before it on the same line (``python scripts/bench_paged.py
...``; ``--fixed-budget --repeats 1``) or, with none, adds overrides to the quickstart
(``QUICKSTART_TRAIN``: the results table's "after the first command: it with ...", the
feature list's ``--config.train.mode=async ...``). Per command:

  python -m MODULE      importable (``importlib.util.find_spec``; a package has a
                        ``__main__.py``); a module of this repository that parses its flags
                        with argparse declares every flag given
  python -m rl_jax.train
                        ``--config=FILE[:ARG]`` loads with the ``--config.KEY=VALUE``
                        overrides and passes the static rules ``build_setup`` applies before
                        it touches devices or data (``rl_jax.config.validate``, the
                        objective's checks); these read no file, so an ``hf_path`` or
                        ``data.path`` that exists only on the reader's machine is applied as
                        the string it is. ``--workdir`` is not checked (the run creates it)
  python scripts/X.py   the script exists; every ``--flag`` and subcommand is one its argparse
                        parser declares (read from the source, not by running it), and the
                        value of a flag with ``choices`` or ``type=int|float`` is one it takes
  python -m pytest      its path arguments exist; ``-n`` has pytest-xdist
  bash FILE             the file exists
  pip install -e ".[EXTRA]"
                        setup.py declares the extra

Values written as placeholders (``DIR``, ``HF_DIR``, ``N``, ``r``, ``<size>``) are not parsed;
``a|b`` stands for a and for b. Paths a previous command creates (``.venv``, ``--workdir``,
``--model=DIR/hf``) are not checked.
"""

import ast
import functools
import importlib.util
import itertools
import os
import re
import shlex
from typing import NamedTuple

import pytest
from absl import flags

from rl_jax import config as config_lib
from rl_jax import config_utils
from rl_jax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PROGRAMS = ("python", "python3", "pip", "bash")
QUICKSTART = "configs/quickstart.py"
QUICKSTART_TRAIN = f"python -m rl_jax.train --config={QUICKSTART}"
# Sanity floors (README had 40 commands, 8 of them in fenced blocks, 29 config fields, 78 path
# mentions and 21 docs-section references on 2026-11-28): a broken extraction fails here
# instead of passing over nothing.
MIN_COMMANDS, MIN_FENCED, MIN_FIELDS, MIN_PATHS, MIN_SECTIONS = 30, 6, 20, 40, 12
# Top-level directories whose paths README names (in prose, tables and the Layout block).
PATH_ROOTS = ("docs", "configs", "scripts", "notebooks", "tests", "rl_jax", "pallas_kernels")
# Its dotted names are Python (`rollout.generate`), not config fields.
LIBRARY_SECTION = "## Using it as a library"


# ------------------------------------------------------------------ README parsing
class Command(NamedTuple):
  line: int  # README.md line number (1-based)
  text: str
  fenced: bool


def _readme() -> str:
  with open(README) as f:
    return f.read()


def _split(text: str) -> tuple[list[tuple[str, int, list[str]]], str]:
  """(fenced blocks as (language, first line number, lines), the prose with every fenced line
  blanked so that offsets keep their line numbers)."""
  blocks, prose, fence = [], [], None
  for number, line in enumerate(text.split("\n"), 1):
    opening = re.match(r"\s*```(\w*)\s*$", line)
    if opening and fence is None:
      fence = (opening.group(1), number + 1, [])
    elif opening:
      blocks.append(fence)
      fence = None
    elif fence is not None:
      fence[2].append(line)
    prose.append(line if fence is None and not opening else "")
  assert fence is None, "README.md: a ``` block is never closed"
  return blocks, "\n".join(prose)


def _line_of(text: str, offset: int) -> int:
  return text.count("\n", 0, offset) + 1


def _is_command(text: str) -> bool:
  return text.split(" ", 1)[0] in PROGRAMS and " " in text


def _head(command: str) -> str:
  """The program and what it runs: ``python scripts/x.py``, ``python -m mod``."""
  words = command.split()
  return " ".join(words[:3] if words[1:2] == ["-m"] else words[:2])


def _fenced_commands(blocks) -> list[Command]:
  out = []
  for language, first, lines in blocks:
    if language == "python":
      continue
    i = 0
    while i < len(lines):
      number, logical = first + i, lines[i].strip()
      while logical.endswith("\\") and i + 1 < len(lines):
        i += 1
        logical = logical[:-1].rstrip() + " " + lines[i].strip()
      i += 1
      out += [Command(number, s.strip(), True) for s in re.split(r"&&|\|\||;", logical)
              if _is_command(s.strip())]
  return out


def _spans(prose: str):
  """(line number, text with whitespace collapsed) of every inline `code` span."""
  for m in re.finditer(r"`([^`]+)`", prose):
    yield _line_of(prose, m.start()), " ".join(m.group(1).split())


def _inline_commands(prose: str) -> list[Command]:
  out, last = [], {}  # line number -> the last command on it
  for number, span in _spans(prose):
    if _is_command(span):
      out.append(Command(number, span, False))
      last[number] = span
    elif span.startswith("--"):
      head = _head(last[number]) if number in last else QUICKSTART_TRAIN
      out.append(Command(number, f"{head} {span}", False))
  return out


def readme_commands() -> list[Command]:
  blocks, prose = _split(_readme())
  return _fenced_commands(blocks) + _inline_commands(prose)


def _section(prose: str, heading: str) -> tuple[int, int]:
  """Offsets of ``heading``'s section (up to the next ``## ``) in ``prose``."""
  start = prose.find("\n" + heading + "\n")
  assert start >= 0, f"README.md has no section {heading!r} (this test reads it)"
  end = prose.find("\n## ", start + 1)
  return start, (len(prose) if end < 0 else end)


def readme_fields() -> list[tuple[int, str, str | None]]:
  """(line, key, value or None) of every inline span that names a config field (``a.b`` or
  ``a.b=v`` whose first part is a section of the base config), outside the library section."""
  sections = set(config_lib.base_config().keys())
  _, prose = _split(_readme())
  start, end = _section(prose, LIBRARY_SECTION)
  prose = prose[:start] + re.sub(r"[^\n]", " ", prose[start:end]) + prose[end:]
  out = []
  for number, span in _spans(prose):
    m = re.fullmatch(r"([a-z_]+(?:\.[a-z_0-9]+)+)(?:=(\S+))?", span)
    if m and m.group(1).split(".")[0] in sections:
      out.append((number, m.group(1), m.group(2)))
  return out


def readme_paths() -> list[tuple[int, str]]:
  """(line, path) of every repository path README names and every relative link target."""
  text = _readme()
  roots = "|".join(PATH_ROOTS)
  out = [(_line_of(text, m.start()), m.group(1).rstrip(".,;:"))
         for m in re.finditer(rf"(?<![\w/.:-])((?:{roots})/[\w./-]*)", text)]
  for m in re.finditer(r"\]\(([^)\s]+)\)", text):
    target = m.group(1).split("#", 1)[0]
    if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):  # not https:, mailto: ...
      out.append((_line_of(text, m.start()), target))
  return out


def readme_section_refs() -> list[tuple[int, str, str]]:
  """(line, docs file, quoted section name): the results tables' last column ("§", sections
  of docs/BENCHMARKS.md) and every ``"Name"`` after a ``docs/X.md`` in the same paragraph or
  list item (``docs/ALGORITHMS.md, "Asynchronous training" ... "Rollouts: APRIL ..."``)."""
  _, prose = _split(_readme())
  prose = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group()), prose)
  out = []
  start, end = _section(prose, "## Results")
  for m in re.finditer(r"^\|.*\|$", prose[start:end], flags=re.M):
    number = _line_of(prose, start + m.start())
    last_cell = m.group().strip("|").split("|")[-1]
    out += [(number, "docs/BENCHMARKS.md", name) for name in re.findall(r'"([^"]+)"', last_cell)]
  offset = 0
  for item in re.split(r"\n(?=\s*\n|- |\|)", prose):
    doc = None
    for m in re.finditer(r'(docs/\w+\.md)|"([^"\n]+)"', item):
      if m.group(1):
        doc = m.group(1)
      elif doc:
        out.append((_line_of(prose, offset + m.start()), doc, m.group(2)))
    offset += len(item) + 1
  return out


# ------------------------------------------------------------------ checking one command
def _placeholder(value: str) -> bool:
  """``DIR``, ``HF_DIR``, ``N``, ``r``, ``<size>``: a value the reader fills in."""
  return re.fullmatch(r"<[^>]*>|[A-Z][A-Z0-9_]*|[a-z]", value) is not None


def command_problems(command: str) -> list[str]:
  """What ``command`` names that does not exist or is not accepted ([] when all of it is)."""
  words = shlex.split(command)
  if "|" in words:  # a pipe: the command is what comes before it
    words = words[:words.index("|")]
  program, args = words[0], words[1:]
  if program == "pip":
    return _pip_problems(args)
  if program == "bash":
    return _file_problems(args[0]) if args else ["bash is given no file"]
  if args[:1] == ["-m"]:
    return _module_problems(args[1], args[2:]) if len(args) > 1 else ["-m names no module"]
  if not args:
    return [f"{program} is given no script"]
  path = os.path.join(ROOT, args[0])
  if not os.path.isfile(path):
    return [f"{args[0]} does not exist"]
  return _argparse_problems(args[0], path, args[1:])


def _file_problems(path: str) -> list[str]:
  return [] if os.path.exists(os.path.join(ROOT, path)) else [f"{path} does not exist"]


@functools.lru_cache(maxsize=None)
def setup_extras() -> frozenset:
  """The keys of setup.py's ``extras_require`` (a dict literal), read from its source."""
  with open(os.path.join(ROOT, "setup.py")) as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "extras_require":
      assert isinstance(node.value, ast.Dict), "setup.py: extras_require is not a dict literal"
      return frozenset(ast.literal_eval(k) for k in node.value.keys)
  raise AssertionError("setup.py declares no extras_require")


def _pip_problems(args: list[str]) -> list[str]:
  if args[:1] != ["install"]:
    return []  # only installs name things of this repository
  out = []
  for target in (a for a in args[1:] if not a.startswith("-")):
    m = re.fullmatch(r"(\.[^\[]*)(?:\[(.*)\])?", target)
    if not m:
      continue  # a package from the index: pip's to find
    base = os.path.join(ROOT, m.group(1))
    if not any(os.path.isfile(os.path.join(base, f)) for f in ("setup.py", "pyproject.toml")):
      out.append(f"{m.group(1)} has no setup.py or pyproject.toml")
    extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
    out += [f"setup.py declares no extra {e!r} (it has {sorted(setup_extras())})"
            for e in extras if e not in setup_extras()]
  return out


def _module_problems(name: str, args: list[str]) -> list[str]:
  try:
    spec = importlib.util.find_spec(name)
  except ImportError:  # a parent package is missing
    spec = None
  if spec is None:
    return [f"module {name} is not importable"]
  path = spec.origin
  if spec.submodule_search_locations:  # python -m on a package runs its __main__
    path = os.path.join(list(spec.submodule_search_locations)[0], "__main__.py")
    if not os.path.isfile(path):
      return [f"package {name} has no __main__.py"]
  if name == "rl_jax.train":
    return _train_problems(args)
  if name == "pytest":
    return _pytest_problems(args)
  if not (path or "").startswith(ROOT + os.sep):
    return []  # a third-party module (venv ...): its flags are its own
  return _argparse_problems(f"python -m {name}", path, args)


def _pytest_problems(args: list[str]) -> list[str]:
  out, i = [], 0
  while i < len(args):
    arg = args[i]
    i += 1
    if arg in ("-n", "--numprocesses"):
      i += 1
      if importlib.util.find_spec("xdist") is None:
        out.append(f"pytest {arg} needs pytest-xdist, which is not installed")
    elif arg in ("-k", "-m", "-p", "-c", "--maxfail", "--durations"):
      i += 1
    elif not arg.startswith("-"):
      out += _file_problems(arg.split("::", 1)[0])
  return out


# ------------------------------------------------------------------ rl_jax.train and configs
def _train_problems(args: list[str]) -> list[str]:
  """``rl_jax.train``'s command line as ``config_utils.parse_cli`` reads it."""
  spec, overrides, out, i = None, [], [], 0
  while i < len(args):
    arg = args[i]
    name = arg.lstrip("-").split("=", 1)[0] if arg.startswith("-") else None
    if "=" in arg:
      value, i = arg.split("=", 1)[1], i + 1
    elif name and i + 1 < len(args) and not args[i + 1].startswith("-"):
      value, i = args[i + 1], i + 2
    else:
      value, i = None, i + 1
    if name == "config":
      spec = value
    elif name == "workdir":
      pass  # the run creates it
    elif name and name.startswith("config."):
      overrides.append((name[len("config."):], value))
    elif not (name and name in flags.FLAGS):  # absl's own flags (--verbosity) are fine
      out.append(f"rl_jax.train takes --config, --workdir and --config.KEY=VALUE, not {arg!r}")
  if not spec:
    return out + ["rl_jax.train needs --config=FILE[:ARG]"]
  return out + config_problems(spec, overrides)


def _load(spec: str, overrides=()):
  """``load_config`` of ``spec`` relative to the repository root."""
  return config_utils.load_config(os.path.join(ROOT, spec), list(overrides))


def _static_rules(config) -> None:
  """What ``train.build_setup`` checks before it touches devices or data."""
  from rl_jax.train import context  # pylint: disable=import-outside-toplevel
  config_lib.validate(config)
  config_lib.check_objective(config, context.make_objective(config).needs)


def config_problems(spec: str, overrides: list[tuple[str, str | None]]) -> list[str]:
  """``--config=spec`` with ``--config.KEY=VALUE`` ``overrides`` (VALUE None: the key alone,
  which must exist): it loads and passes the static rules, for each choice of ``a|b``."""
  path, _ = config_utils.split_config_spec(spec)
  if not os.path.isfile(os.path.join(ROOT, path)):
    return [f"config file {path} does not exist"]
  named, concrete = [], []
  for key, value in overrides:
    if "<" in key:  # mesh.shape.<axis>: what comes before the placeholder exists
      named.append(key.split(".<", 1)[0])
    elif value is None or _placeholder(value):
      named.append(key)
    else:
      concrete.append([f"{key}={v}" for v in value.split("|")])
  out = []
  for chosen in itertools.product(*concrete):
    shown = " ".join(["--config=" + spec] + ["--config." + o for o in chosen])
    try:
      config = _load(spec, chosen)
      for key in named:
        config_utils.get_value(config, key)
      _static_rules(config)
    except ConfigError as e:
      out.append(f"{shown}: {e}")
  return out


def field_problems(key: str, value: str | None) -> list[str]:
  """A config field the prose names (``model.lora.quant=int8|int4``): it exists in the base
  config, and a value given (each of ``a|b``) parses against its type and passes the field's
  own check (not the cross-field rules: ``model.lora.quant`` alone needs a LoRA rank)."""
  try:
    config_utils.get_value(config_lib.base_config(), key)
  except ConfigError as e:
    return [str(e)]
  if value is None or _placeholder(value):
    return []
  out = []
  for v in value.split("|"):
    try:
      config = config_lib.base_config()
      config_utils.apply_overrides(config, [f"{key}={v}"])
      own = config_lib.checks().get(key, ())
      config_utils.check(config, key, *(own if isinstance(own, tuple) else (own,)))
    except ConfigError as e:
      out.append(str(e))
  return out


# ------------------------------------------------------------------ scripts' argparse flags
class _Option(NamedTuple):
  takes_value: bool
  choices: tuple | None
  type: type | None


class _Parsers(NamedTuple):
  options: dict  # parser ("" the top level, else a subcommand's name) -> {flag: _Option}
  positionals: frozenset  # parsers that declare positional arguments
  subcommand_required: bool


_NO_VALUE = ("store_true", "store_false", "store_const", "append_const", "count", "help",
             "version")


def _call_name(call: ast.Call) -> str | None:
  f = call.func
  return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _receiver(call: ast.Call) -> str | None:
  f = call.func
  return f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None


@functools.lru_cache(maxsize=None)
def argparse_options(path: str) -> _Parsers | None:
  """The flags a file's argparse parsers declare, read from its source (None: it builds no
  ``ArgumentParser``). A variable assigned ``ArgumentParser(...)`` is the top level, one
  assigned ``X.add_parser("name")`` the subcommand ``name``, an argument group its parent's."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  owner, options, subcommand_required = {}, {}, False
  assigns = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and isinstance(n.value, ast.Call) and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name)), key=lambda n: n.lineno)
  for node in assigns:
    call, target, fn = node.value, node.targets[0].id, _call_name(node.value)
    if fn == "ArgumentParser":
      owner[target] = ""
    elif fn == "add_parser" and call.args and isinstance(call.args[0], ast.Constant):
      owner[target] = call.args[0].value
    elif fn in ("add_argument_group", "add_mutually_exclusive_group"):
      owner[target] = owner.get(_receiver(call), "")
  calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
  if not any(_call_name(c) == "ArgumentParser" for c in calls):
    return None
  options[""] = {"-h": _Option(False, None, None), "--help": _Option(False, None, None)}
  positionals = set()
  for call in calls:
    fn, parser = _call_name(call), owner.get(_receiver(call), "")
    if fn == "add_subparsers":
      subcommand_required |= any(k.arg == "required" and isinstance(k.value, ast.Constant)
                                 and k.value.value for k in call.keywords)
    if fn == "add_parser" and call.args and isinstance(call.args[0], ast.Constant):
      options.setdefault(call.args[0].value, {})
    if fn != "add_argument":
      continue
    names = [a.value for a in call.args
             if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if not names or not names[0].startswith("-"):
      positionals.add(parser)
      continue
    kw = {k.arg: k.value for k in call.keywords}
    action = kw.get("action")
    action = (action.value if isinstance(action, ast.Constant) else
              action.attr if isinstance(action, ast.Attribute) else
              action.id if isinstance(action, ast.Name) else None)
    try:
      choices = tuple(ast.literal_eval(kw["choices"])) if "choices" in kw else None
    except ValueError:  # computed choices: not checked
      choices = None
    type_ = kw.get("type")
    type_ = {"int": int, "float": float}.get(type_.id) if isinstance(type_, ast.Name) else None
    nargs = kw.get("nargs")
    takes_value = (action not in _NO_VALUE + ("BooleanOptionalAction",)
                   and not (isinstance(nargs, ast.Constant) and nargs.value == 0))
    option = _Option(takes_value, choices, type_)
    for name in names:
      options.setdefault(parser, {})[name] = option
      if action == "BooleanOptionalAction" and name.startswith("--"):
        options[parser]["--no-" + name[2:]] = option
  return _Parsers(options, frozenset(positionals), subcommand_required)


def _value_problem(flag: str, option: _Option, value: str | None) -> str | None:
  if value is None:
    return f"{flag} needs a value"
  if _placeholder(value):
    return None
  if option.type is not None:
    try:
      parsed = option.type(value)
    except ValueError:
      return f"{flag} takes a {option.type.__name__}, got {value!r}"
  else:
    parsed = value
  if option.choices is not None and parsed not in option.choices:
    return f"{flag} takes one of {list(option.choices)}, got {value!r}"
  return None


def _argparse_problems(name: str, path: str, args: list[str]) -> list[str]:
  parsers = argparse_options(path)
  if parsers is None:
    return [f"{name} declares no argparse flags, but is given {args}"] if args else []
  subcommands = sorted(k for k in parsers.options if k)
  allowed, chosen, out, i = dict(parsers.options[""]), None, [], 0
  while i < len(args):
    arg = args[i]
    i += 1
    if arg.startswith("-") and not re.fullmatch(r"-[\d.]+", arg):
      flag, eq, inline = arg.partition("=")
      option = allowed.get(flag)
      if option is None:
        out.append(f"{name}{' ' + chosen if chosen else ''} has no option {flag} (it takes "
                   f"{', '.join(sorted(allowed))})")
      elif option.takes_value:
        if not eq and i < len(args) and not args[i].startswith("--"):
          inline, eq, i = args[i], "=", i + 1
        problem = _value_problem(flag, option, inline if eq else None)
        if problem:
          out.append(f"{name}: {problem}")
      elif eq:
        out.append(f"{name}: {flag} takes no value, got {arg!r}")
    elif subcommands and chosen is None:
      if arg in subcommands:
        chosen = arg
        allowed.update(parsers.options[arg])
      else:
        out.append(f"{name} has no subcommand {arg!r} (it has {subcommands})")
        chosen = arg
    elif (chosen or "") not in parsers.positionals:
      out.append(f"{name}: unexpected argument {arg!r}")
  if subcommands and chosen is None and parsers.subcommand_required:
    out.append(f"{name} needs a subcommand, one of {subcommands}")
  return out


# ------------------------------------------------------------------ docs sections
def _headings(path: str) -> list[str]:
  """A markdown file's headings, outside code blocks, without ``#``s or a ``N.`` number."""
  with open(os.path.join(ROOT, path)) as f:
    _, prose = _split(f.read())
  return [re.sub(r"^\d+\.\s+", "", m.group(1).strip())
          for m in re.finditer(r"^#+\s+(.*)$", prose, flags=re.M)]


def section_problem(doc: str, name: str) -> str | None:
  """``name`` is a heading of ``doc`` or starts one (``"LoRA"``: ``## LoRA (...)``)."""
  if not os.path.isfile(os.path.join(ROOT, doc)):
    return f"{doc} does not exist"
  for heading in _headings(doc):
    if heading == name or (heading.startswith(name) and not heading[len(name)].isalnum()):
      return None
  return f"{doc} has no section {name!r}"


# ------------------------------------------------------------------ the tests
def _ids(labels: list[str]) -> list[str]:
  seen, out = {}, []
  for label in labels:
    seen[label] = seen.get(label, 0) + 1
    out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
  return out


def _command_label(command: Command) -> str:
  words = shlex.split(command.text)
  target = (words[2] if words[1:2] == ["-m"] else
            "pip" if words[0] == "pip" else os.path.basename(words[1]))
  return f"L{command.line}-{target}"


COMMANDS = readme_commands()
FIELDS = readme_fields()
PATHS = readme_paths()
SECTION_REFS = readme_section_refs()


def test_extraction_finds_the_commands():
  """The extraction works (every ```bash block yields a command, the totals are above their
  floors), so the parametrized checks below cannot pass over nothing."""
  blocks, _ = _split(_readme())
  bash_blocks = [first for language, first, _ in blocks if language == "bash"]
  assert len(bash_blocks) >= 3, f"only {len(bash_blocks)} ```bash blocks in README.md"
  fenced_lines = {c.line for c in COMMANDS if c.fenced}
  for first in bash_blocks:
    assert first in fenced_lines, f"no command found in the ```bash block at README.md:{first}"
  assert len(COMMANDS) >= MIN_COMMANDS, [c.text for c in COMMANDS]
  assert sum(c.fenced for c in COMMANDS) >= MIN_FENCED
  texts = " ".join(c.text for c in COMMANDS)
  for expected in ("python -m rl_jax.train", "python -m rl_jax.serve", "python -m pytest",
                   "python scripts/", 'pip install -e ".[', "--config=configs/quickstart.py:lora"):
    assert expected in texts, f"no README command contains {expected!r}"
  assert len(FIELDS) >= MIN_FIELDS, FIELDS
  assert len(PATHS) >= MIN_PATHS, PATHS
  assert len(SECTION_REFS) >= MIN_SECTIONS, SECTION_REFS


@pytest.mark.parametrize("command", COMMANDS, ids=_ids([_command_label(c) for c in COMMANDS]))
def test_readme_command(command):
  """Everything the command names exists and takes what README gives it (module docstring)."""
  problems = command_problems(command.text)
  assert not problems, (f"README.md line {command.line}: `{command.text}`:\n  "
                        + "\n  ".join(problems))


@pytest.mark.parametrize("line,key,value", FIELDS,
                         ids=_ids([f"L{line}-{key}" for line, key, _ in FIELDS]))
def test_readme_config_field(line, key, value):
  """A config field the prose names exists, and a value shown for it is a valid one."""
  shown = key if value is None else f"{key}={value}"
  problems = field_problems(key, value)
  assert not problems, f"README.md line {line}: `{shown}`:\n  " + "\n  ".join(problems)


def test_readme_paths_exist():
  """Every repository path README names and every relative link target exists."""
  missing = [f"README.md line {line}: {path}" for line, path in PATHS
             if not os.path.exists(os.path.join(ROOT, path))]
  assert not missing, "README names paths that do not exist:\n  " + "\n  ".join(missing)


def test_readme_docs_sections_exist():
  """Every docs section README quotes ("§" and ``docs/X.md, "Name"``) is a heading there."""
  missing = [f"README.md line {line}: {problem}" for line, doc, name in SECTION_REFS
             if (problem := section_problem(doc, name))]
  assert not missing, "README quotes docs sections that do not exist:\n  " + "\n  ".join(missing)


NEGATIVE = [  # (a made-up command, what its report must name)
    (f"{QUICKSTART_TRAIN} --workdir=/tmp/x --config.train.no_such_field=1", "no_such_field"),
    (f"{QUICKSTART_TRAIN} --config.rollout.n=0", "rollout.n"),
    (f"{QUICKSTART_TRAIN} --config.data.selector=dapo|no_such_selector", "no_such_selector"),
    (f"{QUICKSTART_TRAIN}:no_such_arg", "no_such_arg"),
    ("python -m rl_jax.train --config=configs/no_such.py --workdir=/tmp/x", "no_such.py"),
    ("python -m rl_jax.train --workdir=/tmp/x --no_such_flag=1", "no_such_flag"),
    ("python scripts/bench_paged.py --rounds 2 --no-such-flag", "--no-such-flag"),
    ("python scripts/bench_tunix.py --prefix-attention sideways", "sideways"),
    ("python scripts/bench_async.py throughput --devices 3", "--devices"),
    ("python scripts/bench_async.py no_such_sub --repeats 3", "no_such_sub"),
    ("python scripts/bench_async.py --repeats 3", "--repeats"),
    ("python scripts/no_such_script.py --x 1", "no_such_script.py"),
    ("python -m rl_jax.no_such_module", "rl_jax.no_such_module"),
    ("python -m rl_jax.serve --model=DIR/hf --no-such-flag", "--no-such-flag"),
    ('pip install -e ".[serve,no_such_extra]"', "no_such_extra"),
    ("bash scripts/no_such.sh", "no_such.sh"),
]


@pytest.mark.parametrize("command,expected", NEGATIVE, ids=[e for _, e in NEGATIVE])
def test_checker_reports_what_does_not_exist(command, expected):
  """The checker is not vacuous: a made-up field, flag, value, script, module or extra is
  reported, naming what is wrong."""
  problems = command_problems(command)
  assert problems and any(expected in p for p in problems), (command, problems)


def test_field_and_section_checks_report_what_does_not_exist():
  assert any("no_such_field" in p for p in field_problems("model.lora.no_such_field", None))
  assert any("int3" in p for p in field_problems("model.lora.quant", "int8|int3"))
  assert any("'abc'" in p for p in field_problems("train.cpu_temp_block_mib", "abc"))
  assert field_problems("model.lora.rank", "r") == []  # a placeholder
  assert "no section" in section_problem("docs/BENCHMARKS.md", "No such section")
  assert section_problem("docs/AGENTS.md", "Serving a checkpoint") is None  # "## 3. Serving..."
  assert section_problem("docs/BENCHMARKS.md", "LoRA") is None  # starts "## LoRA quickstart"
  assert "does not exist" in section_problem("docs/NO_SUCH.md", "x")
