"""The memory plan of a run: bytes per device of every part of the train state and of every
compiled step, against the device's capacity, known before the first step.

Everything comes from abstract shapes (``state.abstract_state``: shapes, dtypes and
shardings, nothing computed or loaded) and from the steps compiled on abstract inputs
(``jax.ShapeDtypeStruct`` with shardings, ``.lower(...).compile().memory_analysis()``), so a
plan for any config and mesh costs compile time only (``--config.train.dry_run=True``).

Per device (the busiest one; FSDP shards split evenly):

* state parts: ``policy`` (params; with LoRA the frozen base, which with
  ``model.lora.quant`` counts its integer values and float32 block scales), ``adapters`` (the LoRA
  adapters), ``rl_optimizer`` (the RL optimizer state: Adam's two
  moments), ``sft_optimizer`` (only while the supervised stage runs), ``reference`` (only with
  a KL term, in ``train.ref_dtype``), ``critic`` (PPO value params + their optimizer state),
  ``sampler_copy`` (with several processes: this device's share of the process's own copy
  of the policy, laid out over its devices by the sampler's rules; on the asynchronous
  trainer's rollout devices a whole replica; one process samples from the trainer's weights
  in place, or with LoRA and ``rollout.lora_merge`` from merged copies of the adapted
  weights, and with ``rollout.sampler_copy`` from a copy of the projections in the compute
  dtype laid out like the policy), ``rollout_buffer`` (APRIL's
  held groups), ``rollout_queue`` (a runner with a lag: the scored batches sampled ahead of
  the learner), ``selector`` / ``spec_drafts`` (prompt selection, speculative rollouts), and
  ``other`` (step, data position). Bytes = shard shape size x itemsize, summed over the part's leaves.
* steps: XLA's ``argument``, ``output``, ``alias`` (outputs written into donated arguments),
  ``temp`` and ``code`` bytes of each compiled program; the bytes a step adds on top of the
  resident state are ``temp + output - alias``. The sampler's KV cache is sized from shapes
  (``kv_pool``): the prompt caches split over the sampler's batch devices, and the response
  page pool (``rollout.kv_pages``, or the growing pool's first size; its pages and the
  most response tokens in flight are printed).
* host state: the parts ``train.offload`` keeps in host memory (``pinned_host``), per part; a
  step that reads them adds their device copy (``staged``) to its ``extra``.
* peak = the larger phase (supervised, RL) of resident state + the largest step addition
  (on the CPU backend, whose host memory is the same RAM, + the host state).

Capacity: ``device.memory_stats()["bytes_limit"]`` on accelerators; the CPU backend reports
none, so the host's physical RAM divided by the local CPU devices is used instead (labelled
``host RAM``; all CPU devices and the Python process share it).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from rl_jax import models
from rl_jax import rollout, storage
from rl_jax.errors import RLJaxError
from rl_jax.rollout import kv_cache, records
from rl_jax.train import agent_stage
from rl_jax.train import layout as layout_lib
from rl_jax.train import offload
from rl_jax.train import teacher as teacher_lib
from rl_jax.train.inputs import abstract_inputs
from rl_jax.train.rollouts import TrainParts
from rl_jax.train.state import TrainState, abstract_state, held_capacity
from rl_jax.train.steps import UpdateBatch

__all__ = ["PARTS", "KNOBS", "MemoryPlanError", "leaf_bytes", "tree_bytes", "state_parts",
           "host_parts", "live_bytes", "step_memory", "device_capacity", "abstract_update_batch",
           "compile_steps", "is_out_of_memory", "compiler_message", "state_plan", "add_steps",
           "make_plan", "format_plan", "write_plan", "kv_pool", "pool_page_bytes",
           "sampler_engine", "check_state_fits", "check_plan_fits", "plan_run", "plan_workdir", "record_live",
           "PLAN_FILE"]

# plan part -> TrainState fields (``producer.x``: a field of the producer's state)
PARTS = {"policy": ("params",), "rl_optimizer": ("opt_state",),
         "sft_optimizer": ("sft_opt_state",), "reference": ("ref_params",),
         "critic": ("value_params", "value_opt_state"), "rollout_buffer": ("producer.held",),
         "rollout_queue": ("rollout_queue",), "selector": ("producer.selector",),
         "spec_drafts": ("producer.drafts",)}

# what shrinks each part (named in the one-line error of a run that does not fit)
KNOBS = {
    "policy": "model.param_dtype=bfloat16, a larger mesh.shape.fsdp",
    "adapters": "a smaller model.lora.rank, fewer model.lora.targets",
    "rl_optimizer": "optim.mu_dtype=bfloat16, train.offload=optimizer, a larger mesh.shape.fsdp",
    "sft_optimizer": "sft.steps=0, optim.mu_dtype=bfloat16",
    "reference": "train.ref_dtype=bfloat16, train.offload=reference, loss.kl_beta=0",
    "teacher": "train.offload=teacher, model.dtype=bfloat16, a larger mesh.shape.fsdp",
    "critic": "a larger mesh.shape.fsdp",
    "sampler_copy": "more devices per process, rollout.lora_merge=False (LoRA), "
                    "rollout.weight_dtype='', rollout.sampler_copy=False",
    "rollout_buffer": "rollout.over_sampling",
    "rollout_queue": "train.async_lag",
    "spec_drafts": "rollout.speculative=False",
    "steps": "train.micro_batches, model.remat=full, train.minibatches, train.batch_groups, "
             "rollout.max_new_tokens",
}

GiB = 1 << 30
PLAN_FILE = "memory_plan.json"


class MemoryPlanError(RLJaxError, MemoryError):  # pylint: disable=invalid-name
  """The memory plan exceeds the devices' capacity (one line: biggest parts, knobs)."""


