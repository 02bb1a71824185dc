"""Where the mesh meets the step: the shardings every jitted step is compiled with, and the
placement of host batches as global arrays.

One table decides everything (``rl_jax.sharding``): parameters and optimizer state follow
the rule set's logical axes (FSDP: sharded over ``fsdp``, all-gathered layer by layer inside
the step, gradients reduce-scattered back), and every batch array is split along its
leading axis, logical ``batch`` -> ``(data, fsdp)``, so each device computes only its slice.
A leading axis that the batch mesh axes do not divide stays replicated (correct, slower).

Each process samples and scores only the groups whose rows live on its own devices
(``Layout.share``) and ``Layout.put`` assembles the global batch from those rows with
``jax.make_array_from_process_local_data``. When the batch axes do not divide the rows
(the batch is replicated), every process holds every row and the global array is filled
from the host copy.
``Layout.sampler_params`` hands the sampler the policy (with LoRA and ``rollout.lora_merge``
the merged weights; with ``rollout.weight_dtype`` quantised) on ``Setup.sampler_mesh``: the
weights themselves with one process (a device-to-device copy when the asynchronous trainer
samples on devices of its own; with ``mesh.sampler_tensor`` a jitted reshard to the
sampler's own layout over the training devices, e.g. tensor-parallel decoding beside FSDP
training); with several processes sampling on the training devices,
one jitted reshard to a copy per process laid out over that process's devices by the
sampler's rules (``per_process_shardings``: sharded within the process, replicated across
processes), whose shards on this process's devices form the local copy; with the
asynchronous trainer's rollout devices, a jitted all-gather to a replica, copied device to
device onto this process's rollout devices (no host copy either way).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import compile_options
from rl_jax import models
from rl_jax import sharding
from rl_jax.train.context import Setup
from rl_jax.train.state import TrainState, abstract_state

__all__ = ["Layout", "make_layout", "jit_on_mesh"]


class Layout(NamedTuple):
  """The shardings of one run: the train state's (``state``) and the mesh / rules that
  place batches and constrain activations."""

  mesh: jax.sharding.Mesh
  sampler_mesh: jax.sharding.Mesh
  rules: str
  state: TrainState  # a TrainState of NamedShardings
  merge: Callable | None = None  # LoRA with rollout.lora_merge: params -> merged weights
  quantize: Callable | None = None  # rollout.weight_dtype: weights -> the sampler's quantised
  sampler_cfg: Any = None  # the ModelConfig the sampler decodes with (its weights' layout)
  narrow: bool = False  # rollout.sampler_copy on the training mesh: decode from ``narrowed``
  sampler_rules: str | None = None  # the sampler's rule set (Setup.sampler_rules); None: rules

  @property
  def shared_sampler(self) -> bool:
    """Whether the sampler decodes from the weights where they lie (``Setup.shared_sampler``):
    the training mesh and rules."""
    return self.sampler_mesh is self.mesh and (self.sampler_rules or self.rules) == self.rules

  @property
  def replicated(self) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

  def rows(self, n: int) -> jax.sharding.NamedSharding:
    """Sharding of every batch array with ``n`` rows (any rank): the leading axis over
    ``batch`` -> (data, fsdp) when they divide ``n``, the other axes replicated."""
    return jax.sharding.NamedSharding(
        self.mesh, sharding.logical_to_spec(("batch",), self.rules, self.mesh, (n,)))

  def share(self, n: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of an ``n``-row batch that live on this process's devices (one
    contiguous block: devices are laid out process by process); ``(0, n)`` with one process
    or a replicated batch."""
    blocks = [idx[0].indices(n)[:2] if idx else (0, n)
              for idx in self.rows(n).addressable_devices_indices_map((n,)).values()]
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    if sum(b - a for a, b in set(blocks)) != hi - lo:
      return 0, n  # not one block: every process holds every row
    return lo, hi

  def put(self, x: Any, n: int | None = None) -> jax.Array:
    """This process's rows ``share(n)`` of an ``n``-row batch (default: ``x`` is the whole
    batch) as a global array split along ``batch``."""
    x = np.asarray(x)
    n = x.shape[0] if n is None else n
    shape = (n,) + x.shape[1:]
    if self.share(n) == (0, n):
      return jax.make_array_from_callback(shape, self.rows(n), lambda idx: x[idx])
    return jax.make_array_from_process_local_data(self.rows(n), x, shape)

  def sampler_weights(self, params: Any, quantized: bool = True) -> Any:
    """The weights the sampler decodes with: ``params`` (the base and its adapters as they
    are), or with ``rollout.lora_merge`` (and no quantised base: ``model.lora.quant``
    decodes it unmerged) the merged weights (``models.lora.merge``, a
    jitted pass laid out like the base; no adapters in the tree, so the model runs plain);
    with ``rollout.weight_dtype`` (and ``quantized``) their dense projections quantised
    (``quantize``: ``Setup.sampler_cfg`` decodes them)."""
    weights = params if self.merge is None else self.merge(params)
    return weights if self.quantize is None or not quantized else self.quantize(weights)

  def sampler_params(self, params: Any, quantized: bool = True) -> Any:
    """``sampler_weights(params, quantized)`` placed for the sampler (``local_params``);
    ``quantized=False``: the policy as the trainer holds it (the held-out evaluation). On a
    sampler mesh of its own, or with ``narrow`` (``rollout.sampler_copy``), the sampler
    decodes from a ``narrowed`` copy."""
    weights = self.sampler_weights(params, quantized)
    if self.decodes_copy:
      weights = self.narrowed(weights)
    return self.local_params(weights)

  @property
  def decodes_copy(self) -> bool:
    """Whether the sampler decodes from a ``narrowed`` copy: on a sampler mesh (or rules)
    of its own, or with ``narrow`` (``rollout.sampler_copy``) on the training mesh."""
    return not self.shared_sampler or self.narrow

  def narrowed(self, weights: Any) -> Any:
    """``weights`` for a copy the sampler decodes from: the projection matrices in the
    sampler's compute dtype (``models.cast_projections``, a jitted cast laid out like
    ``weights``). The sampler's numbers are the same bit for bit; with float32 weights and
    a bfloat16 compute dtype the copy is half the bytes, and a decode step reads less
    (the experts' grouped matmuls most: XLA:TPU does not fuse their weights' cast)."""
    if self.sampler_cfg is None or jnp.dtype(self.sampler_cfg.dtype).itemsize >= 4:
      return weights  # nothing is narrower than float32
    return _narrow(self.sampler_cfg)(weights)

  def local_params(self, params: Any) -> Any:
    """``params`` as they are, placed on ``Setup.sampler_mesh`` (the final export reads
    them there): with one process the weights themselves, or a device-to-device copy on the
    asynchronous trainer's rollout devices, or with ``mesh.sampler_tensor`` a jitted reshard
    to the sampler's layout over the training devices; with several processes sampling on the
    training devices, one jitted reshard to a copy per process laid out by the sampler's
    rules over that process's devices (``per_process_shardings``; every process runs it,
    in the same order), whose shards here are the local copy: a device holds its share of
    the weights, not all of them; otherwise a jitted all-gather to a replica on every
    training device, then this process's shards of it (``_local_replica``)."""
    if self.shared_sampler:
      return params
    local = jax.sharding.NamedSharding(self.sampler_mesh, jax.sharding.PartitionSpec())
    on_training = self.sampler_cfg is not None and set(self.sampler_mesh.devices.flat) <= set(
        self.mesh.devices.flat)
    if jax.process_count() == 1 and not on_training:  # the asynchronous trainer's own devices
      return jax.device_put(params, local, may_alias=False)
    cfg = _stored_config(self.sampler_cfg, params) if on_training else None
    adapters = bool(models.lora.split(params)[1])
    rules = self.sampler_rules or self.rules
    if jax.process_count() == 1:  # a layout of its own on the training devices
      return _reshard(cfg, self.sampler_mesh, rules, adapters)(params)
    per_process = None
    if on_training:  # sampling on the training devices: shard per process
      per_process = _per_process(cfg, self.mesh, self.sampler_mesh, rules, adapters)
    if per_process is not None:
      targets, reshard = per_process
      return jax.tree.map(lambda x, t: jax.make_array_from_single_device_arrays(
          x.shape, t, [shard.data for shard in x.addressable_shards]), reshard(params), targets)
    replicated = _gather(self.mesh)(params)
    return jax.tree.map(lambda x: _local_replica(x, local), replicated)

  @contextlib.contextmanager
  def active(self):
    """Trace-time context: ``sharding.constrain`` in the model and losses pins activations."""
    with sharding.use(self.mesh, self.rules):
      yield


