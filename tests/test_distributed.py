"""Sharded training on simulated devices and real multi-process runs on 127.0.0.1."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from small import xla_flags

from lm.runtime import run_log

HERE = os.path.dirname(__file__)


def _env(devices: int) -> dict:
  return {**os.environ, "PYTHONPATH": HERE, "XLA_FLAGS": xla_flags(devices)}


@pytest.mark.slow
def test_meshes_and_microbatches_give_the_same_losses(small_corpus):
  result = subprocess.run(
      [sys.executable, os.path.join(HERE, "scripts", "mesh_losses.py"),
       str(small_corpus)], capture_output=True, text=True, env=_env(16), timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  by_model = json.loads(result.stdout.strip().splitlines()[-1])
  all_reduces = by_model.pop("all-reduces")
  # The parameters whole on every device: one all-reduce a step, of one float32 vector holding the
  # summed loss, the summed weight and every gradient (not one per microbatch and parameter).
  flat = all_reduces["4 devices data=4, 2 microbatches"]
  assert flat["sums_on_devices"] and flat["shapes"] == [f"f32[{flat['parameters'] + 2}]{{0}}"], flat
  # Parameters split over fsdp and tensor: jit partitions the step and places the sums itself.
  assert not all_reduces["16 devices data=4 fsdp=2 tensor=2, 2 microbatches"]["sums_on_devices"]
  assert flat["params_whole"] > 0 and flat["all_gathers"] == 0, flat
  # The state split over the data axis: every parameter stored in shards, gathered whole each step.
  split = all_reduces["4 devices data=4, state over data, 2 microbatches"]
  assert not split["sums_on_devices"] and split["params_whole"] == 0 and split["all_gathers"] > 0, split
  lm_losses = by_model["language model"]["1 device"]
  assert lm_losses[-1] < lm_losses[0]
  for model, losses in by_model.items():
    reference = losses.pop("1 device")
    assert max(reference) - min(reference) > 1e-2, model  # steps that move: a match is not trivial
    for name, got in losses.items():
      np.testing.assert_allclose(got, reference, rtol=2e-5, err_msg=f"{model}: {name}")


MULTI_CONFIG = """
from small import small_config

def get_config():
  c = small_config({corpus!r})
  c.data.shards = 2  # fixed: the global batch is the same for one process or two
  c.train.update(batch_size=16, steps=20, log_every_steps=1)
  c.checkpoint.update(every_steps=5, keep=2)
  c.eval.update(every_steps=1000, batch_size=16)
  return c
"""


def _losses(workdir) -> dict[int, float]:
  out = {}
  for record in run_log.read(workdir):
    if record["kind"] == "train":
      out[record["step"]] = record["loss"]
  return out


def _final_eval(workdir) -> dict:
  return [l for l in run_log.read(workdir) if l["kind"] == "eval/validation"][-1]


def _child(launcher: subprocess.Popen, process_id: int) -> int:
  """The pid of the launcher's child with that --process_id."""
  with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
    for pid in f.read().split():
      with open(f"/proc/{pid}/cmdline") as cmdline:
        if f"--process_id={process_id}" in cmdline.read().split("\0"):
          return int(pid)
  raise AssertionError(f"no process {process_id}")


@pytest.mark.slow
def test_two_processes_match_one_and_restart_exactly_after_sigkill(small_corpus, tmp_path):
  config = tmp_path / "multi.py"
  config.write_text(MULTI_CONFIG.format(corpus=str(small_corpus)))
  train = lambda workdir: [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}"]
  one = tmp_path / "one_process"
  result = subprocess.run(train(one), capture_output=True, text=True, env=_env(8), timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]

  env = {**os.environ, "PYTHONPATH": HERE}
  # One compilation cache for the two-process runs: only the first compiles (and the bitwise
  # comparison below covers programs loaded from the cache too). They keep the state split over the
  # data axis, as configs/c4_50m.py does on its 4 hosts; the one process keeps it whole.
  launch = lambda workdir, *flags: [
      sys.executable, "-m", "launch.cli", "processes", "-n", "2", "--xla_devices", "4", *flags, "--", *train(
          workdir), f"--config.compilation_cache={tmp_path / 'cache'}",
      "--config.mesh.shard_state_over_data=True"
  ]
  two = tmp_path / "two_processes"
  result = subprocess.run(launch(two), capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]
  want, got = _losses(one), _losses(two)
  assert sorted(got) == list(range(1, 21))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
  # Evaluation splits the validation set by process; token-weighted sums make it the same number.
  assert _final_eval(two)["tokens"] == _final_eval(one)["tokens"]
  np.testing.assert_allclose(_final_eval(two)["loss"], _final_eval(one)["loss"], rtol=1e-5)

  killed = tmp_path / "killed"
  proc = subprocess.Popen(launch(killed, "--max-restarts=1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "step 12/20" in line:
      # SIGKILL: the process gets no chance to clean up; the launcher restarts the whole job.
      os.kill(_child(proc, 1), signal.SIGKILL)
      break
  output = "".join(seen) + proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, output[-3000:]
  assert "lm-launch: process 1 of 2 exited with status 137; stopping the others" in output
  assert "lm-launch: restarting all 2 processes (1 of 1 restarts)" in output
  # Checkpoints are saved every 5 steps, asynchronously: at the kill, step 10's may still be in flight,
  # and then both processes go back to step 5. Either way both resume from the same step, before 12,
  # so the steps after it up to 12 run twice.
  resumed = sorted(re.findall(r"\[(\d)\] resumed from the checkpoint at step (\d+)", output))
  assert [p for p, _ in resumed] == ["0", "1"] and resumed[0][1] == resumed[1][1] in ("5", "10"), resumed
  # The latest record of each step, bit for bit those of the uninterrupted run.
  assert _losses(killed) == got


@pytest.mark.slow
def test_sigterm_stops_both_processes_at_the_same_step(small_corpus, tmp_path):
  config = tmp_path / "multi.py"
  config.write_text(
      MULTI_CONFIG.format(corpus=str(small_corpus)).replace("every_steps=5", "every_steps=5000"))
  workdir = tmp_path / "run"
  launch = [
      sys.executable, "-m", "launch.cli", "processes", "-n", "2", "--xla_devices", "4", "--", sys.executable,
      "-m", "lm.train", f"--config={config}", f"--workdir={workdir}", "--config.train.steps=1000"
  ]  # steps enough that the run is still going when the signal lands (a step takes milliseconds)
  proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={
      **os.environ, "PYTHONPATH": HERE
  })
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "step    8/1000" in line:  # the step is right-aligned to the width of the total
      proc.send_signal(signal.SIGTERM)
      break
  output = "".join(seen) + proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  saved = {
      line.split("] ")[0]: int(line.split("at step ")[1].split(";")[0])
      for line in output.splitlines()
      if "preempted: saved the checkpoint" in line
  }
  assert set(saved) == {"[0", "[1"} and len(set(saved.values())) == 1, output[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == [str(next(iter(saved.values())))]
