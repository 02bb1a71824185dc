"""The train state: a fresh one (``init_state``) and its abstract, sharded restore target
(``abstract_state``: shapes, dtypes and shardings from ``jax.eval_shape``, nothing computed
or loaded), so resuming reads no weights and allocates no throwaway state.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_jax import models
from rl_jax import rollout
from rl_jax import sharding
from rl_jax.train import agent_stage, offload
from rl_jax.train import queue as queue_lib
from rl_jax.train import replay_stage, selection_stage, speculative_stage
from rl_jax.train.context import Setup
from rl_jax.train.records import ProducerState
from rl_jax.train.streams import Stream, seed_for

__all__ = ["ProducerState", "TrainState", "init_state", "init_params", "abstract_state",
           "begin_rl", "make_engine", "held_capacity", "engine_shares", "stack_shares", "take_shares",
           "UID_STRIDE", "place_replicated", "rl_layout", "ref_dtype", "make_reference",
           "reference_copy", "adapters"]


class _State(NamedTuple):
  """Everything a resumed run needs (a pytree; checkpointed whole, except that with
  ``model.lora.rank`` a checkpoint's params hold the adapters only: ``lora_checkpoint``).

  step: int32 [] completed steps (supervised + RL). params / opt_state: policy and its RL
  optimizer state (with ``model.lora.rank``: params hold the frozen base and the adapters,
  ``params["layers"]["lora"]``, and both optimizer states cover the adapters only). sft_opt_state: optimizer state of the supervised stage, only while it
  runs (``{}`` once RL starts, and always with ``sft.steps=0``). ref_params: the frozen
  reference policy in ``ref_dtype`` (the policy when RL starts; ``{}`` during the supervised
  stage, if the objective has no KL, and with LoRA: the reference is then the base inside
  ``params`` with the adapters off). Which parts exist at a step: ``rl_layout``.
  value_params / value_opt_state: the PPO critic and its optimizer state (``{}`` otherwise).
  producer: the rollout producer's position (``ProducerState``).
  rollout_queue: with a runner that samples ahead (``Schedule.queue`` > 0), the scored
  batches sampled ahead of the learner (``queue.empty_queue``); ``{}`` otherwise.
  With ``train.offload``, the reference and / or the optimizer states are placed in the
  devices' host memory (``offload``; same layout, memory kind ``pinned_host``).
  ``data``, ``rollout_buffer``, ``selector`` and ``spec_drafts`` read (and ``_replace``
  writes) the producer's fields by the names of the earlier flat layout.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  sft_opt_state: Any
  ref_params: Any
  value_params: Any
  value_opt_state: Any
  producer: ProducerState
  rollout_queue: Any = {}


# the earlier flat names of the producer's fields
_FLAT = {"data": "data", "rollout_buffer": "held", "selector": "selector",
         "spec_drafts": "drafts"}


class TrainState(_State):
  __doc__ = _State.__doc__
  __slots__ = ()

  def _replace(self, /, **kw) -> "TrainState":
    flat = {_FLAT[k]: kw.pop(k) for k in list(kw) if k in _FLAT}
    if flat:
      kw["producer"] = kw.get("producer", self.producer)._replace(**flat)
    return super()._replace(**kw)


# TrainState.data, .rollout_buffer, .selector, .spec_drafts: read through to the producer
for _flat, _field in _FLAT.items():
  setattr(TrainState, _flat, property(lambda self, f=_field: getattr(self.producer, f),
                                      doc=f"The producer's ``{_field}`` (earlier flat name)."))


# engine share j's group uids (its requests' sampling streams) start at j·UID_STRIDE
UID_STRIDE = 1 << 24


def engine_shares(s: Setup) -> int:
  """S, the independent APRIL engines the step's G groups are split into
  (``rollout.partial_shares``; 0: one per process): each returns G / S groups and holds its
  own groups, uids and prompt stream. 1 without the single-turn partial engine."""
  if not s.rollout.partial or s.geometry.multi_turn:
    return 1
  return s.rollout.partial_shares or jax.process_count()


def held_capacity(s: Setup) -> int:
  """Most groups one partial-rollout engine share can hold between steps (its slots)."""
  return math.ceil(s.rollout.over_sampling * s.train.batch_groups / engine_shares(s))


def stack_shares(held: list[dict]) -> dict:
  """Engine shares' ``export_held`` dicts (each with ``drawn``) as one dict of arrays with
  a leading share axis: [S, capacity, ...] (``next_uid``, ``drawn``: [S])."""
  return {k: np.stack([np.asarray(h[k]) for h in held]) for k in held[0]}


def take_shares(held: dict, first: int, last: int) -> dict:
  """Shares ``[first, last)`` of ``stack_shares``' dict (leading axis sliced)."""
  return {k: np.asarray(v)[first:last] for k, v in held.items()}


def make_engine(s: Setup) -> rollout.RolloutEngine | None:
  """The APRIL rollout engine of ``rollout.partial`` runs (None otherwise)."""
  r = s.rollout
  if not r.partial:
    return None
  return rollout.RolloutEngine(
      s.sampler_cfg, n=s.geometry.samples, max_slots=held_capacity(s), max_new_tokens=r.max_new_tokens,
      max_prompt_len=s.prompt_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      eos_id=s.eos_id, over_sampling=r.over_sampling,
      max_staleness=None if r.max_staleness < 0 else r.max_staleness,
      seed=seed_for(s.train.seed, 0, Stream.ENGINE), mesh=s.sampler_mesh, rules=s.sampler_rules,
      context=s.model_cfg.max_position_embeddings, page_size=r.page_size, kv_pages=r.kv_pages,
      kv_memory_fraction=r.kv_memory_fraction, prefill_chunk=r.prefill_chunk,
      prompt_pages=r.prompt_pages)


def _empty_buffer(s: Setup) -> dict:
  """``ProducerState.held`` of a fresh run: host arrays with nothing held (the multi-turn
  engine's with ``env.name``); with S > 1 engine shares (``engine_shares``) the job-wide
  form, ``stack_shares`` of S empty shares (share j's uids from j·``UID_STRIDE``)."""
  if s.geometry.multi_turn:
    if not s.rollout.partial:
      return {}
    engine = agent_stage.make_engine(s, s.rollout.temperature)
    try:
      return engine.export_held(held_capacity(s))
    finally:
      engine.close()
  engine = make_engine(s)
  if engine is None:
    return {}
  held, S = engine.export_held(held_capacity(s)), engine_shares(s)
  if S == 1:
    return held
  return stack_shares([{**held, "next_uid": np.int32(j * UID_STRIDE), "drawn": np.int32(0)}
                       for j in range(S)])


def _host_parts(s: Setup) -> dict:
  """The host-built parts of a fresh state: the producer's held groups, selector state and
  drafts, and the runner's queue (host arrays)."""
  E = len(s.train_examples)
  producer = {"held": _empty_buffer(s),
              "selector": selection_stage.selector_state(s.selection.kind, s.geometry.adaptive,
                                                            E),
              "drafts": speculative_stage.drafts_state(s.rollout.speculative, s.geometry, E,
                                                       s.model_cfg.vocab_size),
              "replay": replay_stage.empty_buffer(s.train.replay, s.geometry, s.prompt_len,
                                                  len(s.reward_names), s.model_cfg.num_experts,
                                                  jax.process_count())}
  return {"producer": producer, "rollout_queue": queue_lib.setup_queue(s)}


def _with_host_parts(state: TrainState, parts: dict, place) -> TrainState:
  """``state`` with ``_host_parts`` placed by ``place`` (leaf -> array or spec)."""
  parts = jax.tree.map(place, parts)
  return state._replace(producer=state.producer._replace(**parts["producer"]),
                        rollout_queue=parts["rollout_queue"])


def _shardings_like(s: Setup, axes, tree):
  """NamedShardings of ``tree`` (arrays or shapes) from its logical ``axes``."""
  return sharding.logical_to_sharding(axes, s.mesh, s.rules, jax.eval_shape(lambda: tree))


def _init_optimizer(s: Setup, tx, params, param_shardings):
  """``tx.init(params)`` with every params-shaped part of the optimizer state (Adam's moments)
  laid out like the parameters and the rest (counts, scalars) replicated."""
  abstract = jax.eval_shape(tx.init, params)
  out = optax.tree_map_params(tx, lambda _, sh: sh, abstract, param_shardings,
                              transform_non_params=lambda _: _replicated(s))
  return jax.jit(tx.init, out_shardings=out)(params)


def rl_layout(s: Setup, step: int) -> bool:
  """Whether the state after ``step`` completed steps has the RL parts (reference, no
  supervised optimizer state) rather than the supervised stage's: true from step 0 with
  ``sft.steps=0``, else for ``step > sft.steps`` (``begin_rl`` switches at the first RL step,
  so a checkpoint written at ``step == sft.steps`` still has the supervised layout)."""
  sft = s.sft.steps
  return sft == 0 or step > sft


def ref_dtype(s: Setup) -> jnp.dtype:
  """Storage dtype of the frozen reference: ``train.ref_dtype``, default the compute dtype."""
  return jnp.dtype(s.train.ref_dtype or s.model_cfg.dtype)


def reference_copy(s: Setup) -> bool:
  """Whether the run keeps a copy of the policy as its frozen reference: the objective reads
  reference log-probs and the policy is not a base with adapters (LoRA: the reference is
  the base the policy holds, with the adapters off)."""
  return "ref_logp" in s.objective.needs and not s.model_cfg.lora_rank


def make_reference(s: Setup, params):
  """A new buffer per leaf (never the policy's: steps donate those) in ``ref_dtype``;
  ``{}`` when the objective reads no reference log-probs or with LoRA
  (``reference_copy``)."""
  if not reference_copy(s):
    return {}
  dtype = ref_dtype(s)
  return jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), params)


