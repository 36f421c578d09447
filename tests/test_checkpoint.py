"""Checkpoint, resume, preemption and safety, with real processes killed mid-run."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import filesystems
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from small import small_config, tensorboard_events

from lm import checkpointing, train
from lm.experiment import Experiment
from lm.runtime import ownership, run_log

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_on_gcs_sigkill_then_resume_matches_an_uninterrupted_run(small_corpus, reference, tmp_path, gs_dir):
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


def stop_with(signum: int, tmp_path, corpus, workdir) -> int:
  """Sends signum to a run at step 12; returns the step it says it saved (checked on disk)."""
  proc = trainer(tmp_path, corpus, workdir, every=100)
  run_until(proc, "step 12/30")
  proc.send_signal(signum)
  output = proc.communicate(timeout=120)[0]
  word, code = ("interrupted", 130) if signum == signal.SIGINT else ("preempted", 0)
  assert proc.returncode == code and "Traceback" not in output, output[-3000:]
  saved = int(output.split(f"{word}: saved the checkpoint at step ")[1].split(";")[0])
  assert saved >= 12 and checkpointing.latest_step(workdir) == saved
  assert not [p.name for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
  return saved


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(small_corpus, reference, tmp_path):
  workdir = tmp_path / "run"
  saved = stop_with(signal.SIGTERM, tmp_path, small_corpus, workdir)
  proc = trainer(tmp_path, small_corpus, workdir, every=100)
  output = proc.communicate(timeout=300)[0]
  assert f"resumed from the checkpoint at step {saved}" in output
  assert losses(workdir) == losses(reference)


@pytest.mark.slow
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


# The config's fields when checkpoints were introduced.
FIELDS_OF_THE_FIRST_CHECKPOINTS = {
    "checkpoint.every_steps", "checkpoint.keep", "checkpoint.keep_every", "checkpoint.use_async", "data.dir",
    "data.packing_bins", "data.seq_len", "data.shards", "data.source", "data.threads", "data.tokenizer",
    "eval.batch_size", "eval.every_steps", "mesh.data", "mesh.fsdp", "mesh.tensor", "model.D", "model.F",
    "model.H", "model.L", "model.V", "model.attention", "model.attention_dropout", "model.attention_impl",
    "model.causal", "model.dtype", "model.input_dim", "model.max_len", "model.positions", "model.qkv_dim",
    "model.relative_buckets", "model.relative_max_distance", "model.remat", "model.rope_base",
    "model.tied_embeddings", "seed", "task", "train.b1", "train.b2", "train.batch_size", "train.end_lr_frac",
    "train.eps", "train.grad_clip", "train.log_every_steps", "train.lr", "train.microbatches",
    "train.on_nonfinite", "train.steps", "train.warmup_steps", "train.weight_decay"
}


def _only_first_fields(config: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in config.items():
    if isinstance(v, dict):
      out[k] = _only_first_fields(v, f"{prefix}{k}.")
    elif f"{prefix}{k}" in FIELDS_OF_THE_FIRST_CHECKPOINTS:
      out[k] = v
  return out


def test_a_run_saved_before_later_fields_existed_still_resumes(small_corpus, reference, tmp_path):
  """A run saved with only the fields the first checkpoints had resumes under today's defaults: a
  field added since must come with the value that computes what older runs computed
  (checkpointing.ADDED_FIELDS). If this fails after adding a config field, add it there."""
  current = small_config(small_corpus).to_dict()
  old = _only_first_fields(current)
  assert "relative_bias_per_layer" not in old["model"] and "schedule" not in old["train"]
  assert checkpointing.differences(old, current) == []
  current["model"]["relative_bias_per_layer"] = True
  assert checkpointing.differences(old, current) == [("model.relative_bias_per_layer", False, True)]

  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  saved = workdir / "checkpoints" / "30" / "config" / "metadata"
  saved.write_text(json.dumps(_only_first_fields(json.loads(saved.read_text()))))
  step, config = checkpointing.saved_config(str(workdir))
  assert step == 30 and config.train.schedule == "cosine" and config.model.relative_bias_per_layer is False
  # lm-evaluate and lm-sample build the run's Experiment from the saved config.
  assert config.mesh.shard_state_over_data is False and not Experiment(config).state_over_data
  checkpointing.check_compatible(config.to_dict(), small_config(small_corpus).to_dict())
  assert checkpointing.load(str(workdir))[1]["embed"].shape == (320, 32)


@pytest.mark.slow
def test_non_finite_loss_stops_without_saving(small_corpus, tmp_path):
  c = small_config(small_corpus)
  c.train.update(lr=1e30, grad_clip=1e30, steps=10, log_every_steps=1)
  c.checkpoint.every_steps = 2
  with pytest.raises(FloatingPointError, match=r"non-finite loss .* at step \d+"):
    train.train_and_evaluate(c, str(tmp_path))
  for step in (int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()):
    assert_finite(checkpointing.load(str(tmp_path), step)[1])


@pytest.mark.slow
def test_skip_mode_keeps_training(small_corpus, tmp_path, capsys):
  c = small_config(small_corpus)
  c.train.update(lr=1e30, grad_clip=1e30, steps=6, log_every_steps=1, on_nonfinite="skip")
  train.train_and_evaluate(c, str(tmp_path))
  assert "(train.on_nonfinite=skip)" in capsys.readouterr().out
  assert_finite(checkpointing.load(str(tmp_path))[1])


def test_load_gives_the_config_and_parameters(small_corpus, reference, monkeypatch):
  """Only the parameters are read (not the optimiser's moments), equal to those the whole state holds."""
  read = []
  deserialize = ocp.type_handlers.ArrayHandler.deserialize

  async def recording(self, infos, args=None):
    read.extend(info.name for info in infos)
    return await deserialize(self, infos, args)

  monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "deserialize", recording)
  config, params = checkpointing.load(str(reference))
  assert config.model.D == 32 and config.train.steps == 30
  assert params["embed"].shape == (320, 32)
  assert len(read) == len(jax.tree.leaves(params)) and all(name.startswith("params.") for name in read)
  monkeypatch.undo()
  whole = ocp.CheckpointManager(
      epath.Path(reference) / "checkpoints", item_names=("state",),
      options=ocp.CheckpointManagerOptions(create=False))
  state = whole.restore(30, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  jax.tree.map(np.testing.assert_array_equal, params, state["params"])
  assert len(jax.tree.leaves(state)) > 3 * len(read)  # the moments and the rest were there to read
  with pytest.raises(FileNotFoundError, match="no checkpoint at step 7 .* steps there: \\[25, 30\\]"):
    checkpointing.load(str(reference), step=7)


@pytest.mark.slow
def test_a_relative_workdir_checkpoints_and_loads(small_corpus, tmp_path, monkeypatch):
  """orbax's async commit rejects relative paths; `--workdir=runs/x` is what users type."""
  monkeypatch.chdir(tmp_path)
  c = small_config(small_corpus)
  c.train.update(steps=4, log_every_steps=1)
  c.checkpoint.update(every_steps=2, use_async=True)
  train.train_and_evaluate(c, "runs/relative")
  assert checkpointing.saved_config("runs/relative")[0] == 4


@pytest.mark.slow
def test_a_non_finite_stop_finishes_the_save_in_flight(small_corpus, tmp_path):
  """The stop comes while the asynchronous save of the step before is being written."""
  c = small_config(small_corpus)
  c.train.update(lr=1e9, warmup_steps=1, steps=10, log_every_steps=1)
  c.checkpoint.update(every_steps=1, use_async=True)
  with pytest.raises(FloatingPointError, match=r"non-finite loss .* at step (\d+)") as e:
    train.train_and_evaluate(c, str(tmp_path))
  failed = int(re.search(r"at step (\d+)", str(e.value))[1])
  named = int(re.search(r"the latest checkpoint is at step (\d+)", " ".join(e.value.__notes__))[1])
  ckpts = tmp_path / "checkpoints"
  assert named == failed - 1 >= 1
  assert not [p.name for p in ckpts.iterdir() if "tmp" in p.name], "a save was abandoned"
  assert checkpointing.saved_config(str(tmp_path))[0] == named
  assert_finite(checkpointing.load(str(tmp_path), named)[1])


@pytest.mark.slow
def test_sigint_saves_and_exits_130(small_corpus, reference, tmp_path):
  """Ctrl-C saves as SIGTERM does; 130 tells a calling script that the run did not finish."""
  workdir = tmp_path / "run"
  saved = stop_with(signal.SIGINT, tmp_path, small_corpus, workdir)
  assert losses(workdir) == {s: l for s, l in losses(reference).items() if s <= saved}


@pytest.mark.slow
def test_resuming_in_more_microbatches_continues_the_same_run(small_corpus, reference, tmp_path):
  """The out-of-memory message's first fix, raising train.microbatches, applies to a run that has
  checkpoints: the resumed steps compute what the uninterrupted run computed (up to the order of a
  float32 sum)."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  shutil.rmtree(workdir / "checkpoints" / "30")
  c = small_config(small_corpus)
  c.train.update(steps=30, log_every_steps=1, microbatches=2)
  c.checkpoint.update(every_steps=5, keep=2)
  c.eval.every_steps = 1000
  before = len(run_log.read(workdir))
  train.train_and_evaluate(c, str(workdir))
  resumed = {r["step"]: r["loss"] for r in run_log.read(workdir)[before:] if r["kind"] == "train"}
  assert sorted(resumed) == [26, 27, 28, 29, 30]
  want = losses(reference)
  np.testing.assert_allclose([resumed[s] for s in resumed], [want[s] for s in resumed], rtol=1e-5)


def test_resuming_with_fewer_steps_than_the_checkpoint_stops(small_corpus, reference, tmp_path):
  """Going on would evaluate step 30's parameters and log them as step 20's."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  c = small_config(small_corpus)
  c.train.steps = 20
  with pytest.raises(
      ValueError, match=r"holds a checkpoint at step 30, past train.steps=20; set "
      r"--config.train.steps=30 or more .*`lm-evaluate --workdir=.* --step=30`"):
    train.train_and_evaluate(c, str(workdir))
  assert checkpointing.latest_step(workdir) == 30


def damage(step_dir, how: str) -> None:
  if how == "truncated file":
    for f in (step_dir / "state").rglob("*"):
      if f.is_file() and f.parent.name == "d":
        f.write_bytes(f.read_bytes()[:10])
  elif how == "missing file":
    (step_dir / "data" / "shard_00000.json").unlink()
  else:  # an empty step directory
    shutil.rmtree(step_dir)
    step_dir.mkdir()


@pytest.mark.parametrize("foreign", [False, True])
def test_an_empty_or_foreign_step_directory_is_called_what_it_is(small_corpus, reference, tmp_path, foreign):
  """An empty checkpoints/999 was "a checkpoint at step 999", with advice to train to step 999 and to
  evaluate it; lm-evaluate on it was a traceback."""
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  (workdir / "checkpoints" / "999").mkdir()
  if foreign:
    (workdir / "checkpoints" / "999" / "notes.txt").write_text("mine")
  what = "holds none of the files of a checkpoint" if foreign else "is an empty directory"
  line = (f"{workdir}/checkpoints/999 {what}, not a checkpoint; move it out of {workdir}/checkpoints "
          f"(or delete it) and run the command again")
  c = small_config(small_corpus)
  c.train.steps = 30
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, str(workdir))
  assert str(e.value) == line
  with pytest.raises(ValueError) as e:
    checkpointing.saved_config(str(workdir))
  assert str(e.value) == line


