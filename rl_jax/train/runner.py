"""The runner: joins the producer (``producer.produce``) and the learner
(``learner.learner_batch`` + ``learner.apply_update``) into RL steps. Every mode is a runner;
``make_runner`` picks it from the setup's ``Schedule`` (``train.mode``, ``train.async_lag``):

* **fixed lag k** (``FixedLag``): the batch of step t is sampled by the weights of step
  t - k (the first k RL steps use the weights RL starts from). k = 0 is the synchronous
  trainer: the producer samples this step's batch from the current weights, then the learner
  trains on it. With k >= 1 (``train.mode="async"``, ``train.async_lag=k``) the producer
  samples batch t + k in a second thread of the same JAX controller, on the rollout mesh
  (``mesh.rollout_devices``; or the training devices), while the learner trains on batch t
  from the queue, and both finish before the step ends. Nothing depends on thread timing:
  the same seed gives the same run, and the queue (k scored batches) and the producer's
  position (``ProducerState``) are part of the train state, so a resumed run continues
  bit-exactly. With several processes both meshes span every process (each gives its
  first ``mesh.rollout_devices / P`` devices to the rollout mesh and the rest to the
  training mesh, ``context.split_devices``): every process runs the learner's global
  programs and the weight hand-off in the same order, and its producer samples its own
  groups (``Layout.share``) on its own rollout devices. Each process queues only its
  groups; the checkpointed queue holds the job's (``job_wide``) and a resumed process takes
  its share back (``own_share``). Partial rollouts (``rollout.partial``) split the same
  way: each process runs and holds only its APRIL engine shares (``held_shares``); the
  checkpoint holds the job's S shares (``job_wide_held``).
* **free-running** (``FreeRunning``, ``train.async_lag=-1``): the producer samples
  continuously from the newest published weights into a bounded queue. AReaL's admission rule
  bounds the lag: the producer starts batch i only when the learner has completed at least
  i - η updates (η = ``rollout.max_staleness``), so no batch is consumed more than η versions
  after the weights that started it; tokens of held partial rollouts older than η are masked
  from the loss. Throughput is the point; results depend on timing. A checkpoint holds the
  queue and the producer position at that moment. One process only (the processes of a job
  would sample from different versions).

With a lag, weights reach the producer as a device-to-device copy (``publish``; with
several processes after a jitted all-gather on the training mesh), never through the host.
Every sampled token carries the policy version (completed steps) that produced it; the
learner's objective sees the behaviour log-probs, the proximal log-probs of its current
weights and the versions, so decoupled PPO, truncated IS, M2PO and VCPO correct the lag
(docs/ALGORITHMS.md, "Asynchronous training").

Shapes (the package legend, ``rl_jax/__init__.py``): G groups, M samples per prompt, R new
tokens; a queue of Q batches.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, NamedTuple

import jax
from jax.experimental import multihost_utils
import numpy as np

from rl_jax.train import queue as queue_lib
from rl_jax.train import replay_stage
from rl_jax.train.learner import apply_update, learner_batch
from rl_jax.train.producer import produce, source
from rl_jax.train.records import ProducerState, Scored, array_fields
from rl_jax.train.rollouts import TrainParts
from rl_jax.train.state import TrainState, engine_shares, place_replicated, take_shares

__all__ = ["queue_from_arrays", "publish", "collect", "splits_groups", "job_wide", "own_share",
           "held_shares", "job_wide_held",
           "FixedLag", "FreeRunning", "make_runner"]


def queue_from_arrays(arrays: dict) -> list[Scored]:
  """The queued batches of ``TrainState.rollout_queue``, oldest first."""
  return [Scored(**x) for x in queue_lib.from_arrays(arrays)]


def publish(t: TrainParts, params) -> Any:
  """The policy for a producer that runs beside the learner: a device-to-device copy on the
  rollout mesh that never aliases the learner's buffers (the update donates them), its
  projections in the sampler's compute dtype (``Layout.narrowed``)."""
  layout = t.layout
  params = layout.narrowed(layout.sampler_weights(params))
  if layout.shared_sampler:  # the weights' own layout: a copy laid out like them
    target = jax.tree.map(lambda x: x.sharding, params)
    return jax.device_put(params, target, may_alias=False)
  # the producer's own devices: a replica on each (with several processes each process's
  # rollout devices, copied from the replica of a jitted all-gather)
  return layout.local_params(params)


def collect(t: TrainParts, state: TrainState) -> tuple[Any, dict, ProducerState]:
  """The lag-0 runner's step without the update: this step's batch from the current weights
  through the producer and the learner's ``learner_batch``; (the update batch, the rollout
  metrics, the producer's next position)."""
  lo, hi = t.layout.share(t.setup.geometry.rows)
  step = int(state.step)
  scored, producer = produce(t, t.layout.sampler_params(state.params), state.producer,
                             step=step, version=step, lo=lo, hi=hi)
  batch, info = learner_batch(t, state, scored, staleness=t.setup.schedule.overlapped
                              or replay_stage.enabled(t.setup.train))
  return batch, info, producer


