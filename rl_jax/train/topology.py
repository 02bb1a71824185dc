"""Compile every program of a run for a TPU topology this host does not have, and say what
fits and how fast XLA expects it to run.

    python -m rl_jax.train --config=configs/quickstart.py --workdir=/tmp/plan \
        --config.train.dry_run=True --config.dry_run.topology=v5e:2x2

``dry_run.topology`` names a TPU slice by its chips (``v5e:2x2`` is 4 chips; ``v5p:2x2x2``
is 8 chips, sold as v5p-16; ``v6e:2x4`` is 8 chips), ``dry_run.num_slices`` how many such
slices the job spans. With ``libtpu`` installed (``pip install -e ".[tpu]"``) JAX describes
that topology's chips as abstract devices (``jax.experimental.topologies``) and the TPU
compiler (XLA:TPU, and Mosaic for the Pallas kernels) compiles for them on any host, CPU
included; nothing is placed on a device and no weight is read (``model.hf_path`` needs only
its ``config.json`` and tokenizer files).

The run is built as it would be on that slice (``context.build_setup`` over the topology's
devices: the config's ``mesh.shape`` and ``mesh.rules``, the sampler's mesh per host when
the slice has several hosts, its programs compiled for the same places of a one-host
topology of the chip, ids from 0, where a host's chips are not the first ids), and its
programs are compiled on abstract inputs (``jax.ShapeDtypeStruct`` with shardings): the
supervised step, the RL update (micro-batches included), the log-prob passes (policy,
reference, critic) as the memory plan compiles them (``memory.compile_steps``), and the
sampler's programs: the KV cache's allocation, the prefill of a step's groups at the
longest prompt (``prefill.admit``; with ``rollout.prompt_pages`` it also writes the prompt's
ids after its first onto pages, which the group's other samples fork), the decode loop at its
largest live-page bucket (``decode.decode``), multi-turn, the observations' incremental
prefill (``extend``), and where the engine re-prefills samples (a fixed pool's preemptions,
held groups, the time-to-live's evictions, long prompts on pages) that re-prefill at its
largest call (``prefill.resume``, and ``extend.prefill_tail`` for the chunks after the first
where the budget exceeds ``rollout.prefill_chunk``), with the response pool the engine
starts with (what a growing pool reaches is added from the page size). Kernels are the
target's: ``sharding.use`` hands the mesh's platform to ``pallas_kernels``
(``target_platform``), so the packed log-prob passes compile the Pallas TPU shared-prefix
kernel with Mosaic.

Printed per program (per chip): HBM (XLA's argument, temporary and output bytes, and the
peak with the rest of the resident state, ``memory``'s plan) against the chip's HBM, FLOPs,
bytes accessed and XLA's estimated seconds (``cost_analysis()["optimal_seconds"]``), and the
collectives of the compiled program by kind with their result bytes (each instruction of
the program text once: a collective in a loop body, e.g. the layer scan, counts once).
XLA's cost analysis also counts a loop body once: where its FLOPs fall below the model's
(``model_flops``: 2 x matmul weights x tokens per forward pass), the program's time is
scaled up by that ratio; where XLA gives no time (``optimal_seconds`` < 0, large programs
with loops), the roofline of its counts stands in. Then, for one RL step: the estimated
time (the sampler's programs: prefill + R decode steps + the turns' extensions; then the
log-prob passes + the updates), the estimated MFU
(each program's larger FLOPs count, XLA's or the model's, over that time, against the
chip's peak bf16 FLOP/s; and ``model_mfu``, the model's FLOPs alone), and whether the peak
fits. The times are estimates from XLA's analysis for that chip, not measurements.

The largest batch (``--config.dry_run.max_batch=True``): the largest ``train.batch_groups``
whose RL phase fits the chip's HBM (``max_batch``; ``max_batch_groups`` in the plan file, a
``largest train.batch_groups that fits`` line), among the multiples of ``batch_step``
(micro-batches of whole groups in every minibatch, each minibatch split evenly over the
mesh's batch axes). Each program's peak per chip is taken as affine in the batch (the
sampler's in its slots, a power of two of the groups): the RL programs compiled once more
at twice the batch (half when it does not fit) give each program's line, the largest
multiple every line fits is compiled to confirm it (one that does not fit is one more point,
and the search steps down), and the next multiple is predicted, or compiled, not to fit.
That is one to four more compiles of the RL programs (memory only), each about as long as
the plan's own (Qwen3-8B on v5p:2x2x2: 4-5 minutes on 2 CPU cores), up to
``MAX_BATCH_FACTOR`` x the configured batch. The lines are a guess, the compiles are the
check: the decode's peak grows faster than its slots where XLA:TPU lays out a larger batch
differently. Like the plan's verdict it counts the pool the decode is compiled with, not
a growing pool's largest (that note is separate).

Exit: the plan is printed and written to ``WORKDIR/topology_plan.json``; a run whose state or
any program's peak exceeds the chip's HBM raises ``TopologyPlanError`` (one ``error:`` line
naming the part or program and the bytes). An unknown topology name, a missing ``libtpu``
and a ``mesh.shape`` that does not fit the topology's chips are ``ConfigError`` lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath

from rl_jax import models
from rl_jax import rollout
from rl_jax import sharding
from rl_jax import storage
from rl_jax.errors import ConfigError, RLJaxError
from rl_jax.rollout import loop as loop_lib
from rl_jax.rollout import extend as extend_lib
from rl_jax.rollout import kv_cache
from rl_jax.rollout import records
from rl_jax.rollout import sampler as sampler_lib
from rl_jax.rollout import slots as slots_lib
from rl_jax.train import memory
from rl_jax.train import state as state_lib
from rl_jax.train.context import Setup, build_setup, mesh_shape
from rl_jax.train.layout import make_layout
from rl_jax.train.rollouts import TrainParts
from rl_jax.train.steps import make_step_fns

__all__ = ["CHIPS", "Built", "Chip", "TopologyPlanError", "PLAN_FILE", "TPU_INSTALL",
           "parse_topology", "topology_devices", "collectives", "mosaic_kernels",
           "program_cost", "build", "batch_peaks", "batch_step", "max_batch",
           "sampler_programs", "requested", "check_requested", "use_host_platform",
           "plan_topology", "format_plan", "decode_gather_note", "update_split_note",
           "batch_chips"]

GiB = 1 << 30
PLAN_FILE = "topology_plan.json"
TPU_INSTALL = 'pip install -e ".[tpu]"'


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation, per chip: ``hbm``, the HBM bytes XLA:TPU lets a program use (what
  its compiler reports as "available HBM" when a program does not fit; a little below the
  nominal ``hbm_nominal``), peak bf16 FLOP/s and HBM bandwidth (Google Cloud's published
  figures), the topology's dimensions, and the chips of one host (``host_bounds`` for
  multi-host slices; ``single_host``: the most chips one host holds)."""

  name: str
  hbm: int
  hbm_nominal: int
  flops: float
  hbm_bandwidth: float
  dims: int
  host_bounds: tuple[int, int, int]
  single_host: int


CHIPS = {
    "v5e": Chip("v5e", int(15.75 * GiB), 16 * GiB, 197e12, 819e9, 2, (2, 2, 1), 8),
    "v5p": Chip("v5p", int(95.74 * GiB), 95 * GiB, 459e12, 2765e9, 3, (2, 2, 1), 4),
    "v6e": Chip("v6e", int(31.25 * GiB), 32 * GiB, 918e12, 1640e9, 2, (2, 2, 1), 8),
}

_EXAMPLES = "v5e:2x2 (4 chips), v5p:2x2x2 (8 chips, sold as v5p-16), v6e:2x4 (8 chips)"
# the sampler's programs (``extend``: multi-turn observations; ``resume``, ``resume_tail``:
# the re-prefill of preempted, held or evicted samples)
SAMPLER = ("kv_init", "prefill", "extend", "decode", "resume", "resume_tail")
# what shrinks the sampler's programs (named in the one-line error of one that does not fit)
SAMPLER_KNOBS = ("rollout.kv_pages (a fixed pool; the engine preempts beyond it), "
                 "rollout.kv_memory_fraction, train.batch_groups, rollout.n, "
                 "rollout.max_new_tokens, rollout.prefill_chunk, a larger mesh.shape.tensor")