@pytest.mark.parametrize("how", ["truncated file", "missing file", "empty step directory"])
def test_a_damaged_latest_checkpoint_is_named_in_one_message(small_corpus, reference, tmp_path, how):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  damage(workdir / "checkpoints" / "30", how)
  c = small_config(small_corpus)
  c.train.steps = 30
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, str(workdir))
  message = str(e.value)
  assert message.startswith(f"the checkpoint at step 30 ({workdir}/checkpoints/30) cannot be read: ")
  assert "\n" not in message and len(message) < 700, message
  assert message.endswith("add --config.checkpoint.skip_damaged=true (damaged steps move to "
                          f"{workdir}/damaged_checkpoints; nothing is deleted)")
  assert (workdir / "checkpoints" / "30").exists()  # nothing moved without the flag


@pytest.mark.slow
def test_skip_damaged_resumes_from_the_step_before(small_corpus, reference, tmp_path, capsys):
  workdir = tmp_path / "run"
  shutil.copytree(reference, workdir)
  damage(workdir / "checkpoints" / "30", "truncated file")
  c = small_config(small_corpus)
  c.train.update(steps=30, log_every_steps=1)
  c.checkpoint.update(every_steps=5, skip_damaged=True)
  train.train_and_evaluate(c, str(workdir))
  out = capsys.readouterr().out
  assert re.search(
      r"warning: the checkpoint at step 30 .* cannot be read: .*; moved it to "
      rf"{workdir}/damaged_checkpoints/30\n", out), out
  assert "resumed from the checkpoint at step 25" in out
  assert (workdir / "damaged_checkpoints" / "30" / "state").is_dir()  # kept, out of the way
  assert checkpointing.latest_step(workdir) == 30  # trained again and saved
  assert losses(workdir) == losses(reference)


