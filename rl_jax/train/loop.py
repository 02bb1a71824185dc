"""The training loop: resume, step (supervised, then RL), evaluate, checkpoint, SIGTERM.

    python -m rl_jax.train --config=configs/quickstart.py --workdir=DIR [--config.x.y=v ...]

Writes DIR/metrics.jsonl, DIR/tensorboard/, DIR/checkpoints/ (with LoRA the adapters only,
the frozen base once: ``lora_checkpoint``), DIR/curves.png and DIR/hf/ (the final policy in
HF format). Rerunning the same command resumes from the newest
checkpoint, bit-exactly: every random draw is a function of (seed, step, stream) and the
data position is part of the checkpoint. SIGTERM saves a checkpoint and exits cleanly.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from typing import Callable

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np
from etils import epath

from rl_jax import checkpoint as ckpt_lib
from rl_jax import compile_options
from rl_jax import config as config_lib
from rl_jax import config_utils
from rl_jax import distributed
from rl_jax import metrics as metrics_lib
from rl_jax import models
from rl_jax import storage
from rl_jax import wandb_log
from rl_jax.data import tokenizers as tok_lib
from rl_jax.data.tokenizers import encode_prompt
from rl_jax.errors import RLJaxError
from rl_jax.train import agent_stage, startup
from rl_jax.train.context import Setup, build_setup
from rl_jax.train.evaluation import evaluate
from rl_jax.train import lock as lock_lib
from rl_jax.train import lora_checkpoint
from rl_jax.train import memory
from rl_jax.train import teacher as teacher_lib
from rl_jax.train import topology
from rl_jax.train.layout import make_layout
from rl_jax.train.resume import restore_newest
from rl_jax.train.rollouts import TrainParts, next_examples
from rl_jax.train.runner import FixedLag, make_runner
from rl_jax.train.state import (TrainState, abstract_state, begin_rl, init_state, make_engine,
                                 place_replicated)
from rl_jax.train.steps import make_step_fns

__all__ = ["make_trainer", "sft_batch", "rl_step", "sft_step", "train", "main"]


def make_trainer(s: Setup, abstract: TrainState | None = None) -> TrainParts:
  """The setup with its layout, jitted steps and rollout engine (``abstract``: the state's
  ``abstract_state``, if already computed)."""
  layout = make_layout(s, abstract)
  agent = agent_stage.make_engines(s) if s.geometry.multi_turn else None
  teacher = teacher_lib.load_teacher(s) if s.teacher_cfg is not None else None
  return TrainParts(setup=s, layout=layout, steps=make_step_fns(s, layout), engine=make_engine(s),
                 agent=agent, teacher=teacher)


def sft_batch(s: Setup, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``[prompt][answer][eos]`` rows, right-padded to P + R: tokens int32 [B,T], attention
  mask bool [B,T], loss mask float32 [B,T] on the answer and EOS targets."""
  tok = s.tokenizer
  rows, prompt_lens = [], []
  for e in examples:
    p = encode_prompt(tok, e.prompt)
    rows.append(p + tok.encode(e.answer) + [s.eos_id])
    prompt_lens.append(len(p))
  T = s.prompt_len + s.rollout.max_new_tokens
  tokens = np.full((len(rows), T), tok.pad_id, np.int32)
  attn = np.zeros((len(rows), T), bool)
  loss_mask = np.zeros((len(rows), T), np.float32)
  for i, (row, pl) in enumerate(zip(rows, prompt_lens)):
    row = row[:T]
    tokens[i, :len(row)] = row
    attn[i, :len(row)] = True
    loss_mask[i, pl:len(row)] = 1.0  # targets at positions >= prompt length
  return tokens, attn, loss_mask


def sft_step(t: TrainParts, state: TrainState) -> tuple[TrainState, dict, np.ndarray]:
  """One supervised step: (state, metrics record, new data position). Multi-turn runs
  train on the task expert's trajectories (``agent_stage.expert_batch``)."""
  s = t.setup
  examples, data = next_examples(s, np.asarray(state.producer.data), s.sft.batch_size)
  rows = agent_stage.expert_batch if s.geometry.multi_turn else sft_batch
  batch = (t.layout.put(a) for a in rows(s, examples))
  params, opt, mets = t.steps.sft(state.params, state.sft_opt_state, *batch)
  return state._replace(params=params, sft_opt_state=opt), {"phase": "sft",
                                                            **jax.device_get(mets)}, data