@functools.lru_cache(maxsize=None)
def _narrow(cfg) -> Callable:
  return jax.jit(functools.partial(models.cast_projections, cfg))


def _local_replica(x: jax.Array, local: jax.sharding.NamedSharding) -> jax.Array:
  """This process's copy of ``x`` (replicated on every device of a mesh over all
  processes) on ``local``, a replicated sharding over some of this process's devices: the
  shards of ``x`` themselves when ``local``'s devices hold them (sampling on the training
  devices), else a device-to-device copy of one of them (the asynchronous trainer's rollout
  devices, which the training mesh does not include)."""
  shards = x.addressable_shards
  if local.device_set <= {shard.device for shard in shards}:
    return jax.make_array_from_single_device_arrays(x.shape, local,
                                                    [shard.data for shard in shards])
  return jax.device_put(shards[0].data, local, may_alias=False)


def sampler_shardings(cfg, mesh: jax.sharding.Mesh, rules, params: Any) -> Any:
  """The layout the rollout engine keeps its weights in (``RolloutEngine.prepare_params``):
  ``models.param_shardings`` of the sampler's config on its mesh, without adapters when
  ``params`` has none (LoRA merged for the sampler)."""
  return _sampler_targets(cfg, mesh, rules, bool(models.lora.split(params)[1]))