def leaf_bytes(x) -> int:
  """Bytes of one array (or ShapeDtypeStruct) on its busiest device: its shard's size x
  itemsize (the whole array without a sharding); 4-bit integers (a quantised base's values)
  count half a byte, as TPU and GPU memory packs them."""
  shape = tuple(np.shape(x))
  sh = getattr(x, "sharding", None)
  if sh is not None and shape:
    try:
      shape = sh.shard_shape(shape)
    except ValueError:  # uneven split: the biggest shard
      spec = getattr(sh, "spec", ())
      mesh = getattr(sh, "mesh", None)
      shape = list(shape)
      for i, axes in enumerate(tuple(spec)[:len(shape)]):
        for a in (axes if isinstance(axes, tuple) else (axes,)) if axes else ():
          shape[i] = math.ceil(shape[i] / mesh.shape[a])
  dtype = jnp.dtype(x.dtype)
  if dtype in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
    return math.ceil(math.prod(shape) / 2)
  return int(math.prod(shape)) * dtype.itemsize


def tree_bytes(tree, host: bool | None = False) -> int:
  """``leaf_bytes`` summed over a pytree's leaves in device memory (``host=False``), in host
  memory (``True``: ``train.offload``) or all (None)."""
  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree)
             if host is None or offload.is_host(x) == host)


def _all_fields(state: TrainState) -> tuple[str, ...]:
  """Every field of the state, the producer's as ``producer.x``."""
  return tuple(f for f in state._fields if f != "producer") + tuple(
      f"producer.{f}" for f in state.producer._fields)


def _get(state: TrainState, field: str):
  node = state
  for part in field.split("."):
    node = getattr(node, part)
  return node


def _fields(state: TrainState) -> dict[str, tuple]:
  """Plan part -> the state's fields: ``PARTS``, and ``other`` for any field not listed
  there (step, data position, ...), so the parts add up to the whole state."""
  every = _all_fields(state)
  listed = {f for fields in PARTS.values() for f in fields}
  parts = {k: tuple(f for f in v if f in every) for k, v in PARTS.items()}
  return {**parts, "other": tuple(f for f in every if f not in listed)}