class TopologyPlanError(RLJaxError, MemoryError):  # pylint: disable=invalid-name
  """The run's state or a program does not fit the topology's chips (one line)."""


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
  """(chip, chip grid) of a topology name ``<generation>:<AxB[xC]>`` (counting chips).

  Raises:
    ConfigError: one line, for an unknown generation or a malformed grid.
  """
  m = re.fullmatch(r"\s*(v\w+):(\d+(?:x\d+)*)\s*", str(name))
  chip = CHIPS.get(m.group(1)) if m else None
  grid = tuple(int(x) for x in m.group(2).split("x")) if m else ()
  if chip is None or len(grid) != chip.dims or min(grid) < 1:
    known = ", ".join(f"{c.name}:{'x'.join('ABC'[:c.dims])}" for c in CHIPS.values())
    raise ConfigError(f"dry_run.topology={name!r} is not a TPU topology this dry run knows; "
                      f"name a slice by its chips ({known}), e.g. {_EXAMPLES}")
  return chip, grid


def _host_bounds(chip: Chip, grid: tuple[int, ...]) -> tuple[int, int, int]:
  """Chips per host along each axis: one host for a slice of at most ``single_host`` chips
  (v5e-8 and v6e-8 are single machines), else the generation's host block."""
  full = tuple(grid) + (1,) * (3 - len(grid))
  return full if math.prod(grid) <= chip.single_host else chip.host_bounds


def _libtpu_path() -> str | None:
  """Where ``libtpu`` is installed (None: not installed)."""
  spec = importlib.util.find_spec("libtpu")
  return None if spec is None else (spec.origin or "libtpu")


@contextlib.contextmanager
def _quiet_libtpu(chip: Chip, chips: int) -> Iterator[None]:
  """While libtpu loads off a TPU VM: an accelerator type and a one-host worker list for it
  to find (unset, it prints warnings and an error line about the host's metadata), and
  ``ALLOW_MULTIPLE_LIBTPU_LOAD`` (another process holding libtpu's lock file, e.g. a test
  worker, would make the load fail). Variables the user set are kept; the two libtpu hints
  are removed again afterwards (``TPU_WORKER_HOSTNAMES`` also steers ``rl_jax.distributed``)."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  kind = {"v5e": f"v5litepod-{chips}", "v5p": f"v5p-{2 * chips}"}.get(chip.name,
                                                                     f"{chip.name}-{chips}")
  hints = {"TPU_ACCELERATOR_TYPE": kind, "TPU_WORKER_HOSTNAMES": "localhost"}
  added = [k for k in hints if k not in os.environ]
  os.environ.update({k: hints[k] for k in added})
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def topology_devices(name: str, num_slices: int = 1) -> list:
  """The abstract devices (one per chip) of ``num_slices`` slices of topology ``name``.

  Raises:
    ConfigError: one line, for an unknown topology, a missing libtpu (with the install
      command) or a topology libtpu rejects.
  """
  chip, grid = parse_topology(name)
  if _libtpu_path() is None:
    raise ConfigError(f"dry_run.topology={name}: compiling for a TPU topology needs libtpu, "
                      f"which is not installed; install it with {TPU_INSTALL}")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  chips = math.prod(grid)
  try:
    with _quiet_libtpu(chip, chips):
      topo = topologies.get_topology_desc(
          platform="tpu", topology_name=f"{chip.name}:{'x'.join(map(str, grid))}",
          chips_per_host_bounds=_host_bounds(chip, grid), num_slices=int(num_slices))
  except (RuntimeError, ValueError, NotImplementedError) as e:
    if "not installed" in str(e):
      raise ConfigError(f"dry_run.topology={name}: compiling for a TPU topology needs "
                        f"libtpu, which JAX cannot load; install it with {TPU_INSTALL}"
                        ) from None
    raise ConfigError(f"dry_run.topology={name} (num_slices={num_slices}): libtpu rejects "
                      f"it: {' '.join(str(e).split())[:300]}") from None
  devices = list(topo.devices)
  if len(devices) != chips * num_slices:
    raise ConfigError(f"dry_run.topology={name}: libtpu describes {len(devices)} devices "
                      f"for {chips} chips x {num_slices} slice(s); this dry run plans one "
                      "device per chip")
  return devices


def _check_mesh(config: ml_collections.ConfigDict, chips: int) -> None:
  """``mesh.shape`` (with ``mesh.num_devices`` / ``mesh.rollout_devices``) against the
  topology's chips, one line naming both."""
  c = config
  name, slices = c.dry_run.topology, c.dry_run.num_slices
  train = (c.mesh.num_devices or chips - c.mesh.rollout_devices)
  what = (f"the {chips} chips of dry_run.topology={name}"
          + (f" x num_slices={slices}" if slices > 1 else ""))
  if c.mesh.num_devices > chips or c.mesh.rollout_devices >= chips:
    raise ConfigError(f"mesh.num_devices={c.mesh.num_devices} / mesh.rollout_devices="
                      f"{c.mesh.rollout_devices} do not fit {what}")
  try:
    mesh_shape(c.mesh.shape, train)
  except ConfigError as e:
    raise ConfigError(f"{e} (the mesh must divide {what}"
                      + (f" less mesh.rollout_devices={c.mesh.rollout_devices}"
                         if c.mesh.rollout_devices else "") + ")") from None


