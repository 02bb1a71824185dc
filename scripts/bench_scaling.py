"""How the trainer's RL update scales over a mesh of 1/2/4/8 devices, read from compiled programs.

Nothing is run: for each device count n the real ``train.make_rl_update`` step (the one the
training loop calls) is lowered and compiled for n fake host devices, with the state and the
batch given as shapes carrying the trainer's own shardings (``train.abstract_state`` and
``layout.rows``, exactly what ``init_state`` / ``layout.put`` produce), and three things are
read off the compiled program:

* FLOPs per device (``cost_analysis()["flops"]``), and their ratio to (1-device FLOPs / n):
  1.0 means the work is split evenly with nothing recomputed.
* Bytes each device sends through collectives in one step, parsed from ``as_text()`` (the
  partitioned, per-device HLO). An op inside a ``while`` loop (the scan over layers) counts
  once per iteration (its ``known_trip_count``). Cost model: ring algorithms over the op's
  replica group of k devices, S = the op's result bytes (per device):

      all-gather          (k-1)/k * S        (S is the gathered result)
      all-reduce        2*(k-1)/k * S        (reduce-scatter + all-gather of the operand)
      reduce-scatter      (k-1)   * S        (= (k-1)/k * operand bytes)
      all-to-all          (k-1)/k * S
      collective-permute          S          (each device sends its buffer once)

* The FSDP ideal, for comparison: parameters all-gathered once for the forward and once
  again for the backward, gradients reduce-scattered once, over the fsdp group of f devices:
  3*(f-1)/f * parameter bytes; with r = n/f replicas on the other axes (``--sequence``) the
  gradient shards are also all-reduced across them: + 2*(r-1)/r * parameter bytes / f.
* Peak memory per device from ``memory_analysis()``: argument + output + temp - alias bytes
  (the state is donated, so outputs alias arguments), and temp alone.

Usage::

    python scripts/bench_scaling.py                      # hidden 256, 4 layers, G=8 M=8 R=64
    python scripts/bench_scaling.py --sequence 1,2,4 --json /tmp/scaling.json
    python scripts/bench_scaling.py --small              # tiny model, a few seconds a row
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import config_utils, losses, train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
MB = 2 ** 20

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_COMP_START = re.compile(r"^(?:ENTRY )?%([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (" + "|".join(COLLECTIVES) +
                    r")(-start)?\(")
_WHILE = re.compile(r"\bwhile\(.*\bbody=%([^\s,]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"\b(?:calls|to_apply|condition|true_computation|false_computation)=%"
                    r"([^\s,]+)|branch_computations=\{([^}]*)\}")


# ----------------------------------------------------------------------- HLO collectives
def _array_bytes(text: str) -> float:
  """Total bytes of every array type (``f32[4,256]``) written in ``text``."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(text):
    size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
    if size is None:
      continue
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _split_tuple(text: str) -> list[str]:
  """Top-level elements of a tuple type ``(a, (b, c), d)``; a non-tuple is one element."""
  text = text.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, cur = [], 0, []
  for ch in text[1:-1]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  parts.append("".join(cur))
  return [p for p in (re.sub(r"/\*.*?\*/", "", p).strip() for p in parts) if p]