def rl_step(t: TrainParts, state: TrainState) -> tuple[TrainState, dict, np.ndarray]:
  """One synchronous RL step, the runner with lag 0 (``runner.FixedLag``): the producer
  samples this step's batch from the current weights, then the learner trains on it;
  (state, record, data position)."""
  state, record = FixedLag(t, state, lag=0).step(state)
  return state, {"phase": "rl", **record}, np.asarray(jax.device_get(state.producer.data))


class _Preempted:
  """SIGTERM handler that only raises a flag; the loop checkpoints at the next step. With
  several processes the flag is agreed on (any process signalled stops all), since the
  checkpoint is written collectively."""

  def __init__(self):
    self.flag = False

  def __call__(self, signum, frame):
    self.flag = True

  def any(self) -> bool:
    if jax.process_count() == 1:
      return self.flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.flag))))


def _start(s: Setup, ckpt, metrics_path: str, abstract: TrainState) -> TrainState:
  """A fresh state, or the newest checkpoint that reads back whole restored onto the abstract
  target; metrics rows after that point (from a killed attempt) are dropped."""
  state = restore_newest(s, ckpt, abstract)
  latest = None if state is None else int(state.step)
  if state is None:
    state = init_state(s)
  if distributed.is_lead() and epath.Path(metrics_path).exists():
    rows = len(metrics_lib.read_jsonl(metrics_path))
    if latest is None and rows:
      print(f"note: no checkpoint in {ckpt.directory}: training from step 0, in place of the "
            f"{rows} rows metrics.jsonl holds", file=sys.stderr)
    metrics_lib.truncate_after(metrics_path, latest or 0)
  return state


def train(config: ml_collections.ConfigDict, workdir: str, *,
          progress: bool = True) -> TrainState | None:
  """Run (or resume) the configured training in ``workdir``; returns the final state.

  The memory plan (``rl_jax.train.memory``) is printed and written to
  ``workdir/memory_plan.json`` first; ``train.dry_run`` stops there (returns None, no weight
  read), and a run that cannot fit fails there in one line (``train.memory_check``). With
  ``dry_run.topology`` the dry run compiles every program for that TPU topology instead
  (``rl_jax.train.topology``: ``workdir/topology_plan.json``; ``TopologyPlanError`` when it
  does not fit).

  Raises:
    WorkdirBusyError: another live run holds ``workdir`` (``rl_jax.train.lock``).
  """
  wandb_log.check(config)
  topology.check_requested(config)
  storage.check_path(workdir, "--workdir")
  storage.makedirs(workdir)
  lock = lock_lib.hold_workdir(workdir, config.distributed, config.train.lock_stale_s)
  try:
    if topology.requested(config):  # compiled for the topology's chips; nothing runs
      topology.plan_topology(config, workdir)
      return None
    s = build_setup(config)
    notes = config_lib.notices(config)  # and the one note that needs the run's mesh
    notes += [f"note: {n}" for n in (topology.update_split_note(s),) if n]
    for line in notes if distributed.is_lead() else ():
      print(line, file=sys.stderr)
    sinks = lambda: wandb_log.sinks(config, workdir)  # W&B records the whole config
    return _train(s, workdir, progress, sinks)
  finally:
    lock.release()