@functools.lru_cache(maxsize=None)
def _sampler_targets(cfg, mesh: jax.sharding.Mesh, rules, adapters: bool) -> Any:
  targets = models.param_shardings(cfg, mesh, rules)
  return targets if adapters else models.lora.strip(targets)


def _stored_config(cfg, params: Any):
  """``cfg`` (the sampler's) as ``params`` are stored: without its quantisation where they
  hold no quantised weight (with ``rollout.weight_dtype``, the policy as the trainer keeps
  it: the held-out evaluation's weights, the final export)."""
  quantized = any(models.quant.is_quantized(x) for x in jax.tree.leaves(
      params, is_leaf=models.quant.is_quantized))
  return cfg if quantized or not cfg.quant else cfg.replace(quant="")


@functools.lru_cache(maxsize=None)
def _reshard(cfg, sampler_mesh: jax.sharding.Mesh, rules, adapters: bool) -> Callable:
  """A jitted copy of the policy into the sampler's layout on ``sampler_mesh`` (its
  devices the training mesh's: XLA moves the shards device to device)."""
  return jax.jit(lambda tree: tree,
                 out_shardings=_sampler_targets(cfg, sampler_mesh, rules, adapters))


@functools.lru_cache(maxsize=None)
def _per_process(cfg, mesh: jax.sharding.Mesh, sampler_mesh: jax.sharding.Mesh, rules,
                 adapters: bool) -> tuple[Any, Callable] | None:
  """(the sampler's shardings on this process's mesh, a jitted reshard of the policy onto
  one copy per process: ``per_process_shardings``), built once per run; None where the
  processes' devices are not laid out as their sampler meshes."""
  targets = _sampler_targets(cfg, sampler_mesh, rules, adapters)
  spread = per_process_shardings(mesh, sampler_mesh, targets)
  if spread is None:
    return None
  return targets, jax.jit(lambda tree: tree, out_shardings=spread)


def per_process_shardings(mesh: jax.sharding.Mesh, sampler_mesh: jax.sharding.Mesh,
                          targets: Any, devices: Any = None) -> Any:
  """``targets`` (shardings on this process's ``sampler_mesh``) as shardings over every
  device of ``mesh``: one copy per process, laid out over its own devices as ``targets``
  and replicated across processes, on a mesh of axes ("processes", *the sampler mesh's
  axes*) whose row p is process p's devices in the order of ``devices`` (the job's, default
  ``jax.devices()``), as ``context._sampler_mesh`` lays out each process's own. None when
  this process's sampler mesh is not laid out that way (``local_params`` then gathers a
  replica)."""
  procs = sorted({d.process_index for d in mesh.devices.flat})
  shape = sampler_mesh.devices.shape
  devices = jax.devices() if devices is None else devices
  rows = [[d for d in devices if d.process_index == p] for p in procs]
  if any(len(r) != sampler_mesh.devices.size for r in rows):
    return None
  grid = np.stack([np.asarray(r, dtype=object).reshape(shape) for r in rows])
  own = procs.index(next(iter(sampler_mesh.devices.flat)).process_index)
  if not (grid[own] == sampler_mesh.devices).all():
    return None
  grid = jax.sharding.Mesh(grid, ("processes", *sampler_mesh.axis_names))
  return jax.tree.map(lambda t: jax.sharding.NamedSharding(grid, t.spec), targets)


