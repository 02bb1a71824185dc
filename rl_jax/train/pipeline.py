"""Asynchronous RL: a rollout producer that samples while the learner updates.

``train.mode="async"`` runs the producer side of a step (``rollouts.produce``: draw prompts,
sample, score) in a second thread of the same JAX controller, on the rollout mesh
(``mesh.rollout_devices``; or the training devices), while the main thread runs the learner
side (proximal log-probs, advantages, optax updates) on the training mesh. Weights reach the
producer as a device-to-device copy (``publish``), never through the host. Every sampled
token carries the policy version (completed steps) that produced it; the learner's
objective sees the behaviour log-probs, the proximal log-probs of its current weights and
the versions, so decoupled PPO, truncated IS, M2PO and VCPO correct the lag (see
docs/ALGORITHMS.md, "Asynchronous training").

Two schedules:

* **fixed lag** (``train.async_lag = k >= 0``): the batch of step t is sampled by the weights
  of step t - k (the first k RL steps use the weights RL starts from). At step t the producer
  samples batch t + k from the current weights while the learner trains on batch t from the
  queue, and both finish before the step ends. Nothing depends on thread timing: the same seed
  gives the same run, k = 0 is the synchronous trainer exactly, and the queue (k scored
  batches) and the producer's position (prompt sampler, held partial rollouts) are part of the
  train state, so a resumed run continues bit-exactly.
* **free-running** (``train.async_lag = -1``): the producer samples continuously from the
  newest published weights into a bounded queue. AReaL's admission rule bounds the lag: the
  producer starts batch i only when the learner has completed at least i - η updates
  (η = ``rollout.max_staleness``), so no batch is consumed more than η versions after the
  weights that started it; tokens of held partial rollouts older than η are masked from the
  loss. Throughput is the point; results depend on timing. A checkpoint holds the queue and
  the producer position at that moment.

Shapes (package legend): G groups, M samples per prompt, R new tokens; a queue of Q batches.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from rl_jax.train import queue as queue_lib
from rl_jax.train.rollouts import Scored, Trainer, learner_batch, produce
from rl_jax.train.state import TrainState, place_replicated

__all__ = ["queue_from_arrays", "publish", "FixedLag", "FreeRunning", "make_runner"]


def queue_from_arrays(arrays: dict) -> list[Scored]:
  """The queued batches of ``TrainState.rollout_queue``, oldest first."""
  return [Scored(**x) for x in queue_lib.from_arrays(arrays)]


def publish(t: Trainer, params) -> Any:
  """The policy for the producer: a device-to-device copy on the rollout mesh that never
  aliases the learner's buffers (the update donates them)."""
  layout = t.layout
  if layout.sampler_mesh is layout.mesh:  # shared devices: a copy laid out like the weights
    target = jax.tree.map(lambda x: x.sharding, params)
  else:  # the producer's own devices: a replica on each
    target = jax.sharding.NamedSharding(layout.sampler_mesh, jax.sharding.PartitionSpec())
  return jax.device_put(params, target, may_alias=False)


def _apply(t: Trainer, state: TrainState, updates: dict) -> TrainState:
  """``state`` with the producer's advanced fields (data position, held groups, ...); host
  arrays are placed replicated, like the rest of the state."""
  place = lambda x: place_replicated(t.setup, x) if isinstance(x, np.ndarray) else x
  return state._replace(**{k: jax.tree.map(place, v) for k, v in updates.items()})


def _with_queue(t: Trainer, state: TrainState, items: list[Scored]) -> TrainState:
  s = t.setup
  arrays = queue_lib.to_arrays(s.config, items)
  return state._replace(rollout_queue=jax.tree.map(lambda x: place_replicated(s, x), arrays))


class _Timing(NamedTuple):
  producer_busy_s: float
  learner_busy_s: float
  learner_wait_s: float
  wall_s: float


def _timing_metrics(x: _Timing, depth: int) -> dict[str, float]:
  """Producer / learner idle time and utilisation of one step, and the queue depth."""
  wall = max(x.wall_s, 1e-9)
  return {"queue_depth": float(depth),
          "producer_idle_s": max(wall - x.producer_busy_s, 0.0),
          "learner_idle_s": x.learner_wait_s,
          "producer_utilisation": min(x.producer_busy_s / wall, 1.0),
          "learner_utilisation": min(x.learner_busy_s / wall, 1.0)}