def state_parts(state: TrainState, host: bool = False) -> dict[str, int]:
  """Bytes per device of each plan part of a (concrete or abstract) train state, in device
  memory (or, ``host``, the parts offloaded to the device's host memory)."""
  parts = {part: sum(tree_bytes(_get(state, f), host) for f in fields)
           for part, fields in _fields(state).items()}
  return _split_adapters(parts, tree_bytes(models.lora.split(state.params)[1], host))


def _split_adapters(parts: dict[str, int], adapters: int) -> dict[str, int]:
  """``parts`` with the policy's LoRA adapters (``adapters`` bytes) counted apart from the
  frozen base: ``policy`` then is the base alone."""
  if not adapters:
    return parts
  out = {}
  for k, v in parts.items():
    out[k] = v - adapters if k == "policy" else v
    if k == "policy":
      out["adapters"] = adapters
  return out


def host_parts(state: TrainState) -> dict[str, int]:
  """``state_parts`` of the offloaded leaves (``train.offload``): host bytes per device."""
  return state_parts(state, host=True)


def live_bytes(state: TrainState, host: bool = False) -> dict[str, int]:
  """The same for a concrete state, measured from its buffers: the bytes held on the first
  device (or in its host memory), per part (what ``state_parts`` predicts from shapes)."""
  dev = jax.local_devices()[0]

  def held(tree):
    return sum(s.data.nbytes for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and offload.is_host(x) == host
               for s in x.addressable_shards if s.device == dev)

  parts = {part: sum(held(_get(state, f)) for f in fields)
           for part, fields in _fields(state).items()}
  return _split_adapters(parts, held(models.lora.split(state.params)[1]))