# ------------------------------------------------------------------------ program analysis
_COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-permute", "ragged-all-to-all")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple's elements summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += math.ceil(n * bits / 8)
  return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Collectives of a compiled program's HLO text by kind: ``{kind: {"count", "bytes"}}``,
  bytes of each instruction's result per device.

  Each instruction counts once (one inside a loop body once, whatever the trip count). An
  asynchronous ``-start`` counts (its ``-done`` does not), with the second element of its
  result tuple (operand, result, contexts...). XLA:TPU fuses a reduce-scatter into a
  ``fusion`` calling an ``all-reduce-scatter`` computation: it counts as one
  ``reduce-scatter`` of the fusion's result, and the ``all-reduce`` inside is not counted.
  XLA:TPU also decomposes the FSDP gathers and gradient reductions next to a matmul into
  rings of ``collective-permute`` steps overlapped with it (collective matmul): those count
  as ``collective-permute``.
  """
  out: dict[str, dict[str, int]] = {}
  inside = ""

  def add(kind: str, nbytes: int) -> None:
    entry = out.setdefault(kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += nbytes

  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      inside = head.group("name")
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op, shape = m.group("op"), m.group("shape")
    if op == "fusion" and "calls=%all-reduce-scatter" in m.group("rest"):
      add("reduce-scatter", _shape_bytes(shape))
      continue
    if inside.startswith("all-reduce-scatter"):
      continue
    base = op[:-len("-start")] if op.endswith("-start") else op
    if base not in _COLLECTIVE_OPS:
      continue
    if op.endswith("-start") and shape.startswith("("):  # (operand, result, [contexts])
      parts = _ARRAY.findall(shape)
      shape = f"{parts[1][0]}[{parts[1][1]}]" if len(parts) > 1 else shape
    add(base, _shape_bytes(shape))
  return out


_MOSAIC = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w\-]+?)(?:\.\d+)*\s*=.*"
                     r'custom_call_target="tpu_custom_call"', re.M)


def mosaic_kernels(hlo_text: str) -> list[str]:
  """Names of the Mosaic (Pallas TPU) kernels compiled into a program: its
  ``tpu_custom_call`` instructions, numbering dropped (e.g. ``shared_prefix_attention_fwd``)."""
  return sorted({m.group("name") for m in _MOSAIC.finditer(hlo_text)})


def program_cost(compiled) -> dict[str, Any]:
  """XLA's cost analysis of one compiled program, per device: ``flops``, ``bytes`` (bytes
  accessed), ``seconds`` (XLA's estimated run time on the target, ``optimal_seconds``; None
  where the compiler gives none), its ``collectives`` and ``kernels`` (``mosaic_kernels``)."""
  ca = compiled.cost_analysis() or {}
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  seconds = ca.get("optimal_seconds")
  text = compiled.as_text()
  return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0)),
          "seconds": None if seconds is None or seconds < 0 else float(seconds),
          "collectives": collectives(text), "kernels": mosaic_kernels(text)}


# ----------------------------------------------------------------------------- model FLOPs
def matmul_params(cfg) -> tuple[float, float]:
  """(weights one token's trunk multiplies by, the LM head's D·V): every layer matrix, the
  MoE experts at X/E of theirs (a token runs X of the E); norms and the embedding lookup
  are no matmuls. A quantised base counts as its float shapes."""
  c = cfg.replace(quant="", lora_rank=0)
  shapes = models.param_shapes(c)
  trunk = 0.0
  for key, tree in (("layers", shapes["layers"]), ("mlp", shapes.get("mlp", {}))):
    for name, shape in tree.items():
      if len(shape) >= 3:  # [L, ...] matrices, not norms or biases
        trunk += math.prod(shape)
  for name, shape in shapes.get("moe", {}).items():
    share = c.num_experts_per_tok / c.num_experts if name.startswith("expert_") else 1.0
    trunk += math.prod(shape) * share
  return trunk, float(c.hidden_size * c.vocab_size)


def model_flops(s: Setup, prog: str, sampler: dict | None = None) -> float:
  """Model FLOPs per chip of one call of a program: 2 x the matmul weights x the tokens of
  each forward pass (the trunk on every token, the LM head on the tokens scored), x3 for a
  training step (backward = 2 forwards) plus a forward with ``model.remat`` on; attention
  scores left out. A cross-check of XLA's count, which takes a loop body (the layer scan,
  the log-prob chunks) once. ``sampler``: the sampler program's shapes (``sampler_programs``)."""
  geo = s.geometry
  trunk, head = matmul_params(s.model_cfg)
  rows, M, R, P = geo.rows, geo.row_size, geo.new_tokens, s.prompt_len
  per_row = P + M * R if s.train.shared_prefix else M * (P + R)  # the packed row
  train = 3.0 + (1.0 if s.model_cfg.remat != "none" else 0.0)
  if prog in ("logprobs", "ref_logprobs", "values"):
    flops = 2 * (trunk * rows * per_row + head * rows * M * R)
  elif prog == "teacher_logprobs" and s.teacher_cfg is not None:  # its own shape
    t_trunk, t_head = matmul_params(s.teacher_cfg)
    flops = 2 * (t_trunk * rows * per_row + t_head * rows * M * R)
  elif prog == "rl_update":
    g = rows // s.train.minibatches
    flops = 2 * train * (trunk * g * per_row + head * g * M * R)
  elif prog == "sft":
    T = P + s.rollout.max_new_tokens
    flops = 2 * train * (trunk + head) * s.sft.batch_size * T
  elif sampler is not None and prog in ("prefill", "extend"):  # logits of each row's last
    flops = 2 * (trunk * sampler["rows"] * sampler["tokens"] + head * sampler["rows"])
  elif sampler is not None and prog in ("resume", "resume_tail"):  # K/V only, no logits
    flops = 2 * trunk * sampler["rows"] * sampler["tokens"]
  elif sampler is not None and prog == "decode":
    flops = 2 * (trunk + head) * sampler["rows"]
  else:
    return 0.0
  mesh = s.sampler_mesh if prog in SAMPLER else s.mesh
  return flops / mesh.size


# --------------------------------------------------------------------- the sampler's programs
def _spec(x, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype")
                              else x.dtype, sharding=sharding)


def _sampler_params(t: TrainParts, rl_state, engine) -> Any:
  """ShapeDtypeStructs of the weights the sampler decodes with, as ``prepare_params``
  lays them out on the sampler's mesh (LoRA with ``rollout.lora_merge``: the merged base;
  on a sampler mesh of its own, the projections in the compute dtype)."""
  params = rl_state.params
  if t.layout.merge is not None:
    params = models.lora.strip(params)
  if t.layout.quantize is not None:  # rollout.weight_dtype: the quantised projections
    params = jax.eval_shape(t.layout.quantize, params)
  mesh, rules = engine.ctx
  target = models.param_shardings(engine.cfg, mesh, rules)
  if not models.lora.split(params)[1]:
    target = models.lora.strip(target)
  want = jnp.dtype(engine.cfg.param_dtype)
  cast = lambda x: want if x.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else x.dtype
  params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, cast(x), sharding=sh),
                        params, target)
  if t.layout.decodes_copy:  # ``Layout.narrowed``
    params = models.cast_projections(engine.cfg, params)
  return params


def _compile(name: str, lowered):
  """``lowered.compile()``; XLA:TPU refusing it for the HBM is a ``MemoryPlanError`` line
  naming the program."""
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if not memory.is_out_of_memory(e):
      raise
    raise memory.MemoryPlanError(f"program {name} does not fit: {memory.compiler_message(e)}; "
                                 f"shrink with {SAMPLER_KNOBS}") from None


