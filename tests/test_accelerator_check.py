"""benchmarks/accelerator_check.py's CPU-runnable parts at tiny sizes: the accelerator tests (skipped
here), configs/tiny.py's losses against the stored CPU reference, a hybrid's training step and its
decoding step, and the JSON and markdown it writes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_accelerator_check_smoke_on_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([
      sys.executable, "benchmarks/accelerator_check.py", f"--out={tmp_path}", "--smoke",
      "--variants=hyla+softmax"
  ], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  r = json.loads((tmp_path / "accelerator_check.json").read_text())
  assert r["platform"]["backend"] == "cpu" and r["tests"]["ok"] and r["tiny"]["match"]
  (step,) = r["train"]
  assert step["attention"] == ["blocked", "dot_product"] and step["tokens_per_s"] > 0
  assert r["decode"][0]["ms_per_token"] > 0
  assert "| hyla,softmax | True | 4 x 1 |" in (tmp_path / "accelerator_check.md").read_text()