@functools.lru_cache(maxsize=None)
def _gather(mesh: jax.sharding.Mesh) -> Callable:
  """A jitted all-gather of a pytree to a full replica on every device of ``mesh``."""
  return jax.jit(lambda tree: tree,
                 out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def make_layout(s: Setup, abstract: TrainState | None = None) -> Layout:
  """The run's layout; the state shardings come from ``abstract`` (default:
  ``abstract_state(s)``: shapes and shardings only, nothing computed)."""
  shardings = jax.tree.map(lambda x: x.sharding, abstract or abstract_state(s))
  merge = None
  if s.model_cfg.lora_rank and s.rollout.lora_merge and not s.model_cfg.quant:
    merge = merge_weight_by_weight(s.model_cfg, models.lora.split(shardings.params)[0])
  quantize = None
  if s.sampler_cfg is not s.model_cfg:  # rollout.weight_dtype
    cfg = s.sampler_cfg if merge is None else s.sampler_cfg.replace(lora_rank=0, lora_targets=())
    quantize = jax.jit(functools.partial(models.quant.quantize_base, cfg),
                       out_shardings=models.param_shardings(cfg, s.mesh, s.rules))
  return Layout(mesh=s.mesh, sampler_mesh=s.sampler_mesh, rules=s.rules, state=shardings,
                merge=merge, quantize=quantize, sampler_cfg=s.sampler_cfg,
                narrow=narrow_copy(s), sampler_rules=s.sampler_rules)


def narrow_copy(s: Setup) -> bool:
  """``rollout.sampler_copy`` on the training mesh: whether the sampler decodes from a copy
  with its projections in the compute dtype (``Layout.narrowed``). None (auto) is on for
  TPU and GPU programs (the sampler mesh's platform), where a decode step is bound by the
  bytes it reads, and off for CPU ones (host memory is the CPU's limit; its programs are
  unchanged). Only where a copy is narrower than the weights (``narrows``)."""
  own = s.rollout.sampler_copy
  if own is None:
    own = s.sampler_mesh.devices.flat[0].platform != "cpu"
  return bool(own) and narrows(s.sampler_cfg, s.model_cfg)


def narrows(sampler_cfg, model_cfg) -> bool:
  """Whether ``models.cast_projections`` makes a copy narrower than the stored weights: the
  compute dtype is narrower than ``param_dtype`` (with LoRA the frozen base's dtype)."""
  return jnp.dtype(sampler_cfg.dtype).itemsize < jnp.dtype(model_cfg.param_dtype).itemsize


def merge_weight_by_weight(cfg, base_shardings: Any) -> Callable:
  """``models.lora.merge`` for the sampler, laid out like the base (``base_shardings``): one
  jitted program per adapted weight, run one after the other, and one for the rest of the
  base. The same values, bit for bit (each weight's merge is the same computation), but the
  float32 delta of one weight exists at a time: in one program the CPU backend kept the
  deltas of all seven projections alive together (4.6 GiB for a Qwen3-1.7B shape at rank
  16, the peak of its GRPO steps)."""
  layers_sh = base_shardings["layers"]
  one = {}

  def merged(t: str, w, ab):
    if t not in one:
      one[t] = jax.jit(functools.partial(models.lora.merge_weight, cfg, t),
                       out_shardings=layers_sh[t])
    return one[t](w, ab)

  def rest_of(tree, adapted):
    return {**tree, "layers": {k: v for k, v in tree["layers"].items() if k not in adapted}}

  @functools.lru_cache(maxsize=None)
  def rest(adapted: tuple):
    return jax.jit(lambda tree: tree, out_shardings=rest_of(base_shardings, adapted))

  def merge(params):
    base, adapters = models.lora.split(params)
    if not adapters:
      return rest(())(base)
    out = rest(tuple(sorted(adapters)))(rest_of(base, adapters))
    layers = dict(out["layers"])
    for t, ab in adapters.items():
      layers[t] = jax.block_until_ready(merged(t, base["layers"][t], ab))
    return {**out, "layers": {k: layers[k] for k in base["layers"]}}

  return merge


def jit_on_mesh(fn: Callable, layout: Layout, **jit_kwargs) -> Callable:
  """``jax.jit(fn, **jit_kwargs)`` traced inside ``layout.active()``, compiled with the
  training programs' options for the mesh's devices (``compile_options``)."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with layout.active():
      return fn(*args, **kwargs)

  jit_kwargs.setdefault("compiler_options",
                        compile_options.training_options(layout.mesh.devices.flat))
  return jax.jit(traced, **jit_kwargs)
