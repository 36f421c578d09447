"""The training loop end to end on a generated corpus, and every attention preset taking steps."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small import FAST_CPU_COMPILE, small_config, xla_flags

from configs import tiny
from data_pipelines import pipeline, sources
from eval import sample as eval_sample
from lm import attention, checkpointing, decode, experiment, train
from lm.experiment import Experiment
from lm.runtime import cli, run_log


def test_training_lowers_validation_loss_and_logs(small_corpus, tmp_path, capsys):
  c = small_config(small_corpus)
  cache = jax.config.jax_compilation_cache_dir
  final = train.train_and_evaluate(c, str(tmp_path))
  out = capsys.readouterr().out
  # On CPU the "peak" is a matmul measured at the start, which a step may beat (a busy host then, or
  # fusions faster than it): the column says so rather than showing an MFU above 100%.
  assert "step 40/40 | loss" in out and "tok/s | of measured matmul " in out and "% | ETA" in out
  assert "MFU" not in out
  lines = run_log.read(tmp_path)
  evals = [l for l in lines if l["kind"] == "eval/validation"]
  assert [e["step"] for e in evals] == [20, 40]
  trains = [l for l in lines if l["kind"] == "train"]
  assert [t["step"] for t in trains] == [10, 20, 30, 40]
  assert trains[-1]["loss"] < trains[0]["loss"] - 1.0
  data = sources.resolve(c.data, 320)
  unigram = pipeline.unigram_perplexity(data.train, data.validation, data.tokenizer)
  assert final["validation"]["perplexity"] < 0.7 * unigram
  assert final["validation"]["tokens"] == evals[-1]["tokens"] > 0
  assert json.loads((tmp_path / "config.json").read_text())["model"]["V"] == 320
  assert jax.config.jax_compilation_cache_dir == cache != c.compilation_cache  # the run's is its own


@pytest.mark.slow
@pytest.mark.parametrize("name", list(attention.PRESETS))
def test_every_preset_trains(small_corpus, name):
  c = small_config(small_corpus, attention=name)
  exp = Experiment(c)
  data = sources.resolve(c.data, 320)
  it = iter(pipeline.train_dataset(data.train, data.tokenizer, seq_len=32, batch_size=8, seed=0))
  state = exp.init_state()
  losses = []
  for _ in range(6):
    state, stats = exp.train_step(state, exp.global_batch(next(it)))
    losses.append(float(stats["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_a_cpu_run_prints_no_libtpu_lines(small_corpus, tmp_path):
  """libtpu is installed for lm-compile; on a CPU host lm-train must not load it (it prints an
  error-looking trace). ALLOW_MULTIPLE_LIBTPU_LOAD: the trace shows even when another process holds
  libtpu's lock, as on a busy CI machine."""
  config = tmp_path / "config.py"
  config.write_text(f"from small import small_config\n\ndef get_config():\n"
                    f"  c = small_config({str(small_corpus)!r})\n  c.train.steps = 2\n  return c\n")
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  env.pop("JAX_PLATFORMS", None)
  result = subprocess.run(
      [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={tmp_path / 'run'}"],
      capture_output=True, text=True, env=env, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "step 2/2 | loss" in result.stdout
  noise = [
      l for l in (result.stdout + result.stderr).splitlines()
      if re.search(r"libtpu|TPU_|INVALID_ARGUMENT|InitGoogle|Source Location Trace", l)
  ]
  assert not noise, "\n".join(noise)


@pytest.mark.slow
def test_bad_attention_name_stops_before_training(tmp_path):
  cmd = [
      sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={tmp_path}",
      "--config.model.attention=hyla2"
  ]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "lm-train: unknown attention 'hyla2'; choose one of: softmax, linear, hyla" in result.stderr
  assert "Traceback" not in result.stderr


# The first step of a fixed model on a fixed batch, measured when the test was written (jax 0.10.2,
# CPU). Per preset: (loss, gradient norm before clipping).
GOLDEN_FIRST_STEP = {
    "softmax": (4.650096893310547, 1.4470826387405396),
    "linear": (4.578351974487305, 2.2480928897857666),
    "hyla": (4.573303699493408, 4.1600847244262695)
}


def fixed_batch(V: int, B: int, T: int) -> dict[str, np.ndarray]:
  """Rows of two packed documents (10 and T+1-10 tokens) of random token ids."""
  seg_bt = np.broadcast_to(np.where(np.arange(T + 1) < 10, 1, 2), (B, T + 1))
  pos_bt = np.where(seg_bt == 1, np.arange(T + 1), np.arange(T + 1) - 10)
  tokens_bt = np.random.default_rng(0).integers(4, V, (B, T + 1))
  return pipeline.to_model_batch({
      "inputs": tokens_bt,
      "inputs_segment_ids": seg_bt,
      "inputs_positions": pos_bt
  })


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GOLDEN_FIRST_STEP))
def test_first_step_matches_the_golden_values(name):
  c = tiny.get_config()
  c.model.update(V=64, D=32, H=4, L=2, F=64, attention=name)
  c.data.seq_len = 16
  c.train.batch_size = 4
  exp = Experiment(c)  # builds no data: the batch is given
  _, stats = exp.train_step(exp.init_state(), exp.global_batch(fixed_batch(64, 4, 16)))
  got = (float(stats["loss"]), float(stats["grad_norm"]))
  np.testing.assert_allclose(
      got, GOLDEN_FIRST_STEP[name], rtol=2e-5, err_msg=(
          f"the first training step of {name} attention changed (loss, gradient norm). The same seed, "
          "config and batch now give other numbers: the model, its initialisation, the attention core "
          "or the loss computes something else. If that change is intended, say so in the commit message "
          "and update GOLDEN_FIRST_STEP; if not, it is a bug. A difference near 1e-6 alone is only "
          "floating-point summation order (another jax version or kernel)."))


