"""Smoke test of scripts/bench_scaling.py at its tiny size (compiled programs only)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_scaling_small_reports_every_device_count(tmp_path):
  out = tmp_path / "scaling.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the script asks for its own 8 host devices
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_scaling.py"),
                         "--small", "--devices", "1,8", "--json", str(out)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("| ")]
  assert lines[0].startswith("| n | mesh")
  assert [l.split("|")[1].strip() for l in lines[1:]] == ["1", "8"]
  rows = {r["n"]: r for r in json.loads(out.read_text())["rows"]}
  assert all("error" not in r for r in rows.values()), rows
  assert abs(rows[8]["flops_ratio"] - 1.0) <= 0.15, rows[8]["flops_ratio"]
  assert rows[1]["collective_total"] == 0
  assert rows[8]["collective_bytes"]["all-gather"] > 0  # FSDP gathers weights in the step
  assert rows[8]["peak_bytes"] < rows[1]["peak_bytes"]
