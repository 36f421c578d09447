"""gs:// data and workdirs against the GCS API emulator (tests/gcs_emulator.py): lm-prepare reads
json.gz from a bucket and writes shards and a tokenizer to it; the grid runner (lm-sweep) trains on
them into the bucket and summarises there (lm-compare's curves); lm-eval evaluates the run there. SIGKILL and exact resume on gs:// are in
test_checkpoint.py, two jobs on one gs:// workdir in test_ownership.py."""

import gzip
import json
import os
import subprocess
import sys

import pytest
from etils import epath
from small import tensorboard_events

from data_pipelines import records
from lm import run_log

HERE = os.path.dirname(__file__)
GRID_CONFIG = """
from small import small_config

def get_config():
  c = small_config({data!r})
  c.data.tokenizer = {tokenizer!r}
  c.train.update(steps=8, log_every_steps=2)
  c.eval.every_steps = 4
  c.checkpoint.every_steps = 4
  return c
"""


def test_prepare_from_a_bucket_then_train_evaluate_and_compare_there(gs_dir, tmp_path):
  from conftest import make_documents
  raw, data = epath.Path(gs_dir) / "raw", epath.Path(gs_dir) / "data"
  for name, seed, n in (("train-0", 0, 60), ("train-1", 1, 60), ("validation-0", 2, 30)):
    lines = "".join(json.dumps(d) + "\n" for d in make_documents(n, seed))
    (raw / f"{name}.json.gz").write_bytes(gzip.compress(lines.encode()))
  prepare = [
      sys.executable, "-m", "launch.prepare", f"--train={raw}/train-*.json.gz",
      f"--validation={raw}/validation-*.json.gz", f"--output={data}", "--train_tokenizer=320", "--workers=1"
  ]
  result = subprocess.run(prepare, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [epath.Path(p).name for p in records.shard_paths(data, "train")
         ] == ["train.array_record-00000-of-00002", "train.array_record-00001-of-00002"]
  assert json.loads(records.stats_path(data /
                                       "train.array_record-00001-of-00002").read_text())["documents"] == 60
  tokenizer = data / "spm_bpe_320.model"
  assert tokenizer.exists()

  config = tmp_path / "grid_config.py"
  config.write_text(GRID_CONFIG.format(data=str(data), tokenizer=str(tokenizer)))
  root = epath.Path(gs_dir) / "grid"
  grid = [sys.executable, "-m", "eval.grid", f"--config={config}", "--presets=softmax", f"--root={root}"]
  result = subprocess.run(grid, capture_output=True, text=True, timeout=600, env={
      **os.environ, "PYTHONPATH": HERE
  })
  assert result.returncode == 0, result.stderr[-3000:]
  workdir = root / "softmax_seed0"
  evaluate = [sys.executable, "-m", "eval.evaluate", f"--workdir={workdir}", "--step=8"]
  result = subprocess.run(evaluate, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  log = run_log.read(workdir)
  assert [r["step"] for r in log if r["kind"] == "train"] == [2, 4, 6, 8], "every record of the run"
  assert [r["step"] for r in log if r["kind"] == "eval/validation"] == [4, 8]
  assert [r["step"] for r in log if r["kind"] == "checkpoint"] == [4, 8]
  evaluated = json.loads((workdir / "eval" / "step_8.json").read_text())
  final = [r for r in log if r["kind"] == "eval/validation"][-1]
  assert evaluated["loss"] == pytest.approx(final["loss"], rel=1e-5)
  assert "softmax" in (root / "summary.md").read_text()
  assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  losses = {
      e.step: v.simple_value
      for e in tensorboard_events(workdir) for v in e.summary.value if v.tag == "train/loss"
  }
  assert losses == {r["step"]: pytest.approx(r["loss"]) for r in log if r["kind"] == "train"}
  # Nothing written through a temporary name: object stores have no cheap rename.
  import gcsfs  # only now: gcsfs reads the emulator fixture's environment when imported
  leftovers = [p for p in gcsfs.GCSFileSystem().find(gs_dir) if ".tmp" in p]
  assert not leftovers, leftovers