def _state_from_params(s: Setup, params, rl: bool = True) -> TrainState:
  """The rest of a fresh state (optimizer states, reference, critic) from the policy params,
  in the RL layout (``rl``) or the supervised stage's (see ``rl_layout``)."""
  needs = s.objective.needs
  cfg = s.model_cfg
  _, trained = models.lora.trainable(cfg, params)  # the optimizers see the adapters only
  _, trained_axes = models.lora.trainable(cfg, models.param_axes(cfg))
  param_sh = _shardings_like(s, trained_axes, trained)
  ref = make_reference(s, params) if rl else {}
  value, value_opt = {}, {}
  if "values" in needs:  # critic warm-started from (a copy of) the policy trunk
    key = jax.random.key(seed_for(s.train.seed, 0, Stream.CRITIC_INIT))
    value = models.init_value_params(s.model_cfg, key,
                                     policy_params=jax.tree.map(jnp.copy, params))
    value_opt = _init_optimizer(s, s.optimizers.value, value,
                                _shardings_like(s, models.value_axes(s.model_cfg), value))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=_init_optimizer(s, s.optimizers.rl, trained, param_sh),
                    sft_opt_state={} if rl else _init_optimizer(s, s.optimizers.sft, trained,
                                                                param_sh),
                    ref_params=ref, value_params=value, value_opt_state=value_opt,
                    producer=ProducerState(data=jnp.zeros((2,), jnp.int32)))


