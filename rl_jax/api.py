"""Training primitives over the train state, for RL loops written by hand.

``Trainer(config)`` holds the state of ``rl_jax.train`` (the same ``TrainState``, mesh,
shardings and compiled passes) and exposes one step of it in pieces::

    run = rl_jax.api.Trainer(config)
    examples = run.next_examples(G)                # the trainer's seeded prompt sampler
    prompts = [e.prompt for e in examples]         # text: encoded as the trainer does
    out = run.sample(prompts, n=M)                 # rollout.generate with the current weights
    rewards = ...                                  # [G·M] host floats, your reward
    run.forward_backward(run.batch(prompts, out, rewards))   # gradients accumulate
    run.optim_step()                               # the configured optimizer; clears them

``forward_backward`` and ``optim_step`` are the two halves of the trainer's RL update
(``train.steps.rl_grads`` and ``train.steps.rl_apply``), each compiled with the trainer's
shardings, so the loop above with the trainer's prompts and seeds reproduces
``rl_jax.train.train`` bit for bit (``tests/test_api.py``). ``save`` / ``load`` write and read
the trainer's orbax checkpoints (a run's ``DIR/checkpoints`` loads as well).

Shapes (the package legend, ``rl_jax/__init__.py``): G groups (prompts), M samples per
prompt, P prompt bucket (``Setup.prompt_len``), R new tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from etils import epath
import jax
import ml_collections
import numpy as np

from rl_jax import checkpoint as ckpt_lib
from rl_jax import losses
from rl_jax import models
from rl_jax import rollout
from rl_jax.data.tokenizers import encode_prompt
from rl_jax.errors import CheckpointNotFoundError, RLJaxError
from rl_jax.train import accumulate
from rl_jax.train import lora_checkpoint
from rl_jax.train.context import build_setup
from rl_jax.train.inputs import SINGLE_TURN_INPUTS, Source, make_inputs
from rl_jax.train.layout import jit_on_mesh
from rl_jax.train.loop import make_trainer
from rl_jax.train.on_policy import old_logp_in_update
from rl_jax.train.resume import restore_state
from rl_jax.train.rollouts import next_examples, pad_prompts
from rl_jax.train.state import (TrainState, abstract_state, begin_rl, init_state,
                                place_replicated, rl_layout)
from rl_jax.train.steps import UpdateBatch, rl_apply, rl_grads
from rl_jax.train.streams import Stream, seed_for
from rl_jax.value_checks import is_int

__all__ = ["Batch", "Trainer"]

class Batch(NamedTuple):
  """G groups of M sampled completions, as ``forward_backward`` and ``logprobs`` take them
  (host or device arrays).

  Attributes:
    prompt_tokens: int32 [G,P] right-padded prompt ids.
    prompt_lengths: int32 [G] valid prompt lengths.
    tokens: int32 [G,M,R] completion ids.
    mask: bool [G,M,R] completion tokens that enter the loss.
    rewards: float32 [G,M] sequence rewards; the objective's estimator turns them into
      advantages (None: ``advantages`` must be given).
    behaviour_logp: float32 [G,M,R] log-probs of the sampled tokens under the sampler
      (``sample(...).logprobs``); None: the current weights' (an on-policy batch).
    advantages: float32 [G,M] or [G,M,R]; given, they replace the estimator's.
    old_logp: float32 [G,M,R] proximal log-probs the ratio is taken against; None: the
      current weights' (as the trainer does; pass ``logprobs(batch)`` taken before the first
      ``optim_step`` to reuse them over several updates of one batch). Ignored when the
      update takes them from its own pass (``train.old_logp_pass=auto`` with an objective
      that only ever trains on-policy batches: they are the current weights' anyway).
  """

  prompt_tokens: Any
  prompt_lengths: Any
  tokens: Any
  mask: Any
  rewards: Any = None
  behaviour_logp: Any = None
  advantages: Any = None
  old_logp: Any = None


def _check_rewards(rewards) -> None:
  """One line unless ``rewards`` (None, or an array-like) holds numbers that are finite or
  NaN (a missing sample); an infinite reward would be dropped as silently as a NaN one."""
  if rewards is None:
    return
  r = np.asarray(rewards)
  if r.dtype == bool or not np.issubdtype(r.dtype, np.number):
    raise RLJaxError(f"api: rewards must be numbers (NaN marks a missing sample), got an "
                     f"array of {r.dtype}")
  if np.isinf(r).any():
    raise RLJaxError(f"api: reward {np.flatnonzero(np.isinf(r))[0]} is infinite; a reward is "
                     "a finite number, or NaN for a missing sample")


def _rows(x, G: int, name: str, shape_tail: tuple) -> np.ndarray:
  """``x`` ([G·M,...] or [G,M,...]) as a host array [G,M,...]; a wrong size is one error."""
  x = np.asarray(x)
  if x.size != G * int(np.prod(shape_tail)):
    raise RLJaxError(f"api: {name} has shape {x.shape}; expected {(G,) + shape_tail} or "
                     f"{(G * shape_tail[0],) + shape_tail[1:]} rows")
  return x.reshape((G,) + shape_tail)


class Trainer:
  """The trainer's state with its primitives (see the module docstring).

  Attributes:
    setup: the run's ``rl_jax.train.Setup`` (tokenizer, task, examples, geometry).
    trainer: the run's ``rl_jax.train.TrainParts`` (layout, compiled steps).
    state: the ``TrainState`` (in the RL layout: the reference, if any, is the policy the
      primitives started from).
  """

  def __init__(self, config: ml_collections.ConfigDict, state: TrainState | None = None):
    """``config``: a trainer config (``config_utils.load_config``); ``state``: start from this
    train state instead of ``init_state`` (e.g. after a supervised stage)."""
    self.setup = s = build_setup(config)
    self._abstract = abstract_state(s)
    self.trainer = make_trainer(s, self._abstract)
    self.state = begin_rl(s, init_state(s) if state is None else state)
    self._pending: accumulate.Accumulated | None = None
    apply = rl_apply(s)
    st, lay = self.trainer.layout.state, self.trainer.layout
    weights = (st.params, st.opt_state, st.value_params, st.value_opt_state)
    self._apply = jit_on_mesh(
        lambda p, o, v, vo, acc: apply(p, o, v, vo, acc.grads, acc.value_grads, acc.loss,
                                       acc.metrics),
        lay, donate_argnums=(0, 1, 2, 3), out_shardings=(*weights, lay.replicated))
    self._combine = jax.jit(accumulate.combine, donate_argnums=(0,))
    self._grads: dict[int, tuple] = {}  # id(objective) -> (objective, compiled rl_grads)

  # ------------------------------------------------------------------------ prompts, sampling
  @property
  def step(self) -> int:
    """Completed optimizer steps (``optim_step`` calls; the trainer's ``state.step``)."""
    return int(self.state.step)

  def next_examples(self, n: int) -> list:
    """The next ``n`` training examples of the trainer's seeded prompt sampler (its position
    lives in the state and advances)."""
    if not is_int(n) or n < 1:
      raise RLJaxError(f"api: next_examples takes a positive int count, got {n!r}")
    examples, data = next_examples(self.setup, np.asarray(self.state.producer.data), n)
    self.state = self.state._replace(producer=self.state.producer._replace(
        data=place_replicated(self.setup, data)))
    return examples

  def sample(self, prompts: Sequence[Sequence[int] | str], n: int | None = None, *,
             temperature: float | None = None, max_new_tokens: int | None = None,
             top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
             first_index: int = 0) -> rollout.Rollout:
    """``rollout.generate`` with the current weights on the sampler's mesh.

    Args:
      prompts: G prompts, token-id lists or strings (encoded with the run's tokenizer).
      n: samples per prompt M (default ``rollout.n``).
      temperature, max_new_tokens, top_p, top_k: default the ``rollout`` config's.
      seed: default the trainer's rollout stream at this step, so the trainer's prompts
        give the trainer's samples.
      first_index: key stream of the first prompt (prompt i samples from stream
        ``first_index + i``).

    Returns:
      ``tokens`` int32 [G·M,R], ``mask`` bool [G·M,R], ``logprobs`` float32 [G·M,R]
      (behaviour log-probs), rows grouped by prompt.
    """
    s, r = self.setup, self.setup.rollout
    prompts = [encode_prompt(s.tokenizer, p) if isinstance(p, str) else list(p)
               for p in prompts]
    pick = lambda x, default: default if x is None else x
    seed = pick(seed, seed_for(s.train.seed, self.step, Stream.ROLLOUT))
    return rollout.generate(
        s.sampler_cfg, self.trainer.layout.sampler_params(self.state.params), prompts,
        n=pick(n, s.geometry.samples), max_new_tokens=pick(max_new_tokens, r.max_new_tokens),
        temperature=pick(temperature, r.temperature), top_p=pick(top_p, r.top_p),
        top_k=pick(top_k, r.top_k), eos_id=s.eos_id, seed=seed, first_index=first_index,
        mesh=s.sampler_mesh, rules=s.sampler_rules)

  def batch(self, prompts: Sequence[Sequence[int] | str], out, rewards=None, *,
            advantages=None) -> Batch:
    """A ``Batch`` from G prompts and ``sample``'s output for them (M = rows / G): prompts
    padded to the run's prompt bucket, the sampled mask as the loss mask, the sampled
    log-probs as behaviour log-probs; ``rewards`` [G·M] or [G,M] (NaN marks a missing
    sample: the built-in estimators leave it out of its group's statistics and give it
    advantage 0); ``advantages`` likewise (or [G,M,R])."""
    s = self.setup
    prompts = [encode_prompt(s.tokenizer, p) if isinstance(p, str) else list(p)
               for p in prompts]
    G = len(prompts)
    for i, p in enumerate(prompts):
      if len(p) > s.prompt_len:
        raise RLJaxError(f"api: prompt {i} has {len(p)} tokens; the run's programs take "
                         f"prompts of at most {s.prompt_len} (its data's longest prompt + 1)")
    _check_rewards(rewards)
    tokens = np.asarray(out.tokens)
    M, R = tokens.shape[0] // G, tokens.shape[1]
    pt, pl = pad_prompts(prompts, s.prompt_len, s.tokenizer.pad_id)
    as_rows = lambda x, name, tail: None if x is None else _rows(x, G, name, tail)
    adv = None if advantages is None else np.asarray(advantages)
    return Batch(pt, pl, as_rows(tokens, "tokens", (M, R)), as_rows(out.mask, "mask", (M, R)),
                 as_rows(rewards, "rewards", (M,)), as_rows(out.logprobs, "logprobs", (M, R)),
                 None if adv is None else as_rows(adv, "advantages",
                                                  (M,) if adv.size == G * M else (M, R)))

  # ----------------------------------------------------------------------- passes, updates
  def _put(self, x, dtype) -> jax.Array | None:
    """A whole host batch (the same on every process) as a global array split along
    ``batch``: each process places the rows that live on its devices."""
    if x is None:
      return None
    x, lay = np.asarray(x, dtype), self.trainer.layout
    lo, hi = lay.share(x.shape[0])
    return lay.put(x[lo:hi], x.shape[0])

  def _placed(self, b: Batch) -> tuple:
    """(prompt tokens, prompt lengths, tokens, mask) on the training mesh."""
    G, M, R = np.shape(b.tokens)
    if np.shape(b.prompt_tokens)[0] != G or np.shape(b.mask) != (G, M, R):
      raise RLJaxError(f"api: batch shapes differ: prompt_tokens {np.shape(b.prompt_tokens)}, "
                       f"tokens {(G, M, R)}, mask {np.shape(b.mask)} (want [G,P], [G,M,R])")
    lay = self.trainer.layout
    if G != self.setup.geometry.rows and lay.rows(G) != lay.rows(self.setup.geometry.rows):
      raise RLJaxError(f"api: a batch of {G} groups does not divide over the batch axes of "
                       f"the mesh; use a multiple of their size")
    return (self._put(b.prompt_tokens, np.int32), self._put(b.prompt_lengths, np.int32),
            self._put(b.tokens, np.int32), self._put(b.mask, bool))

  def logprobs(self, b: Batch) -> jax.Array:
    """Per-token log-probs float32 [G,M,R] of ``b``'s completions under the current weights
    (at the sampling temperature, the trainer's pass; 0 where ``mask`` is False)."""
    return self.trainer.steps.logprobs(self.state.params, *self._placed(b))

  def _update_batch(self, b: Batch, obj: losses.Objective) -> UpdateBatch:
    """``b`` as the trainer's ``UpdateBatch``: the objective inputs ``obj`` needs, made as
    the trainer makes them (``inputs.INPUTS``), and its advantages."""
    t, s = self.trainer, self.setup
    args = self._placed(b)
    if b.rewards is None and b.advantages is None:
      raise RLJaxError("api: a batch needs rewards or advantages")
    rewards = (b.rewards if b.rewards is not None
               else np.zeros(np.shape(b.tokens)[:2], np.float32))
    own_old = old_logp_in_update(s.train, s.schedule.overlapped, s.rollout.partial, obj)
    if "ref_logp" in obj.needs and not jax.tree.leaves(self.state.ref_params):
      raise RLJaxError("api: the loss needs a reference (a KL term) but the config's "
                       "objective keeps none; set loss.kl_beta > 0 in the config")
    if "values" in obj.needs and not jax.tree.leaves(self.state.value_params):
      raise RLJaxError("api: the loss needs a critic but the config's objective has none; "
                       "configure a value-based objective (loss.preset=ppo)")
    if "teacher_logp" in obj.needs and t.teacher is None:
      raise RLJaxError("api: the loss reads a teacher's log-probs but the config has no "
                       "teacher; set distill.teacher_path in the config")
    unknown = sorted(set(obj.needs) - SINGLE_TURN_INPUTS)
    if unknown:
      raise RLJaxError(f"api: the loss needs {unknown}, which single-turn batches do not "
                       "provide")
    steps = t.steps._replace(old_logp_in_update=own_old or b.old_logp is not None)
    behaviour = (self._put(b.behaviour_logp, np.float32) if b.behaviour_logp is not None
                 else t.steps.logprobs(self.state.params, *args))
    src = Source(steps, self.state, args, self._put(rewards, np.float32), args[3], behaviour,
                 s.train.seed, teacher=t.teacher)
    inputs = make_inputs(obj.needs, src)
    if b.old_logp is not None and not own_old:
      inputs = inputs._replace(old_logp=self._put(b.old_logp, np.float32))
    adv = (obj.advantages_from(inputs) if b.advantages is None
           else losses.Advantages(self._put(b.advantages, np.float32)))
    return UpdateBatch(args[0], args[1], args[2], inputs, adv)

  def _grads_fn(self, obj: losses.Objective):
    """``rl_grads`` for ``obj`` compiled with the trainer's shardings (gradients laid out like
    the weights they belong to); one compiled function per objective."""
    if id(obj) not in self._grads:
      lay = self.trainer.layout
      st = lay.state
      trained = models.lora.trainable(self.setup.model_cfg, st.params)[1]  # LoRA: adapters
      self._grads[id(obj)] = obj, jit_on_mesh(rl_grads(self.setup, obj), lay, out_shardings=(
          lay.replicated, lay.replicated, lay.replicated, trained, st.value_params))
    return self._grads[id(obj)][1]

  def forward_backward(self, b: Batch, loss: losses.Objective | None = None) -> dict:
    """Gradients of ``loss`` (default: the configured objective, ``Setup.objective``) on
    ``b``, accumulated into the pending update; returns this batch's metrics (host floats:
    ``loss`` and the objective's).

    Several calls before one ``optim_step`` give the gradient of the whole batch: each
    micro-batch's gradient is weighted by its loss denominator (``Objective.loss`` returns
    ``(loss_sum, denom)``), which is exact up to float rounding when the micro-batches are
    whole groups (advantages are per group) and the objective takes no statistic over the
    whole batch (M2PO's bound is one).
    """
    obj = self.setup.objective if loss is None else loss
    ub = self._update_batch(b, obj)
    st = self.state
    value, denom, mets, grads, vgrads = self._grads_fn(obj)(st.params, st.value_params, ub)
    new = accumulate.start(value, denom, mets, grads, vgrads)
    self._pending = new if self._pending is None else self._combine(self._pending, new)
    out = jax.device_get(dict(mets, loss=value))
    return {k: float(v) for k, v in out.items()}

  @property
  def gradients(self) -> Any:
    """The accumulated policy gradients (a params-shaped pytree, the adapters only with LoRA;
    laid out like the weights), or None; the next ``forward_backward`` consumes them (copy
    what you keep)."""
    return None if self._pending is None else self._pending.grads

  def zero_grad(self) -> None:
    """Drops the accumulated gradients without applying them."""
    self._pending = None

  def optim_step(self) -> dict:
    """Applies the accumulated gradients with the configured optimizer (the trainer's
    update: skipped if not finite, VCPO's ESS scale, the critic alongside) and clears them;
    ``state.step`` advances by one. Returns the update's metrics (``loss``, ``grad_norm``,
    ``update_skipped``, ...) as host floats."""
    if self._pending is None:
      raise RLJaxError("api: optim_step without gradients; call forward_backward first")
    st = self.state
    p, o, v, vo, mets = self._apply(st.params, st.opt_state, st.value_params,
                                    st.value_opt_state, self._pending)
    self._pending = None
    self.state = st._replace(params=p, opt_state=o, value_params=v, value_opt_state=vo,
                             step=st.step + 1)
    return {k: float(x) for k, x in jax.device_get(mets).items()}

  # ---------------------------------------------------------------------------- checkpoints
  def save(self, path: str) -> None:
    """Writes the train state as the trainer's checkpoint of this step under ``path`` (an
    orbax checkpoint directory; ``load`` and a run's resume read it). Gradients not yet
    applied are not saved. With LoRA the checkpoint holds the adapters and the frozen base
    goes once into ``path/base/`` (``rl_jax.train.lora_checkpoint``)."""
    with ckpt_lib.Checkpointer(path, keep=None, save_every=0) as ckpt:
      state, meta = lora_checkpoint.for_checkpoint(self.setup, ckpt, self.state,
                                                   from_config=False)
      ckpt.save(self.step, state, metadata=meta, force=True)

  def load(self, path: str, step: int | None = None) -> None:
    """Reads the checkpoint of ``step`` (default the newest) under ``path`` (``save``'s
    directory or a run's ``DIR/checkpoints``) into the state; pending gradients are dropped."""
    s = self.setup
    if not epath.Path(path).is_dir():  # (a Checkpointer would create it)
      raise CheckpointNotFoundError(f"api: no checkpoint directory {path}")
    with ckpt_lib.Checkpointer(path, keep=None, save_every=0) as ckpt:
      step = ckpt.latest_step() if step is None else step
      if step is None or step not in ckpt.all_steps():
        raise CheckpointNotFoundError(f"api: no checkpoint{'' if step is None else f' of step {step}'}"
                                      f" under {path}")
      target = (self._abstract if rl_layout(s, step) == rl_layout(s, 0)
                else abstract_state(s, step))
      self.state = begin_rl(s, restore_state(s, ckpt, step, target))
    self._pending = None