def _host_topology_mesh(s: Setup) -> jax.sharding.Mesh:
  """The mesh the sampler's programs are compiled for: ``s.sampler_mesh``, or on a slice of
  several hosts whose host's chips are not ids 0..k-1 (host 0 of ``v6e:8x8`` holds chips 0,
  1, 8 and 9, a 2x2 block of the grid) the same mesh over the chips at the same places of a
  one-host topology of the same generation (ids 0..k-1). Compiling a 4-chip program for
  host 0's own ids, libtpu aborts the process (SIGABRT: "Unexpected device_id 8 [0:2] in
  replica group (0,1,2,3) :: target has 4 device_id"). Only the dry run compiles this way:
  a real run's sampler compiles on its host's own devices."""
  mesh = s.sampler_mesh
  flat = list(mesh.devices.flat)
  if sorted(d.id for d in flat) == list(range(len(flat))):
    return mesh
  if len({d.process_index for d in flat}) != 1 or mesh is s.mesh:
    return mesh  # one process's devices only (context._sampler_mesh)
  chip, _ = parse_topology(s.dry_run.topology)
  bounds = chip.host_bounds[:chip.dims]
  name = f"{chip.name}:{'x'.join(map(str, bounds))}"
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  with _quiet_libtpu(chip, math.prod(bounds)):
    host = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        chips_per_host_bounds=chip.host_bounds, num_slices=1)
  where = lambda d, b: (tuple(int(c) % n for c, n in zip(d.coords, b)),
                        getattr(d, "core_on_chip", 0))
  by_place = {where(d, chip.host_bounds): d for d in host.devices}
  devices = np.vectorize(lambda d: by_place[where(d, chip.host_bounds)],
                         otypes=[object])(mesh.devices)
  return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def sampler_programs(t: TrainParts, rl_state, kv_fraction: float | None = None,
                     free: int = 0) -> tuple[dict[str, dict[str, Any]], dict]:
  """The sampler's programs of one RL step compiled for the sampler's mesh: ``kv_init``
  (the slots' KV cache and records), ``prefill`` (``admit`` of the step's groups at the
  longest prompt) and ``decode`` (one step of the decode loop at the largest live-page
  bucket: every sample's whole budget readable), with the pool the engine starts with
  (``rollout.kv_pages``; ``kv_fraction`` of ``free`` bytes, as ``rollout.kv_memory_fraction``
  sizes it from the free HBM at run time; or the growing pool's first size). Each entry:
  ``program`` (compiled), ``params`` (bytes per device of the weights among its
  arguments), ``calls`` per step and ``note``; and the pool (``pages`` it starts with,
  ``max_pages`` a growing pool reaches, ``page_size``, ``page_bytes`` per chip, ``slots``:
  the engine's group slots). On a slice of several hosts they are compiled for one host's
  chips numbered from 0 (``_host_topology_mesh``)."""
  mesh = _host_topology_mesh(t.setup)
  if mesh is not t.setup.sampler_mesh:
    t = t._replace(setup=dataclasses.replace(t.setup, sampler_mesh=mesh))
  engine, groups = memory.sampler_engine(t, None)
  NP = engine.R // engine.S  # pages of one sample's whole budget
  shards = engine.D * engine.Q  # a chip holds one shard of the pool
  if kv_fraction is not None and not t.setup.rollout.kv_pages:
    fit = int(kv_fraction * max(free, 0) // kv_cache.pool_bytes(engine.cfg, 1, engine.S))
    if fit < engine.M * NP // engine.Q:
      raise TopologyPlanError(
          f"rollout.kv_memory_fraction={kv_fraction} of the {free / GiB:.2f} GiB per chip the "
          f"state leaves free holds {fit} pages of {engine.S} tokens; one group needs "
          f"{engine.M * NP // engine.Q}")
    engine, groups = memory.sampler_engine(t, min(fit, engine.max_pool_pages // shards))
  mesh, _ = engine.ctx
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = _sampler_params(t, rl_state, engine)
  cfg, G, M, P, R = engine.cfg, engine.G, engine.M, engine.P, engine.R
  pool = engine.pool_pages
  agent = isinstance(engine, rollout.AgentEngine)
  identity = engine.pool_plan.in_place(pool)  # as both engines decide it
  init = _compile("kv_init", sampler_lib.init_state.lower(cfg, G, M, P, R, engine.ctx,
                                                          S=engine.S, pages=pool,
                                                          identity=identity))
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                       init.out_info)
  sp = jax.tree.map(lambda x: _spec(x, rep), engine.sp)
  i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  key = jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32"))
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
  Bn = min(G, records.pow2(min(groups, G), 4))  # the engine's admission bucket
  # its prompt bucket at the longest prompt (whole, also with the slot holding its first id)
  Pb = records.pow2(engine.max_prompt_len, 8)
  a, _ = loop_lib.admission(engine, [], Bn, Pb)
  adm = sampler_lib.Admission(**{k: _spec(v, rep) for k, v in a.items()})
  prefill = _compile("prefill", engine.admit_fn.lower(
      cfg, params, state, adm, sp, i32, key, filtered=engine.filtered, fresh=Bn == G,
      ctx=engine.ctx, identity=identity))
  rows = min(groups, G) * M
  weights = memory.tree_bytes(params)
  programs = {
      "kv_init": {"program": init, "params": 0, "calls": 1, "shape": {},
                  "note": f"{G} slots x {M} samples, pool {pool} pages of {engine.S}"},
      "prefill": {"program": prefill, "params": weights, "calls": 1,
                  "shape": {"rows": Bn, "tokens": Pb},
                  "note": f"{Bn} groups x {Pb} prompt tokens"},
  }
  if reprefills(engine, t.setup.rollout.partial):
    programs.update(_reprefill_programs(engine, params, state, rows, rep, weights))
  # one decode call (both engines' loop) at every page live
  decode = _compile("decode", sampler_lib.decode.lower(
      cfg, params, state, sp, i32, i32, i32, i32, filtered=engine.filtered, ctx=engine.ctx,
      live=NP, identity=identity))
  if agent:
    # and the observations' incremental prefill at its largest bucket (every sample of the
    # slots, the longest observation)
    C = min(R, records.pow2(engine.max_obs + 2, 16))
    Be = records.pow2(rows, 4)
    ext = extend_lib.Extension(*(_spec(np.zeros(shape, np.int32), rep) for shape in (
        (Be,), (Be,), (Be,), (Be, C), (Be,), (Be,))))
    extend = _compile("extend", extend_lib.extend.lower(
        cfg, params, state, ext, sp, i32, filtered=engine.filtered, ctx=engine.ctx))
    programs["decode"] = {"program": decode, "params": weights, "calls": R,
                          "shape": {"rows": rows},
                          "note": f"the turn loop at R={R} trajectory tokens, {NP} live pages"}
    programs["extend"] = {"program": extend, "params": weights, "calls": engine.max_turns - 1,
                          "shape": {"rows": Be, "tokens": C},
                          "note": f"{Be} samples x {C} observation tokens, each turn after "
                                  "the first"}
  else:
    programs["decode"] = {"program": decode, "params": weights, "calls": engine.max_new_tokens,
                          "shape": {"rows": rows},
                          "note": f"one step of the loop x R={engine.max_new_tokens} steps, "
                                  f"{NP} live pages"}
  kv = dict(pages=pool, max_pages=engine.max_pool_pages, page_size=engine.S,
            page_bytes=memory.pool_page_bytes(t.setup, engine.S), fixed=engine.fixed_pool,
            slots=G, shards=shards)
  return programs, kv


def reprefills(engine, partial: bool) -> bool:
  """Whether the engine's rollouts can re-prefill samples (``Loop.reprefill``): a fixed pool
  preempts, held groups (``rollout.partial``) come back, a time-to-live evicts waiting
  groups, or prompts on pages longer than the admission's bucket are re-prefilled."""
  return bool(engine.fixed_pool or partial or engine.prompt_pages
              or engine.ttl is not None)


def _reprefill_programs(engine, params, state, rows: int, rep, weights: int) -> dict:
  """The re-prefill at its largest call (``prefill.resume``): as many of the step's ``rows``
  samples as one call takes (``slots.call_fits``: no more positions than the admission's) at
  min(R, ``prefill_chunk``) positions each; and where R exceeds the chunk, the chunks after
  the first (``extend.prefill_tail``, attending the prompt and the pages before them). Not
  called every step: ``calls`` 0 (their time is not in the step's), but their peak counts in
  what fits."""
  G, M, R, C = engine.G, engine.M, engine.R, engine.prefill_chunk
  most, T = slots_lib.resume_shape(rows, R, G=G, M=M, R=R, chunk=C)
  Br = max(b for b, t in slots_lib.resume_shapes(G=G, M=M, R=R, P=engine.P, chunk=C)
           if t == T and b <= most)  # as many as one call takes (``call_fits``)
  res = sampler_lib.Resume(*(_spec(x, rep) for x in slots_lib.resume_rows(Br, T, G)))
  note = (f"re-prefill of {Br} samples x {T} positions (preempted, held or evicted "
          "samples; not every step)")
  progs = {"resume": {"program": _compile("resume", sampler_lib.resume.lower(
      engine.cfg, params, state, res, ctx=engine.ctx)), "params": weights, "calls": 0,
      "shape": {"rows": Br, "tokens": T}, "note": note}}
  if C is not None and R > C:
    start = _spec(np.zeros(Br, np.int32), rep)
    progs["resume_tail"] = {
        "program": _compile("resume_tail", extend_lib.prefill_tail.lower(
            engine.cfg, params, state, res, start, ctx=engine.ctx)),
        "params": weights, "calls": 0, "shape": {"rows": Br, "tokens": T},
        "note": f"its later chunks: {Br} samples x {T} positions after the first"}
  return progs


# ------------------------------------------------------------------------------- the command
def requested(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config`` asks for a topology dry run: ``train.dry_run`` and
  ``dry_run.topology`` set."""
  d = config.get("dry_run")
  return bool(config.train.get("dry_run") and d is not None and d.get("topology"))


def check_requested(config: ml_collections.ConfigDict) -> None:
  """``dry_run.topology`` without ``train.dry_run`` is a ``ConfigError``: a run trains on
  this job's own devices, never on a named topology."""
  d = config.get("dry_run")
  if d is not None and d.get("topology") and not config.train.get("dry_run"):
    raise ConfigError(f"dry_run.topology={d.topology} compiles the run for a TPU topology "
                      "without running it; add --config.train.dry_run=True (a training run "
                      "uses this job's own devices)")


def use_host_platform() -> None:
  """Before JAX starts its backends, for a topology dry run from the command line: JAX on
  this host's CPU (the programs are compiled for the topology's chips, nothing runs here;
  with libtpu installed JAX would otherwise try a local TPU first), unless the user set
  ``JAX_PLATFORMS``; and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` unless set (another process may
  hold libtpu)."""
  if "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# ----------------------------------------------------------------------------------- the plan
def _planned(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, list]:
  """The config the dry run builds, and notes on what it changed: abstract devices report
  no free memory, so a pool sized from it (``rollout.kv_memory_fraction``) is sized by the
  dry run itself (``sampler_programs``: the fraction of the HBM the resident state leaves)."""
  notes = []
  if config.rollout.get("kv_memory_fraction") is not None and not config.rollout.kv_pages:
    notes.append(f"rollout.kv_memory_fraction={config.rollout.kv_memory_fraction}: the KV pool "
                 "planned as that fraction of the HBM per chip the resident state leaves")
    config = ml_collections.ConfigDict(config.to_dict())
    config.rollout.kv_memory_fraction = None
  return config, notes


def _resident(plan: dict, phase: str) -> int:
  return sum(plan["state"][phase].values())


class Built(NamedTuple):
  """A run built for a topology: its trainer (no engine: nothing runs), the abstract
  states of its supervised (None without one) and RL phases, the chip and the devices."""

  trainer: TrainParts
  sft_state: Any
  rl_state: Any
  chip: Chip
  devices: list
  notes: list
  kv_fraction: float | None = None


def build(config: ml_collections.ConfigDict) -> Built:
  """The run of ``config`` built over ``config.dry_run.topology``'s abstract devices:
  meshes, shardings, abstract states and the jitted (not yet compiled) steps.

  Raises:
    ConfigError: an unknown topology, no libtpu, a mesh that does not fit the topology.
  """
  name, slices = config.dry_run.topology, int(config.dry_run.num_slices)
  chip, grid = parse_topology(name)
  _check_mesh(config, math.prod(grid) * slices)
  devices = topology_devices(name, slices)
  kv_fraction = config.rollout.get("kv_memory_fraction")
  config, notes = _planned(config)
  s = build_setup(config, devices)
  sft_steps = config.sft.steps
  knobs = (f"shrink with policy: {memory.KNOBS['policy']}; rl_optimizer: "
           f"{memory.KNOBS['rl_optimizer']}")
  policy = _policy_bytes(s)
  if policy > chip.hbm:
    raise TopologyPlanError(
        f"dry_run.topology={name}: the policy alone needs {_gib(policy)} per chip > "
        f"{_gib(chip.hbm)} ({chip.name} HBM per chip that XLA:TPU allows); {knobs}")
  try:  # abstract_state compiles the program that builds the state (for its shardings)
    abstract = state_lib.abstract_state(s)
    rl_state = state_lib.abstract_state(s, sft_steps + 1) if sft_steps else abstract
  except jax.errors.JaxRuntimeError as e:
    if not memory.is_out_of_memory(e):
      raise
    raise TopologyPlanError(
        f"dry_run.topology={name}: the run's state does not fit {_gib(chip.hbm)} per "
        f"{chip.name} chip (the policy is {_gib(policy)} of it): XLA:TPU refuses the "
        f"program that builds the state ({memory.compiler_message(e)}); {knobs}") from None
  layout = make_layout(s, abstract)
  t = TrainParts(setup=s, layout=layout, steps=make_step_fns(s, layout), engine=None)
  return Built(t, abstract if sft_steps else None, rl_state, chip, devices, notes,
               kv_fraction)


def _policy_bytes(s: Setup) -> int:
  """The policy's bytes per chip from its shapes and shardings (nothing compiled)."""
  shapes = jax.eval_shape(lambda: models.init_params(s.model_cfg, jax.random.key(0)))
  shardings = models.param_shardings(s.model_cfg, s.mesh, s.rules)
  return memory.tree_bytes(jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings))


def plan_topology(config: ml_collections.ConfigDict, workdir: str | None = None, *,
                  echo: bool = True) -> dict[str, Any]:
  """Compile the run of ``config`` for ``config.dry_run.topology``; print and (``workdir``)
  write the plan (``PLAN_FILE``). Returns the plan (a JSON-able dict, bytes per chip).

  Raises:
    ConfigError: an unknown topology, no libtpu, a mesh that does not fit the topology.
    TopologyPlanError: the state or a program's peak exceeds the chip's HBM (after the
      plan is printed and written, when the state fits).
  """
  name, slices = config.dry_run.topology, int(config.dry_run.num_slices)
  t0 = time.perf_counter()
  t, sft_state, rl_state, chip, devices, notes, kv_fraction = build(config)
  s = t.setup
  chips = len(devices)
  plan = memory.state_plan(t, sft_state, rl_state)
  where = f"{chip.name} HBM per chip that XLA:TPU allows"
  plan.update(capacity=chip.hbm, capacity_source=where)
  try:
    memory.check_state_fits(plan["state"], chip.hbm, where)
  except memory.MemoryPlanError as e:
    raise TopologyPlanError(f"dry_run.topology={name}: {e}") from None
  try:
    plan, programs, kv = _programs(t, plan, sft_state, rl_state, kv_fraction, chip)
  except memory.MemoryPlanError as e:
    raise TopologyPlanError(f"dry_run.topology={name}: {e}") from None
  out_kv = _grown_pool(kv, programs["decode"]["peak"], chip)
  if out_kv.get("note"):
    notes.append(out_kv["note"])
  out = dict(plan, topology=name, kv_pool_plan=out_kv, num_slices=slices, chips=chips,
             chip=dataclasses.asdict(chip),
             device_kind=devices[0].device_kind,
             hosts=len({d.process_index for d in devices}),
             sampler_mesh={k: int(v) for k, v in s.sampler_mesh.shape.items()},
             rules=s.rules, sampler_rules=s.sampler_rules, programs=programs, notes=notes,
             compile_s=round(time.perf_counter() - t0, 1))
  gather = decode_gather_note(out, s.model_cfg.num_kv_heads, config.mesh.rollout_devices)
  notes.extend(n for n in (gather, update_split_note(s)) if n)
  out["estimate"] = _estimate(s, out)
  if echo:  # the table first: the search below compiles the RL programs again
    print(format_plan(out), flush=True)
  if config.dry_run.get("max_batch", False):
    out["max_batch"] = max_batch(config, out, s)
    out["max_batch_groups"] = out["max_batch"]["groups"]
    if echo:
      print("  " + _max_batch_line(out["max_batch"], out["capacity"]), flush=True)
  if workdir is not None:
    epath.Path(storage.join(workdir, PLAN_FILE)).write_text(
        json.dumps(out, indent=1, sort_keys=True, default=str))
  _check_fits(out)
  return out


def _programs(t: TrainParts, plan: dict, sft_state, rl_state, kv_fraction: float | None,
              chip: Chip, costs: bool = True) -> tuple[dict, dict[str, dict], dict]:
  """(``plan`` with its compiled steps, each program's entry, the sampler's pool): every
  program of the run compiled on abstract inputs, its memory, its peak per chip (the
  resident state of its phase + what it adds) and, with ``costs``, XLA's cost analysis and
  time (``_time``).

  Raises:
    memory.MemoryPlanError: XLA:TPU refuses a program for the HBM.
  """
  s = t.setup
  compiled: dict[str, Any] = {}
  plan = memory.add_steps(t, plan, sft_state, rl_state, compiled)
  sampler, kv = sampler_programs(t, rl_state, kv_fraction, chip.hbm - _resident(plan, "rl"))
  programs = {}
  for prog, program in compiled.items():
    phase = "sft" if prog == "sft" else "rl"
    m = plan["steps"][prog]
    programs[prog] = dict(memory=m, phase=phase, peak=_resident(plan, phase) + m.get("extra", 0),
                          calls=_calls(s, prog), model_flops=model_flops(s, prog),
                          **(program_cost(program) if costs else {}))
  for prog, entry in sampler.items():
    m = memory.step_memory(entry["program"])
    own = m.get("argument", 0) - entry["params"]  # the KV cache and inputs: not in the state
    programs[prog] = dict(memory=m, phase="rl", peak=_resident(plan, "rl") + own + m["extra"],
                          calls=entry["calls"], note=entry["note"],
                          model_flops=model_flops(s, prog, entry["shape"]),
                          **(program_cost(entry["program"]) if costs else {}))
  if costs:
    for prog in programs.values():
      _time(prog, chip)
  return plan, programs, kv

# ----------------------------------------------------------------- the largest batch that fits
# what fits is searched up to this many times the configured train.batch_groups
MAX_BATCH_FACTOR = 64
_MAX_BATCH_COMPILES = 4  # plans compiled by the search beyond the configured one


def batch_chips(s: Setup) -> int:
  """The chips the training mesh's ``batch`` rule splits a batch's rows over."""
  axes = sharding.logical_to_spec(("batch",), s.rules, s.mesh, (s.mesh.size << 12,))[0] or ()
  return math.prod(s.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def update_split_note(s: Setup) -> str | None:
  """A note when an update call's groups (``train.batch_groups`` / ``train.minibatches``
  / ``train.micro_batches``, each group one row) do not split evenly over the mesh's
  ``batch_chips``: the ``batch`` rule then leaves the rows whole on every chip, so each chip
  computes every row's activations and XLA splits the layers' matmuls over their contraction
  instead, all-reducing activations (Qwen3-8B on v6e-16 with the GSM8K config's 8 groups
  per call over 16 chips: 5.55 GB per call, against a gradient reduce-scatter). Names a
  ``train.minibatches`` that splits them, where one does, and the multiple of
  ``train.batch_groups`` that does. None when they split, for ``data.group_size=adaptive``
  (its rows follow the groups' sizes), and for a mixture of experts, whose expert layer's
  dispatch sets the update's cost: Qwen3-30B-A3B on v5p-32, split over its 16 chips by
  two minibatches, was estimated 2.2x slower in the learner, with 5.3x XLA's FLOPs per call
  for twice the groups (docs/SCALING.md)."""
  split, micro, mb = batch_chips(s), s.train.micro_batches, s.train.minibatches
  groups = s.train.batch_groups
  per_call = lambda m: groups // m // micro  # an update call's groups with m minibatches
  if (s.data.group_size == "adaptive" or s.model_cfg.num_experts or split < 2
      or per_call(mb) % split == 0):
    return None
  fits = next((m for m in range(mb, 0, -1) if groups % m == 0 and per_call(m) % split == 0),
              None)
  way = (f"--config.train.minibatches={fits} splits them (fewer, larger optimizer steps; "
         f"or a train.batch_groups that is a multiple of {batch_step(s)})" if fits else
         f"a train.batch_groups that is a multiple of {batch_step(s)} splits them")
  return (f"each update call's {per_call(mb)} groups do not split over the "
          f"{split} chips of the mesh's batch axes: every chip computes all of their "
          f"activations and the update all-reduces activations besides the gradients; {way}")


def batch_step(s: Setup) -> int:
  """The multiple of groups ``train.batch_groups`` is searched in: whole micro-batches in
  every minibatch (``train.minibatches`` x ``train.micro_batches``), every minibatch's rows
  split evenly over the mesh's batch axes (rows they do not divide are replicated on every
  chip: another program), and whole engine shares with ``rollout.partial``."""
  step = s.train.minibatches * math.lcm(s.train.micro_batches, batch_chips(s))
  if s.rollout.partial:
    step = math.lcm(step, state_lib.engine_shares(s))
  return step


def _slots(s: Setup, groups: int) -> int:
  """The sampler engine's group slots at ``groups`` groups a step (``memory.sampler_engine``):
  a power of two of the groups one sampler serves (per host when each host samples its
  own), or the partial engine's held groups."""
  if s.rollout.partial:
    return math.ceil(s.rollout.over_sampling * groups / state_lib.engine_shares(s))
  hosts = len({d.process_index for d in s.mesh.devices.flat})
  return records.pow2(groups if s.sampler_mesh is s.mesh else math.ceil(groups / hosts))


def batch_peaks(config: ml_collections.ConfigDict, groups: int,
                hbm: int | None = None) -> dict[str, Any]:
  """The RL phase of ``config`` at ``train.batch_groups=groups`` compiled for its topology
  (memory only, no cost analysis): ``peak`` per chip (the largest of its programs' and of
  the resident state with the largest step), its ``program``, ``programs`` (each one's peak),
  ``fits`` (``hbm``, by default the chip's), ``slots`` (the sampler's). A program XLA:TPU
  refuses for the HBM, or state that does not fit, is ``fits`` False with ``peak`` None and
  the ``refused`` line; a batch the config's rules refuse, the ``invalid`` line."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.train.batch_groups = int(groups)
  c.sft.steps = 0  # the supervised step does not depend on the RL batch
  out: dict[str, Any] = {"groups": int(groups), "peak": None, "fits": False}
  try:
    t, _, rl_state, chip, _, _, kv_fraction = build(c)
    plan = memory.state_plan(t, None, rl_state)
    memory.check_state_fits(plan["state"], chip.hbm, f"{chip.name} HBM")
    plan, programs, kv = _programs(t, plan, None, rl_state, kv_fraction, chip, costs=False)
  except (TopologyPlanError, memory.MemoryPlanError) as e:
    return dict(out, refused=" ".join(str(e).split())[:300])
  except ConfigError as e:
    return dict(out, invalid=str(e))
  return dict(out, **_point(plan, programs, hbm or chip.hbm), slots=int(kv["slots"]))


def _point(plan: dict, programs: dict, hbm: int) -> dict[str, Any]:
  """One measured batch: the RL phase's peaks (programs and the state with its largest
  step, ``state``), the largest and whether it fits ``hbm``."""
  peaks = {n: int(p["peak"]) for n, p in programs.items() if p["phase"] == "rl"}
  peaks["state"] = int(plan["peak"]["rl"])
  worst = max(peaks, key=peaks.get)
  return {"peak": peaks[worst], "program": worst, "programs": peaks,
          "fits": peaks[worst] <= hbm}


def _predict(points: dict[int, dict], s: Setup, groups: int) -> dict[str, float] | None:
  """Each program's peak at ``groups`` groups on the line through the two compiled batches
  nearest to it (the sampler's programs affine in the engine's slots, ``_slots``; the rest
  in the groups); None without two compiled batches."""
  measured = sorted((g for g, p in points.items() if p.get("programs")),
                    key=lambda g: (abs(g - groups), g))
  if len(measured) < 2:
    return None
  out = {}
  for name in points[measured[0]]["programs"]:
    size = (lambda g: _slots(s, g)) if name in SAMPLER else (lambda g: g)
    near = [measured[0]] + [g for g in measured[1:] if size(g) != size(measured[0])][:1]
    y0 = points[near[0]]["programs"][name]
    if len(near) < 2:  # the same size at every compiled batch
      out[name] = float(y0)
      continue
    x0, x1, y1 = size(near[0]), size(near[1]), points[near[1]]["programs"][name]
    out[name] = y0 + (y1 - y0) * (size(groups) - x0) / (x1 - x0)
  return out


def max_batch(config: ml_collections.ConfigDict, plan: dict,
              s: Setup | None = None) -> dict[str, Any]:
  """The largest ``train.batch_groups`` whose RL phase fits the chip's HBM: a multiple of
  ``batch_step`` (or the configured one), searched up to ``MAX_BATCH_FACTOR`` x it.

  Every program's peak per chip is taken as affine in the batch (the sampler's in its slots,
  ``_slots``: a power of two of the groups). From ``plan`` (the configured batch) and the RL
  phase compiled at twice it (half when it does not fit; ``batch_peaks``), each program's
  line predicts the largest multiple that fits; that batch is compiled, and the search
  goes on with it as one more point (down when it does not fit, up when the lines now say
  the next multiple fits) until a compiled batch fits and the next multiple above it is
  predicted, or compiled, not to; at most ``_MAX_BATCH_COMPILES`` batches are compiled.

  Returns: ``groups`` (None: no compiled batch fits), ``step``, ``limit``, ``verified``
  (``groups`` was compiled and fits; its next multiple compiled or predicted not to), ``next``
  (that multiple: ``peak``, ``program``, ``compiled``), ``points`` (each compiled batch:
  ``peak``, ``program``, ``fits``, ``refused`` where XLA:TPU refused a program) and
  ``seconds``. ``plan``: ``plan_topology``'s at the configured batch (its ``capacity`` is
  the HBM searched against); ``s``: the run's ``Setup`` (built over the topology when None)."""
  t0 = time.perf_counter()
  if s is None:
    s = build_setup(_planned(config)[0],
                    topology_devices(config.dry_run.topology, int(config.dry_run.num_slices)))
  hbm, G0 = plan["capacity"], int(config.train.batch_groups)
  step = batch_step(s)
  limit = MAX_BATCH_FACTOR * max(G0, step)
  points = {G0: dict(_point(plan, plan["programs"], hbm), groups=G0,
                     slots=plan["kv_pool_plan"]["slots"])}
  out: dict[str, Any] = {"groups": None, "step": step, "limit": limit, "verified": False}
  if "sft" in plan["programs"] and plan["programs"]["sft"]["peak"] > hbm:
    return dict(out, points=_json_points(points), seconds=round(time.perf_counter() - t0, 1),
                note="the supervised step does not fit at any train.batch_groups")
  snap = lambda g: max(step, g // step * step)
  fits = lambda g: points[g]["fits"]

  def candidate() -> int | None:
    lo = max((g for g in points if fits(g)), default=0)
    hi = min((g for g in points if not fits(g) and g > lo), default=limit + step)
    first = (lo // step + 1) * step
    if _predict(points, s, first) is None:  # one measured batch: halve the interval
      mid = snap((lo + min(hi, 2 * max(lo, step))) // 2)
      return mid if lo < mid < hi else None
    best = None
    for g in range(first, min(hi, limit + 1), step):
      if max(_predict(points, s, g).values()) > hbm:
        break
      best = g
    return best

  nxt = snap(2 * G0) if fits(G0) else snap(G0 // 2)
  for _ in range(_MAX_BATCH_COMPILES):
    if nxt is None or nxt in points or not 0 < nxt <= limit:
      break
    points[nxt] = batch_peaks(config, nxt, hbm)
    nxt = candidate()
  lo = max((g for g in points if fits(g)), default=None)
  out.update(groups=lo)
  if lo is not None:
    up = (lo // step + 1) * step
    pred = _predict(points, s, up)
    if up in points:
      out["next"] = dict(groups=up, compiled=True, peak=points[up]["peak"],
                         program=points[up].get("program"), refused=points[up].get("refused"))
      out["verified"] = True
    elif pred:
      worst = max(pred, key=pred.get)
      out["next"] = dict(groups=up, compiled=False, peak=int(pred[worst]), program=worst)
      out["verified"] = pred[worst] > hbm
  return dict(out, points=_json_points(points), seconds=round(time.perf_counter() - t0, 1))


def _json_points(points: dict[int, dict]) -> dict[str, dict]:
  return {str(g): {k: v for k, v in p.items() if k != "groups"}
          for g, p in sorted(points.items())}


def _grown_pool(kv: dict, decode_peak: int, chip: Chip) -> dict:
  """The pool the decode program was compiled with (``kv``), and what a growing one
  (neither ``rollout.kv_pages`` nor ``kv_memory_fraction``) adds per chip when every sample
  uses its whole budget: ``grown_peak``, ``fits_grown``, ``pages_that_fit`` and a note."""
  out = dict(kv)
  if kv["fixed"] or kv["max_pages"] <= kv["pages"]:
    return out
  D = kv["shards"]  # a chip holds one shard's pages: 1/D of the pool
  grown = decode_peak + (kv["max_pages"] - kv["pages"]) // D * kv["page_bytes"]
  room = kv["pages"] // D + max(0, chip.hbm - decode_peak) // kv["page_bytes"]
  out.update(grown_peak=grown, fits_grown=grown <= chip.hbm, pages_that_fit=int(room))
  out["note"] = (
      f"the KV pool starts at {kv['pages']} pages of {kv['page_size']} tokens and grows as "
      f"the responses need, up to {kv['max_pages']} (every sample's whole budget): decode "
      f"then needs {_gib(grown)} per chip" + (
          "" if grown <= chip.hbm else
          f", over the {_gib(chip.hbm)}; set rollout.kv_pages={int(room)} (the most that "
          "fit; the engine preempts beyond) or rollout.kv_memory_fraction"))
  return out


def decode_gather_note(plan: dict, kv_heads: int, rollout_devices: int = 0) -> str | None:
  """A note when the sampler's decode all-gathers its weights every step: its all-gather
  bytes per step (``plan["programs"]["decode"]``) at least half the sampler's weights (its
  own copy per chip, else the policy per chip, times the sampler mesh's chips), on a sampler
  mesh of several chips and no ``tensor`` axis. Each chip then gathers and reads the whole
  model per token; splitting the projections over ``tensor`` chips reads a share of them and
  moves activations instead (docs/SCALING.md, "The mesh that does best on several
  hosts"). The note names the two ways: the sampler alone (``mesh.sampler_tensor``,
  training keeps its mesh) and, without ``mesh.rollout_devices`` (whose sampler mesh only
  that setting changes), the training mesh too (``fsdp_tp``). The suggested ``tensor`` size
  is the largest power of two that divides the sampler mesh's chips and ``kv_heads`` (4 on
  a v5p host, 8 on v6e-8 for 8 kv heads). None otherwise."""
  mesh = plan["sampler_mesh"]
  chips = math.prod(mesh.values())
  state = plan["state"]["rl"]
  weights = (state.get("sampler_copy") or state["policy"]) * chips
  gathered = plan["programs"]["decode"]["collectives"].get("all-gather", {}).get("bytes", 0)
  if mesh.get("tensor", 1) > 1 or chips < 2 or not weights or gathered < weights / 2:
    return None
  tensor = 1
  while chips % (2 * tensor) == 0 and kv_heads % (2 * tensor) == 0:
    tensor *= 2
  if tensor < 2:
    return None
  both = "" if rollout_devices else (
      f"; or train that way too: --config.mesh.rules=fsdp_tp --config.mesh.shape.tensor="
      f"{tensor} --config.mesh.shape.fsdp=-1 (docs/SCALING.md: which is faster where)")
  return (f"the decode all-gathers {_gib(gathered)} of weights per chip per step (its "
          f"{chips} chips split every projection as FSDP does); with "
          f"--config.mesh.sampler_tensor={tensor} each chip keeps 1/{tensor} of every "
          f"projection and the decode moves activations instead, training on its own "
          f"mesh{both}")


def _time(prog: dict, chip: Chip) -> None:
  """``time_s`` of one call of a program: XLA's estimate, or where it gives none the
  roofline max(FLOPs / peak, bytes / HBM bandwidth) of its counts; either scaled by
  ``loop_scale`` = model FLOPs / XLA's FLOPs where XLA counted fewer than the model's
  (a loop body counted once: its time and bytes were too)."""
  roof = max(prog["flops"] / chip.flops, prog["bytes"] / chip.hbm_bandwidth)
  scale = prog["model_flops"] / prog["flops"] if prog["flops"] else 1.0
  scale = scale if scale > 1.1 else 1.0
  base = prog["seconds"] if prog["seconds"] else roof
  prog.update(roofline_s=roof, loop_scale=scale, time_s=base * scale,
              time_source="xla" if prog["seconds"] else "roofline")


def _calls(s: Setup, prog: str) -> int:
  """Calls of a trainer program per step of its phase."""
  if prog == "rl_update":
    return s.train.minibatches * s.train.epochs
  return 1


def _estimate(s: Setup, plan: dict) -> dict[str, Any]:
  """One RL step (and one supervised step) from XLA's per-program estimates: seconds,
  FLOPs per chip, MFU against the chip's peak, and the peak against the HBM.

  ``mfu`` counts each program's larger FLOPs, XLA's or the model's (XLA's count takes a loop
  body once; the model's leaves out attention scores). ``model_mfu`` counts the model's
  alone (2 x matmul weights x tokens, PaLM's MFU): the useful work, lower where XLA computes
  more than the model needs, e.g. an MoE update split into minibatches whose expert matmuls
  run on capacity-padded buffers."""
  progs, chip = plan["programs"], plan["chip"]

  def total(names):  # seconds; FLOPs (the larger of the model's and XLA's count); model's
    names = [n for n in names if n in progs]
    return (sum(progs[n]["time_s"] * progs[n]["calls"] for n in names),
            sum(max(progs[n]["flops"], progs[n]["model_flops"]) * progs[n]["calls"]
                for n in names),
            sum(progs[n]["model_flops"] * progs[n]["calls"] for n in names))

  def utilisation(flops, seconds):
    return flops / (seconds * chip["flops"]) if seconds else None

  rollout_names = ("prefill", "extend", "decode")
  learner = tuple(n for n in progs if n not in SAMPLER + ("sft",))
  out = {}
  r_s, r_f, r_m = total(rollout_names)
  l_s, l_f, l_m = total(learner)
  step = r_s + l_s
  out["rl_step"] = {"seconds": step, "rollout_s": r_s, "learner_s": l_s, "flops": r_f + l_f,
                    "mfu": utilisation(r_f + l_f, step),
                    "model_mfu": utilisation(r_m + l_m, step),
                    "roofline_only": sorted(n for n in progs if n != "sft"
                                            and progs[n]["time_source"] == "roofline")}
  if "sft" in progs:
    sec, flops, model = total(("sft",))
    out["sft_step"] = {"seconds": sec, "flops": flops, "mfu": utilisation(flops, sec),
                       "model_mfu": utilisation(model, sec)}
  worst = max(progs, key=lambda n: progs[n]["peak"])
  peak = max(progs[worst]["peak"], max(plan["peak"].values()))
  out.update(peak=peak, peak_program=worst, fits=peak <= plan["capacity"])
  return out


def _mfu(step: dict) -> str:
  """A step's MFU, and the model FLOPs' alone where they give another tenth of a percent."""
  if step["mfu"] is None:
    return "n/a"
  mfu = f"{100 * step['mfu']:.1f}%"
  model = "" if step.get("model_mfu") is None else f"{100 * step['model_mfu']:.1f}%"
  return mfu if model in ("", mfu) else f"{mfu} (model FLOPs alone: {model})"


def _check_fits(plan: dict) -> None:
  """``TopologyPlanError`` (one line) when a program's peak exceeds the chip's HBM."""
  est = plan["estimate"]
  if est["fits"]:
    return
  prog = plan["programs"][est["peak_program"]]
  phase = prog["phase"]
  parts = dict(plan["state"][phase])
  biggest = sorted(((v, k) for k, v in parts.items() if v), reverse=True)[:3]
  knobs = "; ".join(f"{k}: {memory.KNOBS[k]}" for _, k in biggest if k in memory.KNOBS)
  program_knobs = SAMPLER_KNOBS if est["peak_program"] in SAMPLER else memory.KNOBS["steps"]
  raise TopologyPlanError(
      f"dry_run.topology={plan['topology']}: program {est['peak_program']} needs "
      f"{_gib(prog['peak'])} per chip > {_gib(plan['capacity'])} ({plan['capacity_source']}): "
      f"state {_gib(sum(parts.values()))} ({', '.join(f'{k} {_gib(v)}' for v, k in biggest)})"
      f" + the program's own {_gib(prog['peak'] - sum(parts.values()))}; shrink with "
      f"{program_knobs}" + (f"; {knobs}" if knobs else "")
      + (f"; train.batch_groups={plan['max_batch_groups']} fits"
         if plan.get("max_batch_groups") else ""))


def _gib(n: float) -> str:
  return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def _si(x: float, unit: str) -> str:
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def _seconds(x: float | None) -> str:
  if x is None:
    return "n/a"
  return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _max_batch_line(mb: dict, hbm: int) -> str:
  """The largest ``train.batch_groups`` that fits, in one line."""
  pts = mb["points"]
  tried = ", ".join(f"{g} {'fits' if p['fits'] else 'no'}"
                    for g, p in sorted(pts.items(), key=lambda kv: int(kv[0])))
  tail = (f"multiples of {mb['step']} (train.minibatches x micro-batches x batch chips); "
          f"compiled at {tried}; {mb['seconds']:.0f} s")
  g = mb["groups"]
  if g is None:
    return f"largest train.batch_groups that fits: none ({tail})"
  nxt = mb.get("next")
  head = f"largest train.batch_groups that fits: {g} (peak {_gib(pts[str(g)]['peak'])}, " \
         f"{pts[str(g)]['program']})"
  if nxt and nxt["peak"] is None:
    head += f"; {nxt['groups']} does not compile ({nxt.get('refused') or 'invalid'})"
  elif nxt and nxt["peak"] > hbm:
    head += (f"; {nxt['groups']} {'needs' if nxt['compiled'] else 'predicted'} "
             f"{_gib(nxt['peak'])} ({nxt['program']}) > {_gib(hbm)}")
  elif nxt:
    head = head.replace(f"fits: {g} ", f"fits: at least {g} ") + (
        f"; the search stops at {mb['limit']}" if nxt["groups"] > mb["limit"] else
        f"; the search stopped after {_MAX_BATCH_COMPILES} compiled batches")
  return f"{head}; {tail}"


def format_plan(plan: dict) -> str:
  """The plan as a short table (per chip)."""
  chip = plan["chip"]
  lines = [
      f"TPU topology {plan['topology']}"
      + (f" x {plan['num_slices']} slices" if plan["num_slices"] > 1 else "")
      + f": {plan['chips']} chips ({plan['device_kind']}: {_gib(chip['hbm'])} HBM, "
      f"{_si(chip['flops'], 'FLOP/s')} bf16, {_si(chip['hbm_bandwidth'], 'B/s')}), "
      f"{plan['hosts']} host(s); mesh {plan['mesh']}, rules {plan['rules']}"
      + (f"; sampler mesh{' per host' if plan['hosts'] > 1 else ''} {plan['sampler_mesh']}"
         if plan["sampler_mesh"] != plan["mesh"] else "")
      + (f", rules {plan['sampler_rules']}"
         if plan.get("sampler_rules", plan["rules"]) != plan["rules"] else "")
      + f"; compiled in {plan['compile_s']} s",
      "  state per chip: " + "; ".join(
          f"{phase} {_gib(sum(parts.values()))}" for phase, parts in plan["state"].items()),
      f"  {'program':<17}{'args':>11}{'temp':>11}{'out-alias':>11}{'peak':>11}"
      f"{'FLOP':>11}{'bytes':>11}{'est.':>12}{'loop':>5}  calls  collectives "
      "(count, result bytes)",
  ]
  for name, p in plan["programs"].items():
    m = p["memory"]
    coll = ", ".join(f"{k} {v['count']}x {_gib(v['bytes'])}"
                     for k, v in sorted(p["collectives"].items())) or "none"
    lines.append(
        f"  {name:<17}{_gib(m.get('argument', 0)):>11}{_gib(m.get('temp', 0)):>11}"
        f"{_gib(m.get('output', 0) - m.get('alias', 0)):>11}{_gib(p['peak']):>11}"
        f"{_si(p['flops'], ''):>11}{_si(p['bytes'], 'B'):>11}"
        f"{_seconds(p['time_s']) + ('*' if p['time_source'] == 'roofline' else ' '):>12}"
        f"{'x%.0f' % p['loop_scale'] if p['loop_scale'] > 1 else '':>5}"
        f"  {p['calls']:>5}  {coll}" + (f"  [{p['note']}]" if p.get("note") else ""))
  est = plan["estimate"]
  rl = est.get("rl_step")
  if rl:
    mfu = _mfu(rl)
    if rl["roofline_only"]:
      lines.append(f"  * XLA gave no time for {', '.join(rl['roofline_only'])}: the roofline "
                   "max(FLOPs / peak, bytes / HBM bandwidth), collectives not counted")
    if any(p["loop_scale"] > 1 for p in plan["programs"].values()):
      lines.append("  loop xk: XLA counts a loop body (layer scan, log-prob chunks) once; "
                   "its time scaled by k = model FLOPs (2 x weights x tokens) / its FLOPs")
    lines.append(f"  RL step (XLA's estimates, not measured): {_seconds(rl['seconds'])} = "
                 f"rollout {_seconds(rl['rollout_s'])} + learner {_seconds(rl['learner_s'])}; "
                 f"{_si(rl['flops'], 'FLOP')} per chip, MFU {mfu} of "
                 f"{_si(chip['flops'], 'FLOP/s')}")
  sft = est.get("sft_step")
  if sft:
    lines.append(f"  supervised step: {_seconds(sft['seconds'])}, MFU {_mfu(sft)}")
  kernels = sorted({k for p in plan["programs"].values() for k in p["kernels"]})
  if kernels:
    lines.append(f"  Mosaic kernels compiled: {', '.join(kernels)} (in "
                 f"{', '.join(n for n, p in plan['programs'].items() if p['kernels'])})")
  for note in plan.get("notes", ()):
    lines.append(f"  note: {note}")
  verdict = "fits" if est["fits"] else "does NOT fit"
  lines.append(f"  {verdict}: peak {_gib(est['peak'])} of {_gib(plan['capacity'])} per chip "
               f"({est['peak_program']}; {plan['capacity_source']})")
  if plan.get("max_batch"):
    lines.append("  " + _max_batch_line(plan["max_batch"], plan["capacity"]))
  return "\n".join(lines)