def _train(s: Setup, workdir: str, progress: bool,
           sinks: Callable[[], list]) -> TrainState | None:
  """``train`` once the workdir is this run's; ``sinks()``: the metrics' extra sinks."""
  tr = s.train
  cache = startup.use_compile_cache(tr.compile_cache, workdir)
  note = compile_options.uncached_note(cache, jax.devices())
  if note and distributed.is_lead():
    print(note, file=sys.stderr)
  clock = startup.compile_clock()
  clock.take()
  sft_steps, total = s.sft.steps, s.sft.steps + tr.steps
  ckpt_dir = storage.join(workdir, "checkpoints")
  if not storage.is_remote(ckpt_dir):  # (a bucket's workdir probe covers its prefix)
    storage.check_writable(ckpt_dir, "the checkpoint directory")  # not at the first save
  ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=tr.keep, save_every=tr.checkpoint_every or total,
                              writable_checked=True)
  metrics_path = storage.join(workdir, "metrics.jsonl")
  abstract = abstract_state(s)
  lead = distributed.is_lead()  # only process 0 writes metrics, plots and the HF export
  t = make_trainer(s, abstract)
  memory.plan_workdir(t, abstract, workdir, check=tr.memory_check and not tr.dry_run,
                      lead=lead)  # before any weight is read or step compiled for a call
  if tr.dry_run:
    ckpt.close()
    return None
  state = _start(s, ckpt, metrics_path, abstract)
  if lead:
    memory.record_live(workdir, state)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=s.log.tensorboard,
                                     sinks=sinks()) if lead else None
  preempted = _Preempted()
  old_handler = signal.signal(signal.SIGTERM, preempted)
  bar = _progress(progress and lead, total, int(state.step))
  bad_steps = 0
  runner = None  # the run's runner (runner.make_runner), started at the first RL step
  def save(st: TrainState, force: bool) -> None:  # LoRA: the adapters (lora_checkpoint)
    st, meta = lora_checkpoint.for_checkpoint(
        s, ckpt, st if runner is None else runner.snapshot(st),
        from_config=lora_checkpoint.config_base(s, int(st.step)))
    ckpt.save(int(st.step), st, metadata=meta, force=force)

  try:
    while int(state.step) < total:
      if preempted.any():
        save(state, force=True)
        ckpt.wait()
        print(f"SIGTERM: saved checkpoint at step {int(state.step)}; rerun to resume",
              file=sys.stderr)
        break
      step = int(state.step)
      profiling = tr.profile_step == step + 1 and lead
      if profiling:
        profile_dir = startup.start_profile(workdir)
      t0 = time.perf_counter()
      if step < sft_steps:
        state, record, data = sft_step(t, state)
        state = state._replace(producer=state.producer._replace(
            data=place_replicated(s, data)))
      else:
        if step == sft_steps:
          state = begin_rl(s, state)
        runner = runner or make_runner(t, state)
        state, record = runner.step(state)  # its producer's data position already placed
        record = {"phase": "rl", **record}
      bad_steps = bad_steps + 1 if int(record.get("update_skipped", 0)) else 0
      if bad_steps >= tr.max_bad_steps:
        if writer is not None:  # the last skipped step's row too, numbered as the others
          writer.write(step + 1, record)
        raise RLJaxError(f"{bad_steps} consecutive steps had a non-finite loss or gradient norm "
                         f"(the last is step {step + 1} of metrics.jsonl); stopping. Lower "
                         "optim.lr, or check the data and the loss.* and optim.* settings")
      state = state._replace(step=state.step + 1)
      step += 1
      if profiling:
        remote = storage.join(workdir, "profile") if storage.is_remote(workdir) else None
        startup.stop_profile(profile_dir, state, upload_to=remote)
        print(f"profile of step {step}: {remote or profile_dir} (summary.txt)", file=sys.stderr)
      record["step_time_s"] = time.perf_counter() - t0
      if tr.eval_every and (step % tr.eval_every == 0 or step in (total, sft_steps)):
        record.update(evaluate(s, t.layout.sampler_params(state.params, quantized=False), step,
                               agent=t.agent[1] if t.agent else None))
      record["compile_time_s"] = clock.take()  # tracing + compiling (or cache loads)
      if writer is not None:
        writer.write(step, record)
      _update_progress(bar, record)
      ckpt.seal_finished()
      if ckpt.should_save(step) or step == total:
        if writer is not None:
          writer.flush()  # a saved step's metrics rows are durable before its checkpoint
        save(state, force=step == total)
    ckpt.wait()
    if int(state.step) >= total:
      params = t.layout.local_params(state.params)  # collective: every process takes part
      if lead:
        export_hf(s, params, workdir)
        metrics_lib.plot_curves(metrics_path, storage.join(workdir, "curves.png"))
  finally:
    if runner is not None:
      runner.close()
    for engine in t.agent or ():
      engine.close()
    signal.signal(signal.SIGTERM, old_handler)
    if writer is not None:
      writer.close()
    ckpt.close()
    if bar is not None:
      bar.close()
  return state