def splits_groups(t: TrainParts) -> bool:
  """Whether each process samples only its own groups (``Layout.share``): the fresh source
  or the APRIL engine's shares (``held_shares``) with several processes and a batch split
  along ``batch``."""
  G = t.setup.geometry.rows
  return source(t) in ("fresh", "engine") and t.layout.share(G) != (0, G)


def job_wide(x: Scored) -> Scored:
  """A batch of this process's groups (g of them) as the job's G, in process order (the
  queue's checkpointed form); faults are the job's totals. A collective: every process
  calls it, in the same order."""
  gather = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
  arrays = {k: gather(getattr(x, k)) for k in array_fields() if k != "faults"}
  if x.routing is not None:
    arrays["routing"] = gather(x.routing)
  if x.components is not None:
    arrays["components"] = gather(x.components)
  faults = np.asarray(multihost_utils.process_allgather(x.faults)).sum(axis=0)
  return x._replace(faults=faults, **arrays)


def own_share(x: Scored, lo: int, hi: int, lead: bool) -> Scored:
  """Groups ``[lo, hi)`` of a job-wide batch (``job_wide``'s inverse): indices, prompts,
  prompt_lens [g,...], rows [g·M,...], rewards [g,M]; the job's faults stay with the
  ``lead`` process only (the learner sums them over processes)."""
  G = len(x.indices)
  rows = lambda a: a.reshape(G, -1, *a.shape[1:])[lo:hi].reshape(-1, *a.shape[1:])
  arrays = {k: rows(getattr(x, k)) for k in ("tokens", "mask", "logprobs", "versions")}
  if x.routing is not None:
    arrays["routing"] = rows(x.routing)
  if x.components is not None:
    arrays["components"] = x.components[lo:hi]
  return x._replace(indices=x.indices[lo:hi], prompts=x.prompts[lo:hi],
                    prompt_lens=x.prompt_lens[lo:hi], rewards=x.rewards[lo:hi],
                    faults=x.faults if lead else np.zeros_like(x.faults), **arrays)


def held_shares(t: TrainParts) -> tuple[int, int] | None:
  """This process's engine shares ``[first, last)`` of S (``state.engine_shares``) when the
  APRIL engine is split into S > 1 shares, else None."""
  S = engine_shares(t.setup)
  if S == 1 or source(t) != "engine":
    return None
  G = t.setup.geometry.rows
  lo, hi = t.layout.share(G)
  return lo * S // G, hi * S // G


def job_wide_held(held: dict, split: bool) -> dict:
  """This process's engine shares' held groups [L, capacity, ...] as the job's S shares
  (process order; a collective when ``split``, every process calls it in the same order)."""
  if not split:
    return held
  return {k: np.asarray(multihost_utils.process_allgather(np.asarray(v), tiled=True))
          for k, v in held.items()}


