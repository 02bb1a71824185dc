"""A ``gs://`` workdir against a local Cloud Storage emulator (gcp-storage-emulator): the
metrics file, TensorBoard events, plot, lock and a checkpoint land in the bucket and read
back; a whole tiny training run writes its checkpoints, metrics, memory plan and HF export
into the bucket, and after a SIGKILL a rerun resumes from there; the HF export, downloaded from
the bucket, loads as the trained policy. A missing client or an unknown scheme is one
``error:`` line."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("gcp_storage_emulator")
gcsfs = pytest.importorskip("gcsfs")

from etils import epath  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import (checkpoint, config_utils, metrics, models, storage,  # noqa: E402
                    train)
from rl_jax.errors import WorkdirBusyError  # noqa: E402
from rl_jax.train import lock as lock_lib  # noqa: E402
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL  # noqa: E402

BUCKET = "rl-jax-test"


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator():
  port = _free_port()
  proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start",
                           "--host=localhost", f"--port={port}", "--in-memory"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://localhost:{port}"
  saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
  os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
  try:
    deadline = time.time() + 60
    while True:
      try:
        socket.create_connection(("localhost", port), timeout=1).close()
        break
      except OSError:
        assert time.time() < deadline and proc.poll() is None, "the emulator did not start"
        time.sleep(0.1)
    gcsfs.GCSFileSystem(token="anon").mkdir(BUCKET)
    yield url
  finally:
    proc.kill()
    proc.wait()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def test_metrics_lock_and_checkpoints_in_a_bucket(emulator):
  workdir = f"gs://{BUCKET}/pieces"
  root = epath.Path(workdir)
  writer = metrics.MetricsWriter(workdir, tensorboard=True)
  for step in (1, 2, 3):
    writer.write(step, {"reward_mean": step / 4})
  writer.close()
  path = f"{workdir}/metrics.jsonl"
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 3]
  assert any(p.name.startswith("events.out") for p in (root / "tensorboard").iterdir())
  metrics.truncate_after(path, 2)
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2]
  assert metrics.plot_curves(path, f"{workdir}/curves.png") and (root / "curves.png").exists()
  first = lock_lib.WorkdirLock(workdir, "job-a")
  first.acquire()
  with pytest.raises(WorkdirBusyError):
    lock_lib.WorkdirLock(workdir, "job-b").acquire()
  first.release()
  assert not (root / lock_lib.LOCK_FILE).exists()
  state = {"w": jnp.arange(10.0), "b": jnp.ones(3)}
  with checkpoint.Checkpointer(f"{workdir}/checkpoints", keep=None) as ckpt:
    ckpt.save(1, state, force=True)
  restored, _ = checkpoint.restore(f"{workdir}/checkpoints", jax.eval_shape(lambda: state))
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert (root / "checkpoints" / "1" / "checksums.json").exists()


def test_training_run_in_a_bucket_resumes_from_it(emulator, tmp_path):
  """A run killed (SIGKILL) once its checkpoint of step 1 is in the bucket (sealed); the rerun
  restores step 1 from there, trains (and profiles) step 2 and exports the policy into the
  bucket, which downloaded and loaded has the trained parameters and their logits."""
  workdir = f"gs://{BUCKET}/run"
  root = epath.Path(workdir)
  ckpts = f"{workdir}/checkpoints"
  tiny = TINY_MODEL + ["sft.steps=0", "train.batch_groups=4", "rollout.n=2", "train.eval_every=0",
                       "train.checkpoint_every=1", "train.keep=10", "log.tensorboard=False",
                       "mesh.num_devices=1"]
  # the storage emulator's address reaches the run through the environment (the fixture's);
  # the matmul precision of this session (conftest), so that the rerun here loads the
  # programs it compiled from the session's compilation cache
  killed = subprocess.Popen(
      [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"]
      + [f"--config.{o}" for o in tiny + ["train.steps=50"]], cwd=ROOT,
      env=dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest"),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  sealed = root / "checkpoints" / "1" / "checksums.json"  # written after the commit
  deadline = time.time() + 300
  while time.time() < deadline and killed.poll() is None and not sealed.exists():
    time.sleep(0.5)  # (each look is a request to the emulator, which serves the run too)
  killed.kill()
  err = killed.communicate()[1]
  assert killed.returncode == -9 and 1 in checkpoint.all_steps(ckpts), err[-3000:]
  for step in checkpoint.all_steps(ckpts):  # as if killed just after the commit of step 1
    if step > 1:
      (root / "checkpoints" / str(step)).rmtree()
  assert not (root / "hf").exists()
  assert not list((root / "checkpoints" / "1" / "state").glob("ocdbt*"))  # zarr per array
  first = metrics.read_jsonl(f"{workdir}/metrics.jsonl")[:1]
  assert [r["step"] for r in first] == [1]
  config = config_utils.load_config(QUICKSTART, tiny + ["train.steps=2", "train.profile_step=2"])
  state = train.train(config, workdir, progress=False)
  rows = metrics.read_jsonl(f"{workdir}/metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2] and rows[:1] == first  # step 1 not redone
  assert checkpoint.all_steps(ckpts) == [1, 2]
  assert all((root / "checkpoints" / str(s) / "checksums.json").exists() for s in (1, 2))
  assert json.loads((root / "hf" / "config.json").read_text())["hidden_size"] == 32
  assert "live_state" in json.loads((root / "memory_plan.json").read_text())
  assert "jit_update" in (root / "profile" / "summary.txt").read_text()  # the traced step
  assert not (root / lock_lib.LOCK_FILE).exists()
  # the export, downloaded from the bucket, loads as the trained policy
  local = tmp_path / "hf"
  local.mkdir()
  for f in (root / "hf").iterdir():
    with storage.open_file(str(f), "rb") as src:
      (local / f.name).write_bytes(src.read())
  assert (local / "model.safetensors").exists()
  cfg, params = models.load_hf(str(local))
  trained = jax.tree.map(np.asarray, state.params)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), trained)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
  model_cfg = train.build_setup(config).model_cfg
  np.testing.assert_array_equal(np.asarray(models.forward(cfg, params, tokens)),
                                np.asarray(models.forward(model_cfg, trained, tokens)))


def test_data_files_read_from_a_bucket(emulator):
  """``data.path`` / ``data.eval_path`` as ``gs://`` URLs: the trainer's setup reads both."""
  rows = lambda lo, hi: "".join(json.dumps({"question": f"{a}+{a}=", "answer": f"#### {2 * a}"})
                                + "\n" for a in range(lo, hi))
  data = epath.Path(f"gs://{BUCKET}/data")
  (data / "train.jsonl").write_text(rows(0, 12))
  (data / "eval.jsonl").write_text(rows(50, 53))
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "data.task=file", f"data.path={data}/train.jsonl", f"data.eval_path={data}/eval.jsonl"])
  s = train.build_setup(config)
  assert len(s.train_examples) == 12 and len(s.eval_examples) == 3
  assert sorted(e.answer for e in s.eval_examples) == ["100", "102", "104"]
  config.data.path = f"gs://{BUCKET}/data/missing.jsonl"
  with pytest.raises(Exception, match="missing.jsonl"):
    train.build_setup(config)


@pytest.mark.parametrize("workdir,block,message", [
    ("gs://bucket/run", "gcsfs", "gs:// paths need the gcsfs package (pip install gcsfs)"),
    ("s3://bucket/run", "", "unsupported scheme s3://")])
def test_unusable_workdir_url_is_one_error_line(tmp_path, workdir, block, message):
  code = (f"import sys; sys.modules[{block!r}] = None\n" if block else "") + (
      "from rl_jax.train.loop import main; main()")
  proc = subprocess.run([sys.executable, "-c", code, f"--config={QUICKSTART}",
                         f"--workdir={workdir}"], cwd=tmp_path, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --workdir " + workdir)
  assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
  assert not os.path.exists(tmp_path / "gs:") and not os.path.exists(tmp_path / "s3:")