class FixedLag:
  """The deterministic k-step-off pipeline (see the module docstring).

  ``step(state, update)`` trains on the queued batch of this step while the producer samples
  the batch k steps ahead; ``update(state, batch) -> (state, metrics)`` is the learner's
  optimizer step (``loop.apply_update``).
  """

  def __init__(self, t: Trainer, state: TrainState):
    self.t = t
    self.k = t.setup.config.train.async_lag
    # the queued batches stay on the host between steps; ``snapshot`` writes them into the
    # state only when a checkpoint is saved
    self.queue = queue_from_arrays(state.rollout_queue)
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")

  def _produce(self, params, state: TrainState, step: int, version: int):
    t0 = time.perf_counter()
    G = self.t.setup.config.train.batch_groups
    scored, updates = produce(self.t, params, state, step=step, version=version, lo=0, hi=G)
    return scored, updates, time.perf_counter() - t0

  def step(self, state: TrainState, update) -> tuple[TrainState, dict]:
    t, k = self.t, self.k
    t_start = time.perf_counter()
    step = int(state.step)
    queue = self.queue
    params = publish(t, state.params)
    fill_s = 0.0
    while len(queue) < k:  # pipeline fill (first RL step): steps step..step+k-1, weights now
      scored, updates, busy = self._produce(params, state, step + len(queue), step)
      state, fill_s = _apply(t, state, updates), fill_s + busy
      queue.append(scored)
    # the producer samples batch step+k from the weights of this step ...
    future = self.pool.submit(self._produce, params, state, step + k, step)
    if k == 0:  # ... which is this step's batch: nothing to overlap (the sync trainer)
      queue.append(future.result()[0])  # (its producer fields are applied below)
    depth = len(queue)
    t0 = time.perf_counter()
    batch, record = learner_batch(t, state, queue.pop(0))  # ... while the learner trains
    state, mets = update(state, batch)
    learner_busy = time.perf_counter() - t0
    t1 = time.perf_counter()
    scored, updates, busy = future.result()
    wait = time.perf_counter() - t1
    if k:
      queue.append(scored)
    state = _apply(t, state, updates)
    timing = _Timing(busy + fill_s, learner_busy, wait, time.perf_counter() - t_start)
    return state, {**record, **mets, **_timing_metrics(timing, depth)}

  def snapshot(self, state: TrainState) -> TrainState:
    """The state to checkpoint: ``state`` with the queued batches."""
    return _with_queue(self.t, state, self.queue)

  def close(self) -> None:
    self.pool.shutdown(wait=True)


class FreeRunning:
  """The free-running producer (see the module docstring): a thread that samples from the
  newest published weights into a bounded queue under the staleness bound η."""

  def __init__(self, t: Trainer, state: TrainState):
    c = t.setup.config
    self.t, self.eta = t, c.rollout.max_staleness
    self.capacity = queue_lib.capacity(c)
    self.cond = threading.Condition()
    self.queue: list[tuple[Scored, dict]] = [(x, {}) for x in
                                             queue_from_arrays(state.rollout_queue)]
    self.learner_version = int(state.step)
    self.first = int(state.step)  # batch i (from 0) is trained at step first + i
    self.started = len(self.queue)  # batches started (queued ones included)
    self.params = (int(state.step), publish(t, state.params))
    self.producer_state = state  # the producer's chain (data position, held groups)
    self.after_last = {}  # producer fields after the newest queued batch
    self.busy_s = 0.0
    self.error: BaseException | None = None
    self.stopping = False
    self.thread = threading.Thread(target=self._run, name="rollout", daemon=True)
    self.thread.start()

  def _admitted(self) -> bool:
    """AReaL admission: batch ``started`` may start once the learner has trained at least
    ``started - η`` batches, and the queue has room."""
    room = len(self.queue) < self.capacity
    done = self.learner_version - self.first
    return room and (self.eta < 0 or self.started - done <= self.eta)

  def _run(self) -> None:
    G = self.t.setup.config.train.batch_groups
    try:
      while True:
        with self.cond:
          self.cond.wait_for(lambda: self.stopping or self._admitted())
          if self.stopping:
            return
          version, params = self.params
          index = self.started
          self.started += 1
        t0 = time.perf_counter()
        scored, updates = produce(self.t, params, self.producer_state,
                                  step=self.first + index, version=version, lo=0, hi=G)
        self.producer_state = _apply(self.t, self.producer_state, updates)
        with self.cond:
          self.busy_s += time.perf_counter() - t0
          self.queue.append((scored, updates))
          self.cond.notify_all()
    except BaseException as e:  # surfaced in the learner's thread
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def step(self, state: TrainState, update) -> tuple[TrainState, dict]:
    t_start = time.perf_counter()
    with self.cond:
      self.cond.wait_for(lambda: self.queue or self.error is not None)
      if self.error is not None:
        raise self.error
      depth = len(self.queue)
      scored, updates = self.queue.pop(0)
      busy0, self.busy_s = self.busy_s, 0.0
      self.cond.notify_all()
    wait = time.perf_counter() - t_start
    if updates:
      self.after_last = updates
    t0 = time.perf_counter()
    batch, record = learner_batch(self.t, state, scored, max_lag=self.eta)
    state, mets = update(state, batch)
    new_params = publish(self.t, state.params)
    learner_busy = time.perf_counter() - t0
    with self.cond:
      self.learner_version = int(state.step) + 1
      self.params = (int(state.step) + 1, new_params)
      self.cond.notify_all()
    timing = _Timing(busy0, learner_busy, wait, time.perf_counter() - t_start)
    return state, {**record, **mets, **_timing_metrics(timing, depth)}

  def snapshot(self, state: TrainState) -> TrainState:
    """``state`` with the queue and the producer position as of the newest queued batch (a
    batch being sampled is dropped and sampled again after a resume)."""
    with self.cond:
      items = [x for x, _ in self.queue]
      fields = dict(self.after_last)
      for _, u in self.queue:
        fields.update(u)
    return _with_queue(self.t, _apply(self.t, state, fields), items)

  def close(self) -> None:
    with self.cond:
      self.stopping = True
      self.cond.notify_all()
    self.thread.join()


def make_runner(t: Trainer, state: TrainState):
  """The asynchronous schedule of ``train.async_lag`` (FixedLag or FreeRunning)."""
  if t.setup.config.train.async_lag >= 0:
    return FixedLag(t, state)
  return FreeRunning(t, state)