def step_memory(compiled) -> dict[str, int]:
  """XLA's memory analysis of one compiled program (bytes per device) and ``extra``: what
  it adds on top of its resident arguments (temp + output - alias)."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
         "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
         "code": int(m.generated_code_size_in_bytes)}
  out["extra"] = out["temp"] + out["output"] - out["alias"]
  return out


def device_capacity(device=None) -> tuple[int, str]:
  """(bytes one device may hold, where the number comes from)."""
  device = device or jax.local_devices()[0]
  stats = None
  try:
    stats = device.memory_stats()
  except (AttributeError, NotImplementedError, RuntimeError):
    pass
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{device.device_kind} memory (bytes_limit)"
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  n = max(1, len([d for d in jax.local_devices() if d.platform == device.platform]))
  return ram // n, f"host RAM / {n} {device.platform} device(s) (no device capacity reported)"


def _spec(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def abstract_update_batch(t: TrainParts, groups: int) -> UpdateBatch:
  """ShapeDtypeStructs of one ``groups``-group ``UpdateBatch`` as the rollout stage fills
  it (the objective's declared inputs), split along ``batch``."""
  s, geo = t.setup, t.setup.geometry
  M, R, P = geo.row_size, geo.new_tokens, s.prompt_len
  rows = t.layout.rows(groups)
  tok = lambda dt: _spec((groups, M, R), dt, rows)
  inputs = abstract_inputs(s.objective.needs, groups, M, R,
                           lambda shape, dtype: _spec(shape, dtype, rows),
                           t.steps.old_logp_in_update, geo.turns)
  if inputs.reward_components is not None and s.reward_names:  # C named components
    inputs = inputs._replace(reward_components=_spec((groups, M, len(s.reward_names)),
                                                     jnp.float32, rows))
  adv = jax.eval_shape(s.objective.advantages_from, inputs)
  adv = jax.tree.map(lambda x: _spec(x.shape, x.dtype, rows), adv)
  cfg = s.model_cfg  # mixture of experts: the sampler's expert records
  routing = None if not cfg.is_moe else _spec(
      (groups, M, R, len(cfg.moe_layers), cfg.num_experts_per_tok), jnp.int32, rows)
  return UpdateBatch(_spec((groups, P), jnp.int32, rows), _spec((groups,), jnp.int32, rows),
                     tok(jnp.int32), inputs, adv, routing)


def compile_steps(t: TrainParts, sft_state: TrainState | None, rl_state: TrainState,
                  programs: dict[str, Any] | None = None) -> dict[str, dict[str, int]]:
  """``step_memory`` of each step the run will call, compiled on abstract inputs;
  ``programs``, when given, receives each compiled program under the same name (for its
  cost analysis and HLO text: ``rl_jax.train.topology``)."""
  s, f = t.setup, t.steps
  G = s.geometry.rows
  out = {}

  def compiled(name: str, lowered):
    try:
      program = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program over the HBM
      if not is_out_of_memory(e):
        raise
      raise MemoryPlanError(f"memory plan: step {name} does not fit: {compiler_message(e)}; "
                            f"shrink with {KNOBS['steps']}") from None
    if programs is not None:
      programs[name] = program
    return program

  if sft_state is not None:
    rows = t.layout.rows(s.sft.batch_size)
    T = s.prompt_len + s.rollout.max_new_tokens
    b = [_spec((s.sft.batch_size, T), dt, rows) for dt in (jnp.int32, bool, jnp.float32)]
    out["sft"] = _staged(step_memory(compiled("sft", f.sft.lower(
        sft_state.params, sft_state.sft_opt_state, *b))), sft_state.sft_opt_state)
  batch = abstract_update_batch(t, G)
  args = (batch.prompt_tokens, batch.prompt_lengths, batch.tokens, batch.inputs.mask)
  if s.model.router_replay:  # the log-prob passes replay the records
    args += (batch.routing,)
  if not f.old_logp_in_update:  # else the update's own pass gives old_logp
    out["logprobs"] = step_memory(compiled("logprobs", f.logprobs.lower(rl_state.params,
                                                                         *args)))
  needs = s.objective.needs
  if "ref_logp" in needs and jax.tree.leaves(rl_state.ref_params):
    ref = f.ref_logprobs or f.logprobs
    out["ref_logprobs"] = _staged(step_memory(compiled(
        "ref_logprobs", ref.lower(rl_state.ref_params, *args))), rl_state.ref_params)
  if "ref_logp" in needs and f.ref_from_policy:  # LoRA: the base's pass, adapters off
    out["ref_logprobs"] = step_memory(compiled("ref_logprobs", f.ref_logprobs.lower(
        rl_state.params, *args)))
  if "teacher_logp" in needs and f.teacher_logprobs is not None:  # on-policy distillation
    teacher = teacher_lib.abstract_teacher(s)
    out["teacher_logprobs"] = _staged(step_memory(compiled(
        "teacher_logprobs", f.teacher_logprobs.lower(teacher, *args[:4]))), teacher)
  if "values" in needs:
    out["values"] = step_memory(compiled("values", f.values.lower(rl_state.value_params,
                                                                   *args[:4])))
  mb = abstract_update_batch(t, G // s.train.minibatches)
  out["rl_update"] = _staged(step_memory(compiled("rl_update", f.rl_update.lower(
      rl_state.params, rl_state.opt_state, rl_state.value_params, rl_state.value_opt_state,
      mb))), (rl_state.opt_state, rl_state.value_opt_state))
  return out


def is_out_of_memory(error: Exception) -> bool:
  """Whether a compile error is the compiler refusing a program that cannot fit the device
  (XLA:TPU checks at compile time: ``RESOURCE_EXHAUSTED: Ran out of memory on HBM``)."""
  return "RESOURCE_EXHAUSTED" in str(error)


def compiler_message(error: Exception) -> str:
  """The first line of a compiler error, whitespace squeezed."""
  return " ".join(str(error).strip().splitlines()[0].split()) if str(error).strip() else ""


def _staged(m: dict[str, int], read) -> dict[str, int]:
  """A step that reads offloaded state (``read``) holds its device copy while it runs:
  ``staged`` (those bytes per device) is added to ``extra``. XLA's analysis leaves them out
  (they are neither arguments in device memory nor temporaries on every backend), so the
  plan counts them itself: the state's bytes as they were before offload."""
  staged = tree_bytes(read, host=True)
  if not staged or not m:
    return m
  return dict(m, staged=staged, extra=m["extra"] + staged)


def sampler_engine(t: TrainParts, kv_pages: int | None = None
                   ) -> tuple[rollout.RolloutEngine | rollout.AgentEngine, int]:
  """The engine whose programs one RL step's rollout runs (the APRIL engine of
  ``state.make_engine``, or the one ``rollout.generate`` builds for a fresh step's groups,
  with the longest prompt: its largest prompt bucket; with ``env.name`` the multi-turn
  ``AgentEngine`` of ``agent_stage.make_engine``), with a fixed pool of ``kv_pages`` when
  given, and the groups one sampler serves per step (with several hosts each host samples
  the groups on its own devices). Building it compiles and allocates nothing."""
  s, r = t.setup, t.setup.rollout
  geo = s.geometry
  hosts = len({d.process_index for d in s.mesh.devices.flat})
  groups = geo.groups if s.sampler_mesh is s.mesh else math.ceil(geo.groups / hosts)
  if s.geometry.multi_turn:
    return agent_stage.make_engine(s, r.temperature, kv_pages), groups
  kw = dict(n=geo.samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
            top_p=r.top_p, top_k=r.top_k, eos_id=s.eos_id, mesh=s.sampler_mesh,
            rules=s.sampler_rules, context=s.model_cfg.max_position_embeddings,
            page_size=r.page_size, kv_pages=kv_pages or r.kv_pages,
            prefill_chunk=r.prefill_chunk, prompt_pages=r.prompt_pages)
  if r.partial:
    engine = rollout.RolloutEngine(s.sampler_cfg, max_slots=held_capacity(s),
                                   max_prompt_len=s.prompt_len, over_sampling=r.over_sampling,
                                   **kw)
  else:
    engine = rollout.RolloutEngine(s.sampler_cfg, max_slots=records.pow2(groups),
                                   max_prompt_len=max(1, s.prompt_len - 1), **kw)
  return engine, groups


def _sampler_copy_bytes(s, params, quantize=None) -> int:
  """Bytes per device of the sampler's own copy of ``params`` (``Layout.local_params``, its
  projections in the compute dtype: ``Layout.narrowed``; with ``rollout.weight_dtype``,
  ``quantize`` = ``Layout.quantize``, the quantised weights):
  its share of a copy laid out over the sampler's devices by the sampler's rules when the
  sampler runs on the training devices (``layout.per_process_shardings``, or one process's
  ``mesh.sampler_tensor`` mesh), else a whole replica (the asynchronous trainer's rollout
  devices)."""
  params, cfg = jax.eval_shape(lambda p: p, params), s.model_cfg
  if quantize is not None:
    params, cfg = jax.eval_shape(quantize, params), s.sampler_cfg
  params = models.cast_projections(cfg, params)
  whole = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
              for x in jax.tree.leaves(params))
  if not set(s.sampler_mesh.devices.flat) <= set(s.mesh.devices.flat):
    return whole
  targets = layout_lib.sampler_shardings(cfg, s.sampler_mesh, s.sampler_rules, params)
  return sum(math.prod(t.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))


def narrowed_bytes(sampler_cfg, params) -> int:
  """Bytes per device of the projections ``Layout.narrowed`` casts to the compute dtype,
  laid out like ``params`` (``rollout.sampler_copy`` on the training mesh: the sampler's
  copy beside the policy; the other weights it shares with the policy)."""
  narrowed = models.cast_projections(sampler_cfg, jax.eval_shape(lambda p: p, params))
  return sum(leaf_bytes(jax.ShapeDtypeStruct(x.shape, y.dtype, sharding=x.sharding))
             for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(narrowed))
             if y.dtype != x.dtype)