def group_size(line: str, n: int) -> int:
  """Devices in the op's replica group (``replica_groups`` in any of XLA's spellings)."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:  # mesh['axis_0'=1,'axis_1'=8] {'axis_1'}: the group spans the named axes
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
  if m:  # iota form [groups, group_size]<=[...]
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  if m:
    return len([x for x in m.group(1).split(",") if x.strip()])
  return n  # {} or absent: every device


def _ring_bytes(kind: str, result_bytes: float, k: int) -> float:
  if k <= 1:
    return 0.0
  return {"all-gather": (k - 1) / k, "all-reduce": 2 * (k - 1) / k,
          "reduce-scatter": k - 1, "all-to-all": (k - 1) / k,
          "collective-permute": 1.0}[kind] * result_bytes


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  comps, name, entry = {}, None, None
  for line in hlo.splitlines():
    m = _COMP_START.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)
  return comps, entry


def collective_bytes(hlo: str, n: int) -> dict:
  """Per-device bytes sent per step by each kind of collective (cost model in the module
  docstring), the number of executed ops of each kind, and whether any loop had an unknown
  trip count (then its body is counted once)."""
  comps, entry = _computations(hlo)
  edges = collections.defaultdict(list)
  unknown_trip = False
  for name, lines in comps.items():
    for line in lines:
      w = _WHILE.search(line)
      if w:
        trip = _TRIP.search(line)
        unknown_trip |= trip is None
        edges[name].append((w.group(1), int(trip.group(1)) if trip else 1))
      for single, branches in _CALLS.findall(line):
        for callee in ([single] if single else re.findall(r"%([^\s,]+)", branches)):
          edges[name].append((callee, 1))
  runs = collections.Counter()

  def visit(comp, times):
    runs[comp] += times
    for callee, mult in edges.get(comp, ()):
      if callee in comps:
        visit(callee, times * mult)

  visit(entry, 1)
  sent = dict.fromkeys(COLLECTIVES, 0.0)
  count = dict.fromkeys(COLLECTIVES, 0)
  for name, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m or not runs[name]:
        continue
      result, kind, start = m.groups()
      if start:  # async: the result tuple holds (operands..., outputs..., [contexts])
        parts = _split_tuple(result)
        if kind == "all-gather":
          parts = parts[len(parts) // 2:]
        elif kind == "collective-permute":
          parts = parts[1:2]
        result = ", ".join(parts)
      sent[kind] += runs[name] * _ring_bytes(kind, _array_bytes(result), group_size(line, n))
      count[kind] += runs[name]
  return {"bytes": sent, "ops": count, "unknown_trip_count": unknown_trip}


# --------------------------------------------------------------------- the compiled step
def model_overrides(args) -> list[str]:
  return [f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.intermediate}",
          f"model.num_layers={args.layers}", f"model.num_heads={args.heads}",
          f"model.num_kv_heads={args.kv_heads}", f"model.head_dim={args.head_dim}",
          f"model.max_position_embeddings={24 + args.new_tokens}",
          f"train.batch_groups={args.groups}", f"rollout.n={args.samples}",
          f"rollout.max_new_tokens={args.new_tokens}", "sft.steps=0", "train.eval_every=0",
          "log.tensorboard=False"]


def compile_update(args, n: int, seq: int, rules: str):
  """(compiled RL update, Setup, abstract state) for n devices and a sequence axis size."""
  config = config_utils.load_config(QUICKSTART, model_overrides(args) + [
      f"mesh.num_devices={n}", f"mesh.rules={rules}", f"mesh.shape.sequence={seq}"])
  setup = train.build_setup(config)
  layout = train.make_layout(setup)
  state = train.abstract_state(setup)
  G, M, R, P = args.groups, args.samples, args.new_tokens, setup.prompt_len
  rows = layout.rows(G)  # what layout.put gives every batch array (leading axis G)

  def arr(shape, dtype):
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=rows)

  inputs = losses.ObjectiveInputs(rewards=arr((G, M), np.float32), mask=arr((G, M, R), bool),
                                  old_logp=arr((G, M, R), np.float32),
                                  behaviour_logp=arr((G, M, R), np.float32))
  batch = train.UpdateBatch(arr((G, P), np.int32), arr((G,), np.int32),
                            arr((G, M, R), np.int32), inputs,
                            losses.Advantages(arr((G, M), np.float32)))
  update = train.make_rl_update(setup, layout)
  compiled = update.lower(state.params, state.opt_state, state.value_params,
                          state.value_opt_state, batch).compile()
  return compiled, setup, state


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def fsdp_ideal(param_bytes: float, n: int, fsdp: int) -> float:
  r = n // fsdp
  return 3 * (fsdp - 1) / fsdp * param_bytes + 2 * (r - 1) / r * param_bytes / fsdp


def measure(args, n: int, seq: int) -> dict:
  t0 = time.perf_counter()
  compiled, setup, state = compile_update(args, n, seq, args.rules)
  mesh = dict(setup.mesh.shape)
  param_bytes = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)))
  mem = compiled.memory_analysis()
  coll = collective_bytes(compiled.as_text(), n)
  return {
      "n": n, "sequence": seq, "mesh": mesh, "flops": _flops(compiled),
      "collective_bytes": coll["bytes"], "collective_ops": coll["ops"],
      "unknown_trip_count": coll["unknown_trip_count"],
      "collective_total": sum(coll["bytes"].values()),
      "fsdp_ideal": fsdp_ideal(param_bytes, n, mesh["fsdp"]), "param_bytes": param_bytes,
      "peak_bytes": (mem.argument_size_in_bytes + mem.output_size_in_bytes +
                     mem.temp_size_in_bytes - mem.alias_size_in_bytes),
      "temp_bytes": mem.temp_size_in_bytes, "compile_s": time.perf_counter() - t0,
  }


def run(args) -> list[dict]:
  rows, base = [], None
  for seq in args.sequence:
    for n in args.devices:
      if n % seq:
        continue
      try:
        row = measure(args, n, seq)
      except Exception as e:  # pylint: disable=broad-except
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        row = {"n": n, "sequence": seq, "error": f"{type(e).__name__}: {first}"}
      if "error" not in row and n == 1 and seq == 1:
        base = row["flops"]
      rows.append(row)
      print(f"  n={n} sequence={seq}: " + (row.get("error") or f"{row['compile_s']:.1f} s"),
            file=sys.stderr, flush=True)
  for row in rows:
    if "error" not in row and base:
      row["flops_ratio"] = row["flops"] / (base / row["n"])
  return rows


def table(rows: list[dict]) -> str:
  head = ("| n | mesh (data×fsdp×seq×tensor) | GFLOP / device | vs 1-device / n | "
          "all-gather MB | all-reduce MB | reduce-scatter MB | other MB | collectives MB | "
          "FSDP ideal MB | vs ideal | peak MB / device | temp MB |")
  lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['n']} | sequence={r['sequence']} | n/a: {r['error']} |"
                   + " |" * 10)
      continue
    m, b = r["mesh"], r["collective_bytes"]
    other = b["all-to-all"] + b["collective-permute"]
    ratio = r["collective_total"] / r["fsdp_ideal"] if r["fsdp_ideal"] else float("nan")
    ratio_s = "—" if not r["fsdp_ideal"] else f"{ratio:.2f}x"
    lines.append(
        f"| {r['n']} | {m['data']}×{m['fsdp']}×{m['sequence']}×{m['tensor']} | "
        f"{r['flops'] / 1e9:.3f} | {r.get('flops_ratio', float('nan')):.3f} | "
        f"{b['all-gather'] / MB:.1f} | {b['all-reduce'] / MB:.1f} | "
        f"{b['reduce-scatter'] / MB:.1f} | {other / MB:.1f} | "
        f"{r['collective_total'] / MB:.1f} | {r['fsdp_ideal'] / MB:.1f} | {ratio_s} | "
        f"{r['peak_bytes'] / MB:.1f} | {r['temp_bytes'] / MB:.1f} |")
  return "\n".join(lines)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--devices", type=_ints, default=[1, 2, 4, 8])
  ap.add_argument("--sequence", type=_ints, default=[1],
                  help="sizes of the sequence mesh axis to try, e.g. 1,2,4")
  ap.add_argument("--rules", default="fsdp")
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--intermediate", type=int, default=None, help="default 3 x hidden")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
  ap.add_argument("--groups", type=int, default=8, help="G, groups per update")
  ap.add_argument("--samples", type=int, default=8, help="M, samples per group")
  ap.add_argument("--new-tokens", type=int, default=64, help="R, response tokens")
  ap.add_argument("--small", action="store_true",
                  help="tiny model (hidden 32, 1 layer, M=2, R=4) for a smoke test")
  ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
  args = ap.parse_args(argv)
  if args.small:
    args.hidden, args.layers, args.heads, args.kv_heads = 32, 1, 2, 1
    args.samples, args.new_tokens = 2, 4
    args.intermediate, args.head_dim = 64, 16
  args.intermediate = args.intermediate or 3 * args.hidden
  args.head_dim = args.head_dim or args.hidden // args.heads
  if max(args.devices) > jax.device_count():
    ap.error(f"only {jax.device_count()} devices")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  print(f"RL update (GRPO), hidden {args.hidden}, {args.layers} layers, intermediate "
        f"{args.intermediate}, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
        f"G={args.groups} M={args.samples} R={args.new_tokens}, rules={args.rules}; "
        f"JAX {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices",
        flush=True)
  rows = run(args)
  text = table(rows)
  print(text)
  if any(r.get("unknown_trip_count") for r in rows):
    print("note: a loop without a known trip count was counted once", flush=True)
  result = {"args": {k: v for k, v in vars(args).items()}, "jax": jax.__version__,
            "rows": rows, "table": text}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