@pytest.mark.slow
def test_a_split_state_steps_as_the_whole_state_does_over_microbatches():
  """mesh.shard_state_over_data gathers the parameters that a bfloat16 model only uses rounded already
  rounded, so their gradients arrive in bfloat16; over 4 microbatches they still add up in float32, as
  the whole state's do, and the step's new parameters and moments are the same to the bit (added in
  bfloat16 they differed by up to 1e-4 in the gradients)."""
  batch = fixed_batch(64, 8, 16)
  states = {}
  for split in (False, True):
    c = tiny.get_config()
    c.model.update(V=64, D=32, H=4, L=2, F=64, dtype="bfloat16")
    c.data.seq_len = 16
    c.train.update(batch_size=8, microbatches=4)
    c.mesh.update(data=1, shard_state_over_data=split)
    exp = Experiment(c, devices=jax.devices()[:1])
    assert exp.state_over_data == split
    states[split], _ = exp.train_step(exp.init_state(), exp.global_batch(batch))
  jax.tree.map(np.testing.assert_array_equal, states[True], states[False])


@pytest.mark.parametrize("field, value", [("train.steps", 0), ("train.steps", -5), ("train.microbatches", 0),
                                          ("checkpoint.every_steps", 0), ("eval.every_steps", 0),
                                          ("data.seq_len", 0)])
def test_counts_below_one_are_refused_by_name(field, value):
  c = tiny.get_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(
      ValueError, match=rf"^{field}={value} counts something and must be a whole "
      rf"number of at least 1; set --config.{field}=N$"):
    Experiment(c)


@pytest.mark.parametrize("field, value", [("train.lr", 0.0), ("train.lr", -1.0), ("train.warmup_steps", -3)])
def test_rates_and_warmup_out_of_range_are_refused(field, value):
  """A negative rate used to train, climbing the loss to 1e11; a rate of 0 trained nothing; a negative
  warmup was taken without a word."""
  c = tiny.get_config()
  section, name = field.split(".")
  c[section][name] = value
  bound = "above 0; set --config.train.lr=X" if name == "lr" else "0 or more; set --config.train.warmup_steps=N"
  with pytest.raises(ValueError, match=rf"^{field}={value} must be {re.escape(bound)}$"):
    Experiment(c)