def pool_page_bytes(s, page_size: int) -> int:
  """Bytes of one response-pool page on a device of the sampler's mesh that holds it: the
  pool's pages are split over the batch axes with the slots (``kv_cache.pool_shards``) and
  over the sequence axis (``kv_cache.sequence_shards``), a page's kv heads over ``tensor``
  (when they divide)."""
  tensor = s.sampler_mesh.shape.get("tensor", 1)
  heads = tensor if s.model_cfg.num_kv_heads % tensor == 0 else 1
  return math.ceil(kv_cache.pool_bytes(s.model_cfg, 1, page_size) / heads)


def kv_pool(t: TrainParts) -> dict[str, int]:
  """The sampler's paged KV cache per device, as ``sampler_engine`` holds it: ``prompts``
  bytes (one prompt cache per group slot, slots over the batch axes), ``pool`` bytes (the
  response pool it starts with: its ``pages`` over ``shards`` devices), ``page_size`` (S),
  ``tokens`` (the most response tokens in flight: pages x S) and ``max_pages`` (what a
  growing pool reaches at most: every sample's whole budget)."""
  s = t.setup
  engine, _ = sampler_engine(t)
  mesh = s.sampler_mesh.shape
  split = math.prod(mesh[a] for a in ("data", "fsdp") if a in mesh)
  prompts = rollout.kv_cache_bytes(engine.cfg, engine.G, engine.M, engine.P, 0)
  pages, shards = engine.pool_pages, engine.D * engine.Q
  return dict(prompts=math.ceil(prompts / max(1, min(split, engine.G))),
              pool=pages // shards * pool_page_bytes(s, engine.S), pages=pages,
              shards=shards, page_size=engine.S, tokens=pages * engine.S,
              max_pages=engine.max_pool_pages)