def _with_queue(t: TrainParts, state: TrainState, items: list[Scored]) -> TrainState:
  s = t.setup
  arrays = queue_lib.to_arrays(queue_lib.setup_queue(s), items)
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
  """The deterministic k-step-off runner (k = 0: the synchronous trainer).

  ``step(state) -> (state, record)`` trains on the batch of this step while the producer
  samples the batch k steps ahead. ``overlapped`` (the asynchronous modes) adds the token-lag
  and producer / learner timing metrics.
  """

  def __init__(self, t: TrainParts, state: TrainState, lag: int | None = None,
               overlapped: bool | None = None):
    sched = t.setup.schedule
    self.t = t
    self.k = sched.lag if lag is None else lag
    self.overlapped = sched.overlapped if overlapped is None else overlapped
    # the queued batches stay on the host between steps; ``snapshot`` writes them into the
    # state only when a checkpoint is saved
    self.queue = queue_from_arrays(state.rollout_queue)
    self.split = splits_groups(t)  # several processes: each holds only its groups' rows
    if self.split:
      lo, hi = t.layout.share(t.setup.geometry.rows)
      self.queue = [own_share(x, lo, hi, jax.process_index() == 0) for x in self.queue]
    # split APRIL engine: this process's shares' held groups stay on the host here (the
    # state keeps the job-wide form it was built or restored with until ``snapshot``)
    self.shares = held_shares(t)
    self.held = None
    if self.shares is not None:
      self.held = take_shares(jax.device_get(state.producer.held), *self.shares)
    self.pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
                 if self.k else None)
    # experience replay: the token-lag metrics show the replayed groups' age
    self.replay = replay_stage.enabled(t.setup.train)

  def _produce(self, params, producer: ProducerState, step: int, version: int):
    t0 = time.perf_counter()
    lo, hi = self.t.layout.share(self.t.setup.geometry.rows)
    scored, producer = produce(self.t, params, producer, step=step, version=version, lo=lo,
                               hi=hi)
    return scored, producer, time.perf_counter() - t0

  def step(self, state: TrainState) -> tuple[TrainState, dict]:
    t, k = self.t, self.k
    t_start = time.perf_counter()
    step = int(state.step)
    queue = self.queue
    # lag 0: the producer is done before the learner starts, so it samples the weights in
    # place; with a lag it samples a copy the learner's update cannot donate
    params = publish(t, state.params) if k else t.layout.sampler_params(state.params)
    producer, fill_s = state.producer, 0.0
    job_held = producer.held
    if self.held is not None:
      producer = producer._replace(held=self.held)
    while len(queue) < k:  # pipeline fill (first RL step): steps step..step+k-1, weights now
      scored, producer, busy = self._produce(params, producer, step + len(queue), step)
      fill_s += busy
      queue.append(scored)
    # the producer samples batch step+k from the weights of this step ...
    if k:
      future = self.pool.submit(self._produce, params, producer, step + k, step)
    else:  # ... which is this step's batch: nothing to overlap
      done = self._produce(params, producer, step, step)
      queue.append(done[0])
    depth = len(queue)
    t0 = time.perf_counter()
    batch, record = learner_batch(t, state, queue.pop(0),  # ... while the learner trains
                                  staleness=self.overlapped or self.replay)
    state, mets = apply_update(t, state, batch)
    learner_busy = time.perf_counter() - t0
    t1 = time.perf_counter()
    scored, producer, busy = future.result() if k else done
    wait = time.perf_counter() - t1
    if k:
      queue.append(scored)
    if self.held is not None:
      self.held = jax.device_get(producer.held)
      producer = producer._replace(held=job_held)
      record = {**record, "held_shares": len(self.held["valid"])}
    state = state._replace(producer=producer)
    if not self.overlapped:
      return state, {**record, **mets}
    timing = _Timing(busy + fill_s, learner_busy, wait, time.perf_counter() - t_start)
    return state, {**record, **mets, **_timing_metrics(timing, depth)}

  def snapshot(self, state: TrainState) -> TrainState:
    """The state to checkpoint: ``state`` with the queued batches (with several processes
    each batch job-wide, ``job_wide``; a collective) and, with a split APRIL engine, every
    share's held groups (``job_wide_held``)."""
    items = [job_wide(x) for x in self.queue] if self.split else self.queue
    if self.held is not None:
      S = engine_shares(self.t.setup)
      held = job_wide_held(self.held, self.shares != (0, S))
      state = state._replace(producer=state.producer._replace(
          held={k: place_replicated(self.t.setup, v) for k, v in held.items()}))
    return _with_queue(self.t, state, items)

  def close(self) -> None:
    if self.pool is not None:
      self.pool.shutdown(wait=True)


class FreeRunning:
  """The free-running producer (see the module docstring): a thread that samples from the
  newest published weights into a bounded queue under the staleness bound η."""

  def __init__(self, t: TrainParts, state: TrainState):
    self.t, self.eta = t, t.setup.rollout.max_staleness
    self.capacity = t.setup.schedule.queue
    self.cond = threading.Condition()
    self.queue: list[tuple[Scored, ProducerState | None]] = [
        (x, None) for x in queue_from_arrays(state.rollout_queue)]
    self.learner_version = int(state.step)
    self.first = int(state.step)  # batch i (from 0) is trained at step first + i
    self.started = len(self.queue)  # batches started (queued ones included)
    self.params = (int(state.step), publish(t, state.params))
    self.producer = state.producer  # the producer's chain (data position, held groups)
    self.after_last: ProducerState | None = None  # after the newest consumed batch
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
    G = self.t.setup.geometry.groups
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
        scored, self.producer = produce(self.t, params, self.producer,
                                        step=self.first + index, version=version, lo=0, hi=G)
        with self.cond:
          self.busy_s += time.perf_counter() - t0
          self.queue.append((scored, self.producer))
          self.cond.notify_all()
    except BaseException as e:  # surfaced in the learner's thread
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def step(self, state: TrainState) -> tuple[TrainState, dict]:
    t_start = time.perf_counter()
    with self.cond:
      self.cond.wait_for(lambda: self.queue or self.error is not None)
      if self.error is not None:
        raise self.error
      depth = len(self.queue)
      scored, producer = self.queue.pop(0)
      busy0, self.busy_s = self.busy_s, 0.0
      self.cond.notify_all()
    wait = time.perf_counter() - t_start
    if producer is not None:
      self.after_last = producer
    t0 = time.perf_counter()
    batch, record = learner_batch(self.t, state, scored, max_lag=self.eta, staleness=True)
    state, mets = apply_update(self.t, state, batch)
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
      producer = self.after_last
      for _, p in self.queue:
        producer = p if p is not None else producer
    if producer is not None:
      state = state._replace(producer=producer)
    return _with_queue(self.t, state, items)

  def close(self) -> None:
    with self.cond:
      self.stopping = True
      self.cond.notify_all()
    self.thread.join()


def make_runner(t: TrainParts, state: TrainState):
  """The runner of the run's schedule (``Setup.schedule``, from ``train.mode`` and
  ``train.async_lag``): ``FixedLag`` (lag 0 for the synchronous trainer) or ``FreeRunning``."""
  if t.setup.schedule.lag >= 0:
    return FixedLag(t, state)
  return FreeRunning(t, state)