@pytest.mark.parametrize("field, value, words", [
    ("checkpoint.keep", 0, "counts something and must be a whole number of at least 1 (0 deleted every "
     "checkpoint, the final one included); set --config.checkpoint.keep=N"),
    ("checkpoint.keep", -1, "counts something"),
    ("checkpoint.keep_every", -2, "must be 0 or more; set --config.checkpoint.keep_every=N"),
    ("data.packing_bins", 0, "counts something"),
    ("data.threads", -1, "must be 0 or more"),
    ("data.shards", -1, "must be 0 or more"),
    ("model.max_len", 0, "counts something"),
    ("eval.final_batches", 0, "counts something"),
    ("train.lr", float("nan"), "must be a finite number; set --config.train.lr=X"),
    ("train.lr", float("inf"), "must be a finite number"),
    ("train.grad_clip", -1.0, "must be 0 or more; set --config.train.grad_clip=X"),
    ("train.b2", 1.0, "must be at least 0 and below 1; set --config.train.b2=X"),
    ("model.attention_dropout", -0.1, "must be at least 0 and below 1"),
    ("watchdog.step_secs", -5.0, "must be 0 or more seconds (watchdog.step_secs=0 turns the watchdog off)"),
    ("watchdog.first_step_secs", float("nan"), "must be a finite number"),
    ("watchdog.first_step_secs", 0.0, "must be above 0 while the watchdog is on"),
    ("cpu_devices", -2, "must be 0 or more; set --config.cpu_devices=N"),
])
def test_every_count_rate_and_duration_is_checked_by_name(field, value, words):
  """checkpoint.keep=0 deleted every checkpoint, the final one included, and exited 0; a negative
  watchdog timeout turned the watchdog off without a word."""
  c = tiny.get_config()
  *sections, name = field.split(".")
  (c[sections[0]] if sections else c)[name] = value
  with pytest.raises(ValueError, match=rf"^{re.escape(field)}={re.escape(repr(value))} {re.escape(words)}"):
    Experiment(c)


def test_compositional_configs_pass_the_checks():
  from configs import fuzzy_logic, sraven  # pylint: disable=import-outside-toplevel
  for module in (tiny, sraven, fuzzy_logic):
    experiment.check_counts(module.get_config())


@pytest.mark.slow
@pytest.mark.parametrize(
    "override",
    ["--config.checkpoint.keep=0", "--config.watchdog.step_secs=-1", "--config.train.microbatches=3"])
def test_a_refused_config_writes_nothing(tmp_path, override):
  """Refused configs used to leave a workdir holding the lock files (and keep=0 to train, then delete
  every checkpoint); now the line comes before any file is written."""
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={workdir}", override],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1, result.stderr
  assert result.stderr.startswith("lm-train: ") and result.stderr.count("\n") == 1, result.stderr
  assert not workdir.exists()


def test_running_out_of_device_memory_names_the_knobs():
  """What XLA raises when an array does not fit (lm-train's line; it was a 46-line traceback)."""
  with pytest.raises(jax.errors.JaxRuntimeError) as e:
    jnp.zeros((10**12,), jnp.float32).block_until_ready()  # 4 TB
  assert re.fullmatch(
      r"out of device memory \(RESOURCE_EXHAUSTED: Out of memory allocating \d+ bytes\.\); raise "
      r"train\.microbatches, lower train\.batch_size or data\.seq_len, .*", train._out_of_memory(e.value))
  assert train._out_of_memory(ValueError("RESOURCE_EXHAUSTED")) is None


def test_a_microbatch_split_that_does_not_fit_names_the_batch_size():
  c = tiny.get_config()
  c.train.update(batch_size=32, microbatches=3)
  with pytest.raises(
      ValueError, match=r"train.batch_size=32 does not split into "
      r"train.microbatches=3 microbatches .*; choose a multiple of 3$"):
    Experiment(c)


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "run").write_text("notes")
  cache = jax.config.jax_compilation_cache_dir
  with pytest.raises(ValueError, match=r"--workdir=.*run is a file; give a directory"):
    train.train_and_evaluate(tiny.get_config(), str(tmp_path / "run"))
  assert jax.config.jax_compilation_cache_dir == cache  # not left pointing into the file


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [(["--config=configs/nope.py"
      ], "cannot load --config: [Errno 2] No such file or directory: 'configs/nope.py'"),
     (["--config=configs/tiny.py", "--config.train.stpes=3"
      ], "no config field 'stpes' (from a --config.* override); "
      "Did you mean \"steps\" instead of \"stpes\"?"),
     (["--config=configs/tiny.py", "--config.train.steps=abc"], "--config.train.steps=abc: give an integer"),
     (["--config=configs/tiny.py", "--config.train.lr=fast"], "--config.train.lr=fast: give a number"),
     (["--config=configs/tiny.py", "--config.checkpoint.use_async=maybe"
      ], "--config.checkpoint.use_async=maybe: give true or false")])