def state_plan(t: TrainParts, sft_state: TrainState | None,
               rl_state: TrainState) -> dict[str, Any]:
  """The plan without compiled steps: state parts per phase, capacity, dtypes."""
  s = t.setup
  phases = {"rl": state_parts(rl_state)}
  if sft_state is not None:
    phases = {"sft": state_parts(sft_state), **phases}
  merged, quantize = t.layout.merge is not None, t.layout.quantize
  base = models.lora.strip(rl_state.params) if merged else rl_state.params  # quantize's input
  sampler = 0
  if not s.shared_sampler:  # a copy laid out for the sampler: the (quantised) policy whole
    sampler = _sampler_copy_bytes(s, rl_state.params if quantize is None else base, quantize)
  else:  # beside the policy: what the sampler decodes and the policy does not hold
    quantized = None if quantize is None else jax.eval_shape(quantize, base)
    if merged:  # LoRA merged for the sampler: new adapted weights
      layers = models.lora.split(rl_state.params)[0]["layers"]
      sampler = sum(leaf_bytes(layers[k]) for k in s.model_cfg.lora_targets)
    if quantized is not None:  # rollout.weight_dtype: the quantised projections
      sampler += sum(tree_bytes(quantized["layers"][k])
                     for k in models.quant.targets(s.sampler_cfg))
    if t.layout.narrow:  # rollout.sampler_copy (quantised projections stay as they are)
      sampler += narrowed_bytes(s.sampler_cfg,
                                rl_state.params if quantized is None else quantized)
  phases["rl"]["sampler_copy"] = sampler
  host = {"rl": host_parts(rl_state)}
  if s.teacher_cfg is not None:  # on-policy distillation: the frozen teacher (not checkpointed)
    teacher = teacher_lib.abstract_teacher(s)
    phases["rl"]["teacher"] = tree_bytes(teacher)
    host["rl"]["teacher"] = tree_bytes(teacher, host=True)
  if sft_state is not None:
    host = {"sft": host_parts(sft_state), **host}
  capacity, source = device_capacity(s.mesh.devices.flat[0])
  return {"devices": int(s.mesh.size), "mesh": {k: int(v) for k, v in s.mesh.shape.items()},
          "platform": s.mesh.devices.flat[0].platform, "state": phases,
          "host_state": host, "offload": list(s.train.offload_parts),
          "steps": {},
          "peak": {}, "capacity": capacity, "capacity_source": source,
          "dtypes": {"param": s.model_cfg.param_dtype, "compute": s.model_cfg.dtype,
                     "reference": str(jnp.dtype(s.train.ref_dtype or s.model_cfg.dtype)),
                     "mu": s.optim.mu_dtype or "float32"}}