def _replicated(s: Setup) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())


def _on_mesh(sh, mesh) -> bool:
  return isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == mesh


def init_state(s: Setup) -> TrainState:
  """Fresh state: params from ``model.hf_path`` or a seeded random init, placed sharded
  (with ``model.lora.rank``: that base and fresh adapters, ``adapters``, or those of
  ``model.lora.adapter_path``; with ``model.lora.quant`` the base's projections quantised
  after loading or initialising).

  Arrays the parameter table does not lay out (optimizer counts, step, data position, the
  rollout buffer) are replicated on the mesh, as in ``abstract_state``.
  """
  state = _state_from_params(s, init_params(s), rl_layout(s, 0))  # arrays not laid out on
  # the mesh (optimizer counts, step, data position) are replicated:
  state = jax.tree.map(
      lambda x: x if _on_mesh(x.sharding, s.mesh) else place_replicated(s, x), state)
  state = _with_host_parts(state, _host_parts(s), lambda x: place_replicated(s, x))
  return offload.place(state, offload.offloaded_fields(s))  # train.offload: to host memory


def init_params(s: Setup) -> dict:
  """The policy params of a fresh state (``init_state``), placed sharded: the base the config
  builds (``model.hf_path`` or the seeded random init; with ``model.lora.quant`` quantised),
  with ``model.lora.rank`` beside its initial adapters. Deterministic: LoRA checkpoints that
  name this base (``lora_checkpoint``) rebuild it from here on restore."""
  shardings = models.param_shardings(s.model_cfg, s.mesh, s.rules)
  hf_path = s.model.hf_path
  loaded = _loaded_adapters(s, models.lora.split(shardings)[1])
  if hf_path:  # loaded (a quantised base quantised layer by layer as read), adapters added
    base_sh, _ = models.lora.split(shardings)
    _, params = models.load_hf(hf_path, dtype=jnp.dtype(s.model_cfg.param_dtype),
                               shardings=base_sh, quant=s.model_cfg.quant,
                               quant_block=s.model_cfg.quant_block)
    if loaded is not None:
      params = jax.jit(lambda p, ad: models.quant.quantize_base(
          s.model_cfg, models.lora.combine(p, ad)), out_shardings=shardings)(params, loaded)
    elif s.model_cfg.lora_rank or s.model_cfg.quant:
      params = jax.jit(lambda p: models.quant.quantize_base(
          s.model_cfg, models.lora.combine(p, adapters(s) if s.model_cfg.lora_rank else {})),
          out_shardings=shardings)(params)
    else:  # trained whole: the update donates them, which needs buffers XLA owns
      params = models.hf.own_buffers(params)
  else:
    params = models.init_sharded(s.model_cfg, jax.random.key(s.train.seed), s.mesh,
                                 s.rules, std=s.model.init_std, lora_init=s.model.lora.init)
    if loaded is not None:
      params = models.lora.combine(models.lora.split(params)[0], loaded)
  return params


