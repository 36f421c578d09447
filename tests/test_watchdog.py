"""The hang watchdog on a real lm-train process: a step that never completes ends in a stack dump and
exit status 75, and `lm-launch processes --max-restarts` restarts the run from its checkpoint; the
run's goodput accounts for the restart."""

import os
import re
import subprocess
import sys

import pytest

from eval import compare, goodput as goodput_cli
from lm.runtime import goodput, watchdog

HERE = os.path.dirname(__file__)

# A config file runs inside lm-train: this one also makes the third step block forever, once.
HANGING_CONFIG = """
import os
import threading
import pytest

from lm import experiment
from small import small_config

_train_step = experiment.Experiment.train_step


def hanging_train_step(self, state, batch):
  if int(state.step) == 2 and not os.path.exists({marker!r}):
    open({marker!r}, "w").close()
    threading.Event().wait()  # As a collective whose peer is lost would.
  return _train_step(self, state, batch)


experiment.Experiment.train_step = hanging_train_step


def get_config():
  c = small_config({corpus!r})
  c.train.update(steps=5, log_every_steps=1)
  c.checkpoint.every_steps = 2
  c.eval.every_steps = 1000
  c.watchdog.update(step_secs=10.0, first_step_secs=600.0)
  return c
"""


@pytest.mark.slow
def test_a_hung_step_dumps_every_stack_and_the_job_restarts(small_corpus, tmp_path):
  config = tmp_path / "hanging.py"
  config.write_text(HANGING_CONFIG.format(corpus=str(small_corpus), marker=str(tmp_path / "hung")))
  launch = [
      sys.executable, "-m", "launch.cli", "processes", "-n", "1", "--max-restarts=1", "--", sys.executable,
      "-m", "lm.train", f"--config={config}", f"--workdir={tmp_path / 'run'}"
  ]
  result = subprocess.run(launch, capture_output=True, text=True, timeout=600, env={
      **os.environ, "PYTHONPATH": HERE
  })
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "hung").exists()
  err = result.stderr
  assert ("[0] watchdog: the next step did not complete within 10 s; the stack of every thread "
          "follows, then exit status 75") in err
  # Every thread's stack: the main thread where it blocked, and the watchdog's own.
  dump = err[err.index("[0] watchdog:"):err.index("process 0 of 1 exited")]
  assert re.search(rf'File "{re.escape(str(config))}", line \d+ in hanging_train_step', dump), dump
  assert "in _watch" in dump and dump.count("[0] Thread 0x") >= 2
  assert f"lm-launch: process 0 of 1 exited with status {watchdog.HUNG_EXIT_STATUS}" in err
  assert "[0] resumed from the checkpoint at step 2" in result.stdout
  assert "[0] step 5/5" in result.stdout

  # The hung process's last record came just before the 10 s wait: that time was down.
  run = str(tmp_path / "run")
  s = goodput.summarize(compare._records(run))  # pylint: disable=protected-access
  assert s["restarts"] == 1 and s["down"] >= 9.0
  assert s["compiling"] > 0 and s["training"] > 0 and s["restoring"] > 0
  header, _, row = goodput_cli.table([run]).splitlines()
  assert header.startswith("| run | wall-clock | starting | restoring | compiling | training |")
  assert row.startswith("| run | ") and row.endswith(f" | 1 | {100 * s['goodput']:.1f}% |")