def test_reading_a_misspelt_workdir_creates_nothing(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*/typo/checkpoints"):
    checkpointing.saved_config(str(tmp_path / "typo"))
  assert checkpointing.latest_step(tmp_path / "typo") is None
  assert not (tmp_path / "typo").exists()


# Where mounting a small file system is not permitted, the run log's writes fail from step 10 on.
FULL_DISK_WITHOUT_A_MOUNT = """
import errno, os
from data_pipelines import storage

def _full(path, data, write=storage.write_bytes):
  if b'"step": 10,' in data:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  write(path, data)

storage.write_bytes = _full
"""


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_the_saved_step(small_corpus, tmp_path):
  """A file system with room for the first checkpoint but not the second: one line names the cause,
  the file system, the latest checkpoint (which exists) and the fix."""
  with filesystems.small(tmp_path / "disk", "850k") as mounted:
    workdir = tmp_path / "disk" / "run"
    config = tmp_path / "run_config.py"
    config.write_text(
        CONFIG_FILE.format(corpus=str(small_corpus), steps=30, every=5).replace(
            "  return c", "  c.compilation_cache = 'none'\n  return c") +
        ("" if mounted else FULL_DISK_WITHOUT_A_MOUNT))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    result = subprocess.run([sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}"],
                            capture_output=True, text=True, env=env, timeout=300)
    stderr = result.stderr
    # The run log's retries may warn first (without a mount its write keeps failing; with one, its
    # periodic write can meet the disk the checkpoint in flight has filled); the message is one line.
    assert result.returncode == 1 and "Traceback" not in stderr, result.stderr[-3000:]
    assert all("writing the run log failed (retrying every 2s)" in line
               for line in stderr.splitlines()[:-1]), result.stderr[-3000:]
    match = re.fullmatch(
        r"lm-train: no space left on device: cannot write (\S+) \(on the file system mounted at "
        r"(\S+), [\d.]+ MB free\); free space on it; (?:.*; )?the latest checkpoint is at step (\d+); "
        r"the same command resumes from it",
        stderr.splitlines()[-1])
    assert match, result.stderr
    assert match[1].startswith(str(workdir)) and (not mounted or match[2] == str(tmp_path / "disk"))
    assert int(match[3]) >= 5 and checkpointing.latest_step(workdir) == int(match[3])
    assert not [p.name for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name
               ], "a failed save was left"
    assert_finite(checkpointing.load(str(workdir), int(match[3]))[1])


# Where mounting a small file system is not permitted: config.json, written at every start, cannot be.
CONFIG_JSON_ON_A_FULL_DISK = """
import errno, os
from data_pipelines import storage

def _full(path, data, write=storage.write_bytes):
  if str(path).endswith('config.json'):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  write(path, data)

storage.write_bytes = _full
"""


@pytest.mark.slow
def test_a_full_disk_at_the_start_of_a_resume_names_the_latest_checkpoint(small_corpus, tmp_path):
  """A disk that filled up after the last checkpoint: the rerun's first write (the workdir's lock,
  config.json) fails before training, and its line still names the checkpoint it would resume from."""
  with filesystems.small(tmp_path / "disk", "850k") as mounted:
    workdir = tmp_path / "disk" / "run"
    config = tmp_path / "run_config.py"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    command = [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}"]
    settings = CONFIG_FILE.format(corpus=str(small_corpus), steps=5,
                                  every=5).replace("  return c", "  c.compilation_cache = 'none'\n  return c")
    config.write_text(settings)
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0 and checkpointing.latest_step(workdir) == 5, first.stderr[-3000:]
    if mounted:
      with open(tmp_path / "disk" / "filler", "wb",
                buffering=0) as f, pytest.raises(OSError, match="No space left"):
        while True:
          f.write(b"\0" * 4096)
    else:
      settings += CONFIG_JSON_ON_A_FULL_DISK
    config.write_text(settings.replace("steps=5,", "steps=10,"))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert re.fullmatch(
        rf"lm-train: no space left on device: cannot write {re.escape(str(workdir))}/\S+ \(on the file "
        r"system mounted at \S+, [\d.]+ MB free\); free space on it; the latest checkpoint is at step 5; "
        r"the same command resumes from it\n", result.stderr), result.stderr


# The final save (step 10) meets a full disk in its asynchronous part, which ends after the final
# evaluation, as the trainer waits for it: orbax's write of the config item fails.
FINAL_SAVE_ON_A_FULL_DISK = """
import errno, os
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

async def _full(self, x, directory, save=handler.JsonCheckpointHandler._save_fn):
  if os.path.basename(os.path.dirname(os.fspath(directory))).startswith('10.'):
    path = os.path.join(os.fspath(directory), 'metadata')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  await save(self, x, directory)

handler.JsonCheckpointHandler._save_fn = _full
"""


def test_a_full_disk_at_the_final_save_removes_the_partial_checkpoint(small_corpus, tmp_path):
  """The final save's failure was found outside the run's failure path: its partial step directory
  stayed on the full disk, though this page says what a failed save wrote is deleted at exit."""
  workdir = tmp_path / "run"
  config = tmp_path / "run_config.py"
  config.write_text(
      CONFIG_FILE.format(corpus=str(small_corpus), steps=10, every=5) + FINAL_SAVE_ON_A_FULL_DISK)
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
  result = subprocess.run([sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}"],
                          capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert re.fullmatch(
      rf"lm-train: no space left on device: cannot write {re.escape(str(workdir))}/checkpoints/10\.orbax-"
      r"checkpoint-tmp\S*/config\S*/metadata \(on the file system mounted at \S+, [\d.]+ MB free\); free "
      r"space on it; the latest checkpoint is at step 5; the same command resumes from it\n",
      result.stderr), result.stderr[-3000:]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["5"], "a failed save was left"
  assert checkpointing.latest_step(workdir) == 5
  assert_finite(checkpointing.load(str(workdir), 5)[1])


# What a save or restore that failed on a loaded host leaves behind (tests below): TensorStore
# operations whose awaiting event loop orbax closed, ending afterwards.
ABANDONED = """
import asyncio
import tensorstore as ts

def _end_an_abandoned_operation() -> None:
  promise, future = ts.Promise.new()
  async def await_it():
    future.__await__()  # registers the loop to hand the result to, as `await` does
  loop = asyncio.new_event_loop()
  loop.run_until_complete(await_it())
  loop.close()
  promise.set_result(None)
"""
# In lm-train: one ends with step 3's log.
LATE_WRITE = ABANDONED + """
from data_pipelines import storage

def _write(path, data, write=storage.write_bytes):
  if b'"step": 3,' in data:
    _end_an_abandoned_operation()
  write(path, data)

storage.write_bytes = _write
"""
# In lm-evaluate (imported by every process, as sitecustomize): one ends as the checkpoint is looked for.
LATE_READ = ABANDONED + """
from lm import checkpointing

def _saved_config(*args, read=checkpointing.saved_config):
  _end_an_abandoned_operation()
  return read(*args)

checkpointing.saved_config = _saved_config
"""


@pytest.mark.slow
def test_writes_of_a_failed_save_that_end_late_print_nothing(small_corpus, tmp_path):
  """On a loaded host the writes a full disk cut short ended after orbax had closed their event
  loop, and each printed asyncio's "Event loop is closed" traceback above lm-train's one line."""
  config = tmp_path / "run_config.py"
  config.write_text(CONFIG_FILE.format(corpus=str(small_corpus), steps=4, every=100) + LATE_WRITE)
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
  result = subprocess.run(
      [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0 and "step 4/4" in result.stdout, result.stderr[-3000:]
  assert result.stderr == "", result.stderr[-3000:]


# What else a restore that failed on one array leaves (about one lm-evaluate in four on a damaged
# checkpoint): orbax's read coroutines of the other arrays, closed when collected, raise their own
# error ("Exception ignored in: <coroutine ...>"), and tasks of them that failed unawaited are logged
# ("Task exception was never retrieved"). Built here under orbax's own file name, as Python shows them.
ORBAX_LATE = '''
import asyncio, gc, types
import orbax.checkpoint._src.serialization.serialization as orbax_serialization
from lm import checkpointing

_CODE = """
async def _read_array_index_and_device_put(pending):
  try:
    await pending()
  except BaseException as e:
    raise Exception("Encountered error while reading array index: (slice(0, 4, 1),)") from e
"""
_orbax = {}
exec(compile(_CODE, orbax_serialization.__file__, "exec"), _orbax)

@types.coroutine
def _pending():
  yield

def _end_orbax_reads_late() -> None:
  coroutine = _orbax["_read_array_index_and_device_put"](_pending)
  coroutine.send(None)
  del coroutine  # closed when collected: it raises
  loop = asyncio.new_event_loop()
  async def fail():
    raise ValueError("OUT_OF_RANGE")
  task = loop.create_task(_orbax["_read_array_index_and_device_put"](fail))
  loop.run_until_complete(asyncio.sleep(0.01))
  loop.close()
  del task
  gc.collect()

def _saved_config(*args, read=checkpointing.saved_config):
  _end_orbax_reads_late()
  return read(*args)

checkpointing.saved_config = _saved_config
'''


@pytest.mark.slow
@pytest.mark.parametrize("late", ["event loop", "orbax coroutines"])
def test_reads_of_a_failed_restore_that_end_late_print_nothing(tmp_path, late):
  """The same for the reading tools: lm-evaluate on a damaged checkpoint printed them too, and orbax's
  abandoned read coroutines."""
  (tmp_path / "sitecustomize.py").write_text(LATE_READ if late == "event loop" else ORBAX_LATE)
  env = {
      **os.environ, "PYTHONPATH":
          os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
  }
  result = subprocess.run([sys.executable, "-m", "eval.evaluate", f"--workdir={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 1 and result.stderr.startswith(f"lm-evaluate: no checkpoint in {tmp_path}")
  assert result.stderr.count("\n") == 1, result.stderr[-3000:]