def _loaded_adapters(s: Setup, shardings) -> dict | None:
  """The adapters of ``model.lora.adapter_path`` (PEFT, checked against the run by
  ``build_setup``) placed straight onto their ``shardings``; None without one."""
  path = s.model.lora.adapter_path
  if not path or not s.model_cfg.lora_rank:
    return None
  host = models.load_hf_adapter(s.model_cfg, path, s.model.hf_path)
  return jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda i: x[i]),
                      host, shardings)


def adapters(s: Setup) -> dict:
  """Fresh adapters of the run (``model.lora``): the ones a random init makes (key
  ``fold_in(key(train.seed), 1)``, ``models.init_params``), for a loaded base too."""
  key = jax.random.fold_in(jax.random.key(s.train.seed), 1)
  return models.lora.init_adapters(s.model_cfg, key, s.model.lora.init)


def place_replicated(s: Setup, x) -> jax.Array:
  """A host array (the same on every process) as an array replicated on the mesh."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, _replicated(s), lambda index: x[index])


def abstract_state(s: Setup, step: int = 0, *, rl: bool | None = None) -> TrainState:
  """Shapes, dtypes and shardings of the state after ``step`` completed steps (step 0:
  ``init_state(s)``), computing and loading nothing.

  The restore target on resume: no HF weights are read and no second copy of the state is
  allocated just to be overwritten by the checkpoint. Which parts exist depends on the step
  (``rl_layout``): the checkpoint of step k holds exactly ``abstract_state(s, k)``. ``rl``
  forces the RL (True) or supervised (False) layout whatever the step.
  """
  offloaded = offload.offloaded_fields(s)  # checked first: a bad train.offload fails here
  cfg = s.model_cfg
  shapes = jax.eval_shape(functools.partial(models.init_params, cfg), jax.random.key(0))
  params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        shapes, models.param_shardings(cfg, s.mesh, s.rules))
  rl = rl_layout(s, step) if rl is None else rl
  build = jax.jit(functools.partial(_state_from_params, s, rl=rl))
  shapes = jax.eval_shape(build, params)
  out = build.lower(params).compile().output_shardings
  replicated = _replicated(s)

  def spec(x, sh):
    return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                sharding=sh if _on_mesh(sh, s.mesh) else replicated)

  state = jax.tree.map(spec, shapes, out)
  state = _with_host_parts(state, _host_parts(s), lambda x: jax.ShapeDtypeStruct(
      np.shape(x), np.asarray(x).dtype, sharding=replicated))
  return offload.host_specs(state, offloaded)


def begin_rl(s: Setup, state: TrainState) -> TrainState:
  """At the first RL step: the supervised optimizer state is dropped and the reference
  becomes a copy of the current policy (in ``ref_dtype``). A state already in the RL
  layout (``sft.steps=0``: made so by ``init_state``) is returned unchanged.

  With LoRA the supervised adapters are merged into the base, which becomes the reference
  (adapters off), and RL starts from fresh adapters (B = 0: the policy is unchanged). With
  ``model.lora.quant`` the merged base is quantised again.
  """
  if not jax.tree.leaves(state.sft_opt_state) and (
      jax.tree.leaves(state.ref_params) or not reference_copy(s)):
    return state
  state = state._replace(sft_opt_state={})
  if s.model_cfg.lora_rank:
    state = state._replace(params=_restart_adapters(s)(state.params))
  state = state._replace(ref_params=_copy_reference(s)(state.params))
  return offload.place(state, offload.offloaded_fields(s))


def _restart_adapters(s: Setup):
  """``params -> merge(params) + adapters(s)``, jitted onto the parameters' shardings (the
  input is donated)."""
  cfg = s.model_cfg
  fn = lambda p: models.lora.combine(
      models.quant.quantize_base(cfg, models.lora.merge(cfg, p)), adapters(s))
  return jax.jit(fn, out_shardings=models.param_shardings(s.model_cfg, s.mesh, s.rules),
                 donate_argnums=0)


def _copy_reference(s: Setup):
  """``make_reference`` jitted with the parameters' shardings (a reference laid out like
  the policy, cast on device)."""
  return jax.jit(functools.partial(make_reference, s))
