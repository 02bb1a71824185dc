"""notebooks/quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient +
ipykernel, the current interpreter) at a shorter schedule, and shows what it promises: a
plot, an accuracy that improves, rollouts as text, a second objective trained."""

import json
import os
import re
import sys

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.tiny import ROOT

NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def _kernel(tmp_path) -> KernelManager:
  """A kernel of this interpreter from a kernelspec in a temporary directory (no global
  Jupyter state needed, and its connection file there too, not in /tmp), importing this
  checkout's rl_jax."""
  spec_dir = tmp_path / "kernels" / "rl_jax_test"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "rl_jax test", "language": "python",
      "env": {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
              "MPLBACKEND": "module://matplotlib_inline.backend_inline"}}))
  specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
  return KernelManager(kernel_name="rl_jax_test", kernel_spec_manager=specs,
                       connection_file=str(tmp_path / "kernel-connection.json"))


def _text(cell) -> str:
  return "".join(o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream")


def test_quickstart_notebook_runs_and_shows_its_results(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(params) == 1
  params[0].source += (f"\nRL_STEPS = 20\nEVAL_EVERY = 20\nSWAP_STEPS = 2\n"
                       f"EXTRA = ['eval.pass_k=0', 'data.eval_size=128']\n"
                       f"WORKDIR = {str(tmp_path / 'runs')!r}\n")
  client = NotebookClient(nb, km=_kernel(tmp_path), timeout=600,
                          resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()

  errors = [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"]
  assert not errors, errors
  images = [c for c in nb.cells for o in c.get("outputs", [])
            if o["output_type"] == "display_data" and "image/png" in o.get("data", {})]
  assert len(images) >= 2  # the GRPO curves, and the comparison after the swap
  text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
  assert "jax 0." in text and "devices:" in text
  m = re.search(r"held-out accuracy: ([\d.]+) after the warm start \(step 25\) -> ([\d.]+) "
                r"after GRPO \(step 45\)", text)
  assert m, text
  assert float(m.group(2)) > float(m.group(1)) + 0.05, m.group(0)
  assert "mean reward over 32 prompts x 8 samples" in text
  rollout_lines = [l for l in text.splitlines() if l.startswith("'sort ")]
  assert len(rollout_lines) == 4, text
  assert os.path.exists(tmp_path / "runs" / "dapo" / "hf" / "model.safetensors")
  rows = [json.loads(l) for l in open(tmp_path / "runs" / "dapo" / "metrics.jsonl")]
  assert rows[-1]["step"] == 27 and rows[-1]["phase"] == "rl"
  # the hand-written loop (rl_jax.api) continues from step 45 and prints each step
  steps = re.findall(r"step (\d+): reward ([\d.]+), loss [-+][\d.]+, grad norm [\d.]+", text)
  assert [int(s) for s, _ in steps] == list(range(46, 56)), text