def add_steps(t: TrainParts, plan: dict[str, Any], sft_state: TrainState | None,
              rl_state: TrainState, programs: dict[str, Any] | None = None) -> dict[str, Any]:
  """``plan`` with its compiled steps and the peak of each phase (``programs``: as in
  ``compile_steps``)."""
  steps = compile_steps(t, sft_state, rl_state, programs)
  kv = kv_pool(t)
  steps["sampler_kv_cache"] = {"extra": kv["prompts"] + kv["pool"], "prompts": kv["prompts"],
                               "pool": kv["pool"]}
  plan = dict(plan, kv_pool={k: kv[k] for k in ("pages", "page_size", "tokens", "max_pages")})
  peaks = {}
  for phase, parts in plan["state"].items():
    names = ("sft",) if phase == "sft" else tuple(k for k in steps if k != "sft")
    extra = max([steps[k].get("extra", 0) for k in names if k in steps] or [0])
    peaks[phase] = sum(parts.values()) + extra
    if plan["platform"] == "cpu":  # host memory is the same RAM as the CPU "device"
      peaks[phase] += sum(plan.get("host_state", {}).get(phase, {}).values())
  return dict(plan, steps=steps, peak=peaks)


def make_plan(t: TrainParts, sft_state: TrainState | None, rl_state: TrainState) -> dict[str, Any]:
  """The run's memory plan (a JSON-able dict; bytes per device)."""
  return add_steps(t, state_plan(t, sft_state, rl_state), sft_state, rl_state)


def plan_run(t: TrainParts, sft_state: TrainState | None, rl_state: TrainState, *,
             check: bool = True, path: str | None = None, echo: bool = True) -> dict[str, Any]:
  """Plan, print and (``path``) write; with ``check``, a state that cannot fit fails before
  any step is compiled and a peak that cannot fit before the first step runs."""
  plan = state_plan(t, sft_state, rl_state)
  if check:
    check_state_fits(plan["state"], plan["capacity"], plan["capacity_source"])
  plan = add_steps(t, plan, sft_state, rl_state)
  if echo:
    print(format_plan(plan), flush=True)
  if path is not None:
    write_plan(plan, path)
  if check:
    check_plan_fits(plan)
  return plan


def _gib(n: int) -> str:
  """Bytes as GiB (MiB below 1 GiB)."""
  return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / (1 << 20):.2f} MiB"