def _write_hf(path: str, write: Callable[[str], None]) -> None:
  """``write(directory)`` into ``path``; a ``gs://`` path gets a local export uploaded file
  by file, its config file (``config.json`` / ``adapter_config.json``) last, so an export
  without it is known to be incomplete."""
  if not storage.is_remote(path):
    write(path)
    return
  with tempfile.TemporaryDirectory(prefix="rl_jax_hf_") as tmp:
    local = os.path.join(tmp, "hf")
    write(local)
    last = [n for n in ("config.json", "adapter_config.json")
            if os.path.exists(os.path.join(local, n))]
    for name in last:
      os.replace(os.path.join(local, name), os.path.join(tmp, name))
      epath.Path(path).joinpath(name).unlink(missing_ok=True)
    storage.upload_dir(local, path)
    for name in last:
      epath.Path(path).joinpath(name).write_bytes(epath.Path(tmp, name).read_bytes())


def export_hf(s: Setup, params, workdir: str) -> None:
  """The final policy in HF format: ``workdir/hf`` (adapters merged). With LoRA also the
  adapters in PEFT's format (``workdir/hf_adapter``) and, unless the base is the unchanged
  ``model.hf_path`` checkpoint (a supervised stage merges its adapters into the base; a
  random init exists nowhere else), the base (``workdir/hf_base``), which the adapter's
  ``base_model_name_or_path`` names. A quantised base (``model.lora.quant``) is written
  dequantised: ``hf`` holds the dequantised base plus the merged adapters."""
  cfg = s.model_cfg
  tokenizer = s.data.tokenizer or s.model.hf_path or "char"  # as the run loaded it

  def with_tokenizer(save):  # every exported directory carries its tokenizer
    return lambda d: (save(d), tok_lib.save_tokenizer(tokenizer, d))

  # save_hf merges adapters (and dequantises a quantised base) a layer at a time as it writes
  _write_hf(storage.join(workdir, "hf"), with_tokenizer(lambda d: models.save_hf(cfg, params, d)))
  if not cfg.lora_rank:
    return
  base_path = s.model.hf_path
  if s.sft.steps or not base_path:
    base_path = storage.join(workdir, "hf_base")
    if not storage.is_remote(base_path):
      base_path = os.path.abspath(base_path)
    _write_hf(base_path, with_tokenizer(
        lambda d: models.save_hf(cfg, models.lora.strip(params), d)))
  _write_hf(storage.join(workdir, "hf_adapter"),
            with_tokenizer(lambda d: models.save_hf_adapter(cfg, params, d, base_path)))


def _progress(enabled: bool, total: int, initial: int):
  if not enabled:
    return None
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stderr)


def _update_progress(bar, record: dict) -> None:
  if bar is None:
    return
  post = {}
  for key, short in (("sft_loss", "loss"), ("reward_mean", "reward"),
                     ("eval_accuracy", "acc"), ("rollout_tokens_per_s", "tok/s")):
    if key in record:
      post[short] = f"{record[key]:.3g}"
  bar.set_postfix(post, refresh=False)
  bar.update(1)


@config_utils.main_guard
def main(argv=None) -> None:
  """``python -m rl_jax.train --config=FILE[:ARG] --workdir=DIR [--config.KEY=VALUE ...]``;
  every process of a multi-process job runs the same command (``rl_jax.distributed``)."""
  config, workdir = config_utils.parse_cli(sys.argv if argv is None else argv)
  if topology.requested(config):  # one process compiling for a TPU topology on this host
    topology.use_host_platform()
  else:
    distributed.initialize(config.distributed)
  train(config, workdir)
