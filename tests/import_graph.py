"""The import graph of a package, read from source with ``ast`` (module-level and
function-level imports alike), and a cycle finder. Used by the structure tests."""

from __future__ import annotations

import ast
import pathlib


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
  """``{dotted module name: source file}`` for every module under the package at ``root``
  (subpackages included; a package is its ``__init__.py``)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join([package] + parts)] = path
  return out


def imported(module: str, known: set[str], source: str, is_package: bool = False) -> set[str]:
  """The modules of ``known`` that ``module`` (whose text is ``source``) imports anywhere."""
  out = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative import
        anchor = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
          anchor = anchor.rsplit(".", 1)[0]
        base_name = f"{anchor}.{node.module}" if node.module else anchor
      else:
        base_name = node.module or ""
      # ``from pkg import sub`` imports the submodule; ``from pkg import name`` needs pkg.
      subs = [f"{base_name}.{a.name}" for a in node.names]
      names = [n for n in subs if n in known] or [base_name]
    else:
      continue
    out |= {n for n in names if n in known and n != module}
  return out


def graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """``{module: modules of the package it imports}``."""
  files = modules(root, package)
  known = set(files)
  return {m: imported(m, known, f.read_text(), f.name == "__init__.py")
          for m, f in files.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
  """One cycle of ``g`` as a closed path ``[a, b, ..., a]``, or None if ``g`` is acyclic."""
  state: dict[str, int] = {}  # 1 on the stack, 2 done
  stack: list[str] = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(g[node]):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(g):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None
