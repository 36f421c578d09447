"""The pieces of unattended runs: compilation cache, goodput accounting, Weights & Biases logging."""

import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from etils import epath

from lm.runtime import compilation_cache, goodput, wandb_log


def test_compilation_cache_lives_in_the_workdir_or_where_configured(tmp_path):
  min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # Store even a tiny program.
  try:
    assert compilation_cache.enable("", tmp_path) == str(tmp_path / "compilation_cache")
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0))
    assert os.listdir(tmp_path / "compilation_cache")
    assert compilation_cache.enable(str(tmp_path / "elsewhere"), tmp_path) == str(tmp_path / "elsewhere")
    jax.jit(lambda x: x * 5 - 2)(jnp.arange(5.0))
    assert os.listdir(tmp_path / "elsewhere")
  finally:
    assert compilation_cache.enable("none", tmp_path) is None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
  assert jax.config.jax_compilation_cache_dir is None


def test_clock_counts_compiling_apart_from_the_phase_it_happens_in():
  clock = goodput.Clock()
  try:
    clock.enter("evaluating")
    jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()  # Traces and compiles.
    clock.enter("training")
    totals = clock.totals()
  finally:
    clock.close()
  assert totals["compiling"] > 0 and all(totals[p] >= 0 for p in goodput.PHASES)
  assert totals["wall"] == pytest.approx(sum(totals[p] for p in goodput.PHASES))
  assert totals["goodput"] == pytest.approx(totals["training"] / totals["wall"])


def record(kind, step, time=0.0, **values):
  return {"kind": kind, "step": step, "time": time, **values}


def test_summarize_moves_repeated_steps_and_counts_time_down():
  phases = lambda **s: {**dict.fromkeys(goodput.PHASES, 0.0), **s}
  records = [
      # The first process trained steps 1..10 in 100 s, then died; its checkpoint was at step 8.
      record("run", 0, 0.0),
      record("goodput", 5, 80.0, **phases(starting=10.0, compiling=20.0, training=50.0), wall=80.0),
      record("goodput", 10, 150.0, **phases(starting=10.0, compiling=20.0, training=100.0,
                                            checkpointing=20.0), wall=150.0),
      # The second started at t=330 (its clock's wall before its last record), from step 8.
      record("run", 8, 340.0),
      record("train", 20, 400.0, loss=1.0),
      record("goodput", 20, 400.0,
             **phases(starting=5.0, restoring=5.0, compiling=10.0, training=40.0, evaluating=10.0),
             wall=70.0),
  ]
  s = goodput.summarize(records)
  # Steps 9 and 10 ran twice: 2 of the first process's 10 steps at 10 s each.
  assert s["repeated"] == 20.0 and s["training"] == 100.0 + 40.0 - 20.0
  assert s["down"] == 330.0 - 150.0
  assert (s["starting"], s["restoring"], s["compiling"], s["checkpointing"],
          s["evaluating"]) == (15.0, 5.0, 30.0, 20.0, 10.0)
  assert s["wall"] == 400.0 and s["goodput"] == 120.0 / 400.0 and s["restarts"] == 1


WANDB = ml_collections.ConfigDict(
    dict(wandb_project="hyla", wandb_entity="", wandb_mode="offline", wandb_dir=""))


class RunLog:

  def __init__(self):
    self.records, self.closed = [], False

  def write(self, step, kind, values):
    self.records.append((step, kind, values))

  def close(self):
    self.closed = True


def wandb_history(run_file: str) -> list[dict]:
  """The logged rows of an offline W&B run, read with wandb's own reader."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel
  from wandb.sdk.internal import datastore  # pylint: disable=import-outside-toplevel
  store, rows = datastore.DataStore(), []
  store.open_for_scan(run_file)
  while (data := store.scan_data()) is not None:
    rec = wandb_internal_pb2.Record()
    rec.ParseFromString(data)
    if rec.WhichOneof("record_type") == "history":
      row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
      rows.append({k: v for k, v in row.items() if not k.startswith("_")})  # W&B's own: _step, ...
  return rows


@pytest.mark.slow
def test_wandb_gets_every_number_and_a_restart_continues_the_run(tmp_path):
  cfg = ml_collections.ConfigDict({**WANDB.to_dict(), "wandb_dir": str(tmp_path)})
  workdir = epath.Path(tmp_path / "run")
  workdir.mkdir()
  for step in (12, 11):  # A restart from step 10 logs step 11 again.
    log = RunLog()
    tee = wandb_log.Tee(log, cfg, workdir, {"model": {"attention": "hyla"}})
    tee.write(step, "train", {"loss": step / 10, "note": "not a number"})
    tee.close()
    assert log.records == [(step, "train", {"loss": step / 10, "note": "not a number"})] and log.closed
  # finish() only asks W&B's service to close a run's file; the service writes the rest of it
  # when it shuts down, as it does when the training process exits.
  import wandb  # pylint: disable=import-outside-toplevel
  wandb.teardown()
  run_id = (workdir / "wandb_run_id").read_text()
  # In the order started: a run's directory is offline-run-<start, in whole seconds>-<id>, and W&B
  # adds -1, -2, ... to the name of a later run that started in the same second.
  files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")), key=os.path.dirname)
  assert [os.path.basename(f) for f in files] == [f"run-{run_id}.wandb"] * 2
  assert [wandb_history(f) for f in files] == [[{
      "step": 12,
      "train/loss": 1.2
  }], [{
      "step": 11,
      "train/loss": 1.1
  }]]


def test_wandb_without_the_extra_names_it(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(ImportError, match=r'install the extra: pip install -e "\.\[wandb\]"'):
    wandb_log.Tee(RunLog(), WANDB, epath.Path(tmp_path), {})


@pytest.mark.slow
def test_optional_extras_are_not_imported_unless_used():
  code = ("import sys, lm.train, launch.cli, eval.goodput; "
          "print(sorted(m for m in ('wandb', 'sky') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.stdout.strip() == "[]", out.stderr[-2000:]