def format_plan(plan: dict[str, Any]) -> str:
  """The plan as a short table (bytes per device)."""
  lines = [f"memory plan: {plan['devices']} {plan['platform']} device(s), mesh {plan['mesh']}, "
           f"per device; dtypes {plan['dtypes']}"]
  for phase, parts in plan["state"].items():
    shown = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items() if v)
    lines.append(f"  state ({phase}): {_gib(sum(parts.values()))} = {shown or 'nothing'}")
    host = plan.get("host_state", {}).get(phase, {})
    if sum(host.values()):
      shown = ", ".join(f"{k} {_gib(v)}" for k, v in host.items() if v)
      lines.append(f"  host memory ({phase}, train.offload): {_gib(sum(host.values()))} = "
                   f"{shown}")
  for name, m in plan["steps"].items():
    detail = ", ".join(f"{k} {_gib(v)}" for k, v in m.items() if k != "extra")
    lines.append(f"  step {name}: +{_gib(m.get('extra', 0))}" + (f" ({detail})" if detail else ""))
  if "kv_pool" in plan:
    k = plan["kv_pool"]
    grows = (f"; grows to {k['max_pages']} pages as the responses need them"
             if k["max_pages"] > k["pages"] else "")
    lines.append(f"  kv pool: {k['pages']} pages of {k['page_size']} tokens, at most "
                 f"{k['tokens']} response tokens in flight{grows}")
  for phase, peak in plan["peak"].items():
    lines.append(f"  peak ({phase}): {_gib(peak)} of {_gib(plan['capacity'])} "
                 f"[{plan['capacity_source']}]")
  return "\n".join(lines)


def write_plan(plan: dict[str, Any], path: str) -> None:
  epath.Path(path).write_text(json.dumps(plan, indent=1, sort_keys=True))


def _too_big(need: int, capacity: int, source: str, parts: dict[str, int], what: str) -> str:
  biggest = sorted(((v, k) for k, v in parts.items() if v), reverse=True)[:3]
  knobs = "; ".join(f"{k}: {KNOBS[k]}" for _, k in biggest if k in KNOBS)
  return (f"memory plan: {what} needs {_gib(need)} per device > {_gib(capacity)} ({source}); "
          f"biggest: {', '.join(f'{k} {_gib(v)}' for v, k in biggest)}; shrink with {knobs}")


def check_state_fits(parts_by_phase: dict[str, dict[str, int]], capacity: int,
                     source: str) -> None:
  """Fails (one line) when a phase's resident state alone exceeds the capacity; run before
  anything is compiled."""
  for phase, parts in parts_by_phase.items():
    if sum(parts.values()) > capacity:
      raise MemoryPlanError(_too_big(sum(parts.values()), capacity, source, parts,
                                  f"the {phase} state"))


def check_plan_fits(plan: dict[str, Any]) -> None:
  """Fails (one line) when a phase's predicted peak exceeds the capacity."""
  for phase, peak in plan["peak"].items():
    if peak > plan["capacity"]:
      parts = dict(plan["state"][phase])
      parts["steps"] = peak - sum(parts.values())
      raise MemoryPlanError(_too_big(peak, plan["capacity"], plan["capacity_source"], parts,
                                  f"the {phase} phase"))


def plan_workdir(t: TrainParts, abstract: TrainState, workdir: str, *, check: bool = True,
                 lead: bool = True) -> dict[str, Any]:
  """``plan_run`` for a run whose step-0 restore target is ``abstract``: the supervised
  phase's state is ``abstract`` itself (if ``sft.steps``), the RL phase's the state after the
  first RL step. Process 0 prints the plan and writes ``workdir/memory_plan.json``."""
  s = t.setup
  sft = s.sft.steps
  rl_state = abstract_state(s, sft + 1) if sft else abstract
  path = storage.join(workdir, PLAN_FILE) if lead else None
  return plan_run(t, abstract if sft else None, rl_state, check=check, path=path, echo=lead)


def record_live(workdir: str, state: TrainState) -> None:
  """Adds the bytes the started (or restored) state really holds on the first device to
  ``workdir/memory_plan.json`` (``live_state``; compare with ``state``)."""
  path = storage.join(workdir, PLAN_FILE)
  if not epath.Path(path).exists():
    return
  plan = json.loads(epath.Path(path).read_text())
  plan["live_state"] = {"step": int(state.step), **live_bytes(state)}
  plan["live_host_state"] = live_bytes(state, host=True)
  write_plan(plan, path)
