"""Checkpoint, resume, preemption and safety, with real processes killed mid-run."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from etils import epath

from lm import checkpointing, ownership, run_log, train
from small import small_config, tensorboard_events

CONFIG_FILE = """
from small import small_config

def get_config():
  c = small_config({corpus!r})
  c.train.update(steps={steps}, log_every_steps=1)
  c.checkpoint.update(every_steps={every}, keep=2)
  c.eval.every_steps = 1000
  return c
"""


def losses(workdir) -> dict[int, float]:
  """Per-step training loss; a step logged twice (before an interruption and after the resume)
  keeps its later value."""
  out = {}
  for record in run_log.read(workdir):
    if record["kind"] == "train":
      out[record["step"]] = record["loss"]
  return out


def trainer(tmp_path, corpus, workdir, steps=30, every=5, *flags):
  config = tmp_path / "run_config.py"
  config.write_text(CONFIG_FILE.format(corpus=str(corpus), steps=steps, every=every))
  cmd = [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}", *flags]
  # The config file imports tests/small.py.
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def assert_finite(params):
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params))


def run_until(proc, marker: str) -> str:
  """Reads the trainer's output until a line starts with marker; returns what it read."""
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if line.startswith(marker):
      return "".join(seen)
  raise AssertionError(f"the trainer ended before {marker!r}:\n{''.join(seen)[-3000:]}")


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
  """An uninterrupted 30-step run."""
  workdir = tmp_path_factory.mktemp("reference")
  proc = trainer(workdir, small_corpus, workdir / "run")
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  return workdir / "run"


def test_sigkill_then_resume_matches_an_uninterrupted_run(small_corpus, reference, tmp_path):
  workdir = tmp_path / "run"
  proc = trainer(tmp_path, small_corpus, workdir)
  run_until(proc, "step 17/30")
  proc.kill()
  proc.wait()
  killed_at = 17  # the log may miss the last seconds before the kill; the progress line does not
  proc = trainer(tmp_path, small_corpus, workdir)
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  resumed_from = int(output.split("resumed from the checkpoint at step ")[1].split()[0])
  assert resumed_from in (10, 15) and resumed_from < killed_at
  want, got = losses(reference), losses(workdir)
  assert sorted(got) == list(range(1, 31))
  assert got == want, "resumed per-step losses differ from the uninterrupted run"


def test_on_gcs_sigkill_then_resume_matches_an_uninterrupted_run(small_corpus, reference, tmp_path,
                                                                 gs_dir):
  """The same on a gs:// workdir (the GCS emulator): orbax's arrays through tensorstore, the rest
  through gcsfs; the killed job's lease on the workdir lapses after 1 s."""
  lease = "--lease_seconds=1"
  proc = trainer(tmp_path, small_corpus, gs_dir, 30, 5, lease)
  run_until(proc, "step 17/30")
  proc.kill()
  proc.wait()
  time.sleep(1)
  proc = trainer(tmp_path, small_corpus, gs_dir, 30, 5, lease)
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  assert "took over" in output and "resumed from the checkpoint at step 1" in output
  assert losses(gs_dir) == losses(reference)
  assert not (epath.Path(gs_dir) / ownership.OWNER).exists(), "a job that ends releases the workdir"
  steps = [e.step for e in tensorboard_events(gs_dir) if any(v.tag == "train/loss" for v in e.summary.value)]
  assert set(steps) == set(range(1, 31)) and len(steps) >= 30


def test_sigterm_saves_and_exits_cleanly(small_corpus, reference, tmp_path):
  workdir = tmp_path / "run"
  proc = trainer(tmp_path, small_corpus, workdir, every=100)
  run_until(proc, "step 12/30")
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=120)[0]
  assert proc.returncode == 0, output[-3000:]
  saved = int(output.split("preempted: saved the checkpoint at step ")[1].split(";")[0])
  assert saved >= 12
  assert checkpointing.Checkpointer(workdir, small_config(small_corpus).checkpoint).latest_step() == saved
  proc = trainer(tmp_path, small_corpus, workdir, every=100)
  output = proc.communicate(timeout=300)[0]
  assert f"resumed from the checkpoint at step {saved}" in output
  assert losses(workdir) == losses(reference)


def test_an_interrupted_write_is_never_resumed(small_corpus, reference, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  ckpts = workdir / "checkpoints"
  assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [25, 30]
  # What a kill in the middle of writing step 35 leaves behind: orbax's temporary directory.
  partial = ckpts / "35.orbax-checkpoint-tmp-1234567"
  shutil.copytree(ckpts / "30", partial)
  for f in list((partial / "state").rglob("*"))[::2]:
    if f.is_file():
      f.write_bytes(b"")
  c = small_config(small_corpus)
  c.checkpoint.update(every_steps=5, keep=2)
  c.train.update(steps=35, log_every_steps=1)
  assert checkpointing.Checkpointer(workdir, c.checkpoint).latest_step() == 30
  train.train_and_evaluate(c, str(workdir))
  assert "resumed from the checkpoint at step 30" in capsys.readouterr().out
  assert not partial.exists(), "the partial write is cleaned up"
  assert checkpointing.load(str(workdir))[1]["embed"].shape == (320, 32)


def test_resuming_with_a_different_model_names_the_fields(small_corpus, reference, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  c = small_config(small_corpus, attention="hyla")
  c.model.D = 48
  c.train.steps = 40
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, str(workdir))
  message = str(e.value)
  assert "model.D: checkpoint has 32, config has 48" in message
  assert "model.attention: checkpoint has 'softmax', config has 'hyla'" in message
  assert "train.steps" not in message  # training longer is a legitimate change


def test_non_finite_loss_stops_without_saving(small_corpus, tmp_path):
  c = small_config(small_corpus)
  c.train.update(lr=1e30, grad_clip=1e30, steps=10, log_every_steps=1)
  c.checkpoint.every_steps = 2
  with pytest.raises(FloatingPointError, match=r"non-finite loss .* at step \d+"):
    train.train_and_evaluate(c, str(tmp_path))
  for step in (int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()):
    assert_finite(checkpointing.load(str(tmp_path), step)[1])


def test_skip_mode_keeps_training(small_corpus, tmp_path, capsys):
  c = small_config(small_corpus)
  c.train.update(lr=1e30, grad_clip=1e30, steps=6, log_every_steps=1, on_nonfinite="skip")
  train.train_and_evaluate(c, str(tmp_path))
  assert "(train.on_nonfinite=skip)" in capsys.readouterr().out
  assert_finite(checkpointing.load(str(tmp_path))[1])


def test_load_gives_the_config_and_parameters(small_corpus, reference):
  config, params = checkpointing.load(str(reference))
  assert config.model.D == 32 and config.train.steps == 30
  assert params["embed"].shape == (320, 32)
  with pytest.raises(FileNotFoundError, match="no checkpoint at step 7 .* steps there: \\[25, 30\\]"):
    checkpointing.load(str(reference), step=7)


def test_a_relative_workdir_checkpoints_and_loads(small_corpus, tmp_path, monkeypatch):
  """orbax's async commit rejects relative paths; `--workdir=runs/x` is what users type."""
  monkeypatch.chdir(tmp_path)
  c = small_config(small_corpus)
  c.train.update(steps=4, log_every_steps=1)
  c.checkpoint.update(every_steps=2, use_async=True)
  train.train_and_evaluate(c, "runs/relative")
  assert checkpointing.saved_config("runs/relative")[0] == 4