def test_config_mistakes_are_one_line(tmp_path, args, message):
  result = subprocess.run([sys.executable, "-m", "lm.train", f"--workdir={tmp_path}", *args],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == f"train.py: {message}\n"


@pytest.mark.slow
def test_an_empty_workdir_is_refused_and_nothing_is_written(tmp_path):
  """`--workdir=` (a variable that was not set) used to train into the current directory."""
  config = os.path.abspath("configs/tiny.py")
  result = subprocess.run([sys.executable, "-m", "lm.train", f"--config={config}", "--workdir="],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert result.returncode == 1 and result.stderr == "train.py: --workdir is empty; give a directory\n"
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("code, error", [
    ("def get_config(:\n", "line 1: SyntaxError: invalid syntax"),
    ("def get_config():\n  raise ValueError('set DATA_DIR first')\n",
     "line 2: ValueError: set DATA_DIR first"),
    ("def get_config():\n  return stepz\n", "line 2: NameError: name 'stepz' is not defined"),
    ("import nosuchmodule\n", "line 1: ModuleNotFoundError: No module named 'nosuchmodule'"),
    ("from configs import tiny\n\ndef get_config():\n  c = tiny.get_config()\n  c.trian.steps = 3\n",
     "line 5: AttributeError: 'trian'; Did you mean \"train\" instead of \"trian\"?"),
])
def test_a_config_file_that_fails_to_run_is_one_line(tmp_path, code, error):
  """Whatever get_config (or the file's syntax) raises: the file, its line and the error, not a traceback."""
  config = tmp_path / "broken.py"
  config.write_text(code)
  result = subprocess.run([sys.executable, "-m", "lm.train", f"--workdir={tmp_path}", f"--config={config}"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == f"train.py: --config: {config}, {error}; correct the config file\n"


def test_initialisation_leaves_the_choice_of_kernel_to_the_run():
  """The model used to be initialised on 8 tokens, which the Pallas kernel (blocks of 128) refused
  whatever data.seq_len was."""
  c = tiny.get_config()
  c.model.attention_impl = "pallas"
  c.data.seq_len = 128
  assert Experiment(c).num_params > 0
  c.data.seq_len = 100
  with pytest.raises(ValueError, match="tiles sequences in blocks of 128, got lengths 100"):
    Experiment(c)


@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_an_explicit_tpu_kernel_on_cpu_names_the_field_and_the_choices(impl):
  """It stopped at the first step with only Pallas's own sentence."""
  c = tiny.get_config()
  c.model.attention_impl = impl
  with pytest.raises(ValueError) as e:
    Experiment(c).check_kernels_run_here()
  assert str(e.value) == (f"model.attention_impl={impl!r} runs on TPU only, and this run's devices are cpu; "
                          f"set --config.model.attention_impl to one of: auto, dot_product, blocked, "
                          f"reference")


def test_an_unknown_cross_entropy_impl_fails_when_the_experiment_is_built():
  c = tiny.get_config()
  c.train.cross_entropy_impl = "fast"
  with pytest.raises(ValueError, match="unknown train.cross_entropy_impl 'fast'; choose one of: auto, xla"):
    Experiment(c)


@pytest.mark.slow
def test_the_cpu_library_fusion_reaches_the_compiled_steps_and_changes_no_number():
  """configs/base.py hands element-wise work and reductions to YNNPACK on CPU: the train step compiled
  with it writes far fewer element-wise results in a transposed layout (XLA's `copy_bitcast` fusions,
  30% of a step's time with XLA's default on NanoDO's model), and the first step's loss and gradient
  norm match XLA's default; `""` restores the default."""
  batch = fixed_batch(64, 4, 16)
  got, copies = {}, {}
  for kinds in ("dot,eltwise,reduce", ""):
    c = tiny.get_config()
    c.model.update(V=64, D=32, H=4, L=2, F=64)
    c.data.seq_len, c.train.batch_size, c.cpu_library_fusion = 16, 4, kinds
    exp = Experiment(c)
    state = exp.init_state()
    hlo = exp._train_step.lower(state, exp.global_batch(batch)).compile().as_text()  # pylint: disable=protected-access
    copies[kinds] = hlo.count("copy_bitcast_fusion")
    _, stats = exp.train_step(state, exp.global_batch(batch))
    got[kinds] = (float(stats["loss"]), float(stats["grad_norm"]))
  np.testing.assert_allclose(got["dot,eltwise,reduce"], got[""], rtol=1e-5)
  assert copies["dot,eltwise,reduce"] < copies[""] / 2, copies
  assert Experiment(tiny.get_config()).compiler_options == {
      "xla_cpu_experimental_ynn_fusion_type":
          "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"
  }


@pytest.mark.slow
def test_cpu_devices_split_the_host_and_a_run_resumes_on_another_count(small_corpus, tmp_path):
  """config.cpu_devices makes the CPU that many devices, which the mesh's data axis takes; a run saved on
  2 resumes on 4, given by XLA_FLAGS, whose forced count wins over the config's, and with its state now
  split over the data axis (mesh.shard_state_over_data), then whole again; lm-latent's reader takes the
  parameters onto one device."""
  config = tmp_path / "config.py"
  config.write_text(f"from small import small_config\n\ndef get_config():\n"
                    f"  c = small_config({str(small_corpus)!r})\n  c.train.steps = 4\n  c.cpu_devices = 2\n"
                    f"  return c\n")
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
  env["XLA_FLAGS"] = FAST_CPU_COMPILE  # no forced device count
  cmd = [sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={tmp_path / 'run'}"]
  first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "1 process, 2 devices, mesh {'data': 2, 'fsdp': 1, 'tensor': 1}" in first.stdout
  env["XLA_FLAGS"] = xla_flags(4)
  again = subprocess.run([*cmd, "--config.train.steps=6", "--config.mesh.shard_state_over_data=True"],
                         capture_output=True, text=True, env=env, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "1 process, 4 devices, mesh {'data': 4, 'fsdp': 1, 'tensor': 1}" in again.stdout
  assert "resumed from the checkpoint at step 4" in again.stdout and "step 6/6 | loss" in again.stdout
  # The analysis tools read the parameters whole in this process (one device), saved on 4 in shards.
  config, params = checkpointing.load(str(tmp_path / "run"))
  assert config.cpu_devices == 2 and params["embed"].shape == (320, 32)
  # lm-sample on 4 devices restores the split state in its shards and decodes what one device does.
  decoded = subprocess.run([
      sys.executable, "-m", "eval.sample", f"--workdir={tmp_path / 'run'}", "--prompt=the quick brown",
      "--max_new_tokens=8", "--temperature=0"
  ], capture_output=True, text=True, env=env, timeout=300)
  assert decoded.returncode == 0, decoded.stderr[-3000:]
  one = eval_sample.sample(str(tmp_path / "run"), "the quick brown", max_new_tokens=8,
                           sampling=decode.Sampling(temperature=0))
  assert decoded.stdout == f"--- sample 0 ---\n{one[0]}\n"
  # And back: the split save resumes with the state whole on every device.
  whole = subprocess.run([*cmd, "--config.train.steps=8"], capture_output=True, text=True, env=env,
                         timeout=300)
  assert whole.returncode == 0, whole.stderr[-3000:]
  assert "resumed from the checkpoint at step 6" in whole.stdout and "step 8/8 | loss" in whole.stdout


def test_cpu_devices_leave_a_started_jax_as_it_is(monkeypatch, caplog):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  count = jax.device_count()  # starts JAX's backends, as any test before this one may have
  cli.use_cpu_devices(count + 1)
  assert jax.device_count() == count
  assert f"cpu_devices={count + 1} not applied: JAX has started already with {count} device(s)" in caplog.text


def test_the_cpu_library_fusion_is_cpu_only_and_checked():
  from lm.xla_options import cpu_compiler_options  # pylint: disable=import-outside-toplevel
  assert cpu_compiler_options("dot,eltwise,reduce", "tpu") is None
  assert cpu_compiler_options("", "cpu") is None
  assert cpu_compiler_options("dot", "cpu") == {
      "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"
  }
  c = tiny.get_config()
  c.cpu_library_fusion = "dot,matmul"
  with pytest.raises(
      ValueError, match=r'^unknown cpu_library_fusion kind\(s\) matmul; choose from dot, '
      r'eltwise, reduce, comma-separated, or "" for XLA\'s default$'):
    Experiment(c)


def test_a_gpu_kernel_on_cpu_is_refused_when_the_experiment_is_built():
  c = tiny.get_config()
  c.model.attention, c.model.attention_impl = "linear", "cudnn"
  with pytest.raises(ValueError, match="'cudnn' computes softmax attention only"):
    Experiment(c)
  c.model.attention, c.model.dtype = "softmax", "bfloat16"  # what cuDNN takes
  with pytest.raises(ValueError, match="attention impl 'cudnn' runs on GPU only, not cpu; use impl 'auto'"):
    Experiment(c)
