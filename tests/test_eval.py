"""lm-evaluate against a hand-computed loss (overall and by position in the context), lm-compare on uneven,
resumed, multi-seed and unevaluated runs."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import filesystems
import matplotlib
import numpy as np
import pytest
from small import small_config

from configs import tiny
from data_pipelines import pipeline, sources, storage
from eval import compare, evaluate
from lm import checkpointing, flops, model as model_lib, train
from lm.experiment import Experiment
from lm.runtime import metrics, run_log


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
  """A workdir with a checkpoint at step 6 of the small model."""
  workdir = tmp_path_factory.mktemp("run")
  c = small_config(small_corpus)
  c.train.update(steps=6, log_every_steps=3)
  c.eval.every_steps = 3
  train.train_and_evaluate(c, str(workdir))
  return workdir


def hand_nll(workdir) -> tuple[float, int, int, dict[int, list[float]]]:
  """(Σ nll over weighted targets, their count, padded positions seen, nlls by position bucket)
  with the model's own apply over the eval batches, summed in numpy."""
  config, params = checkpointing.load(str(workdir))
  model = model_lib.Transformer(model_lib.ModelConfig.from_dict(config.model.to_dict()))
  data = sources.resolve(config.data, config.model.V)
  total, count, padded, by_bucket = 0.0, 0, 0, {}
  for b in pipeline.eval_dataset(data.validation, data.tokenizer, seq_len=config.data.seq_len,
                                 batch_size=config.eval.batch_size, packing_bins=config.data.packing_bins):
    logits_btv = model.apply({"params": params}, b["inputs"], positions_bt=b["positions"],
                             segment_ids_bt=b["segment_ids"])
    logits_btv = np.asarray(logits_btv, np.float64)
    logp_btv = logits_btv - np.log(
        np.exp(logits_btv - logits_btv.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits_btv.max(
            -1, keepdims=True)
    nll_bt = -np.take_along_axis(logp_btv, b["targets"][..., None], -1)[..., 0]
    keep_bt = b["weights"] > 0
    total += nll_bt[keep_bt].sum()
    count += int(keep_bt.sum())
    padded += int((~keep_bt).sum())
    for position, nll in zip(b["positions"][keep_bt], nll_bt[keep_bt]):
      by_bucket.setdefault(int(position).bit_length(), []).append(nll)  # 0 | 1 | 2-3 | 4-7 | ...
  return total, count, padded, by_bucket


@pytest.mark.slow
def test_eval_matches_a_hand_computed_token_weighted_loss(trained):
  result = evaluate.evaluate(str(trained))
  total, count, padded, by_bucket = hand_nll(trained)
  assert padded > 0, "the eval set should end in a padded batch, or this test checks no padding"
  assert result["step"] == 6 and result["tokens"] == count
  assert result["loss"] == pytest.approx(total / count, rel=1e-5)
  assert result["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)
  assert result["attention"] == "softmax" and result["num_params"] > 0
  assert result["tokens_seen"] == 6 * 8 * 32
  positions = result["loss_by_position"]
  assert positions["first_position"] == [0, 1, 2, 4, 8, 16]  # seq_len 32
  assert positions["tokens"] == [len(by_bucket.get(k, [])) for k in range(6)]
  assert positions["loss"] == pytest.approx([np.mean(by_bucket[k]) for k in range(6)], rel=1e-5)
  assert positions["stderr"] == pytest.approx(
      [np.std(by_bucket[k], ddof=1) / np.sqrt(len(by_bucket[k])) for k in range(6)], rel=1e-4)
  assert result["loss_stderr"] == pytest.approx(
      np.std(np.concatenate(list(by_bucket.values())), ddof=1) / np.sqrt(count), rel=1e-4)
  evaluate.write(str(trained), result)
  assert json.loads((trained / "eval" / "step_6.json").read_text()) == result
  # The trainer's own final evaluation of the same checkpoint agrees.
  logged = run_log.read(trained)
  final = [l for l in logged if l["kind"] == "eval/validation" and l["step"] == 6][-1]
  assert final["loss"] == pytest.approx(result["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 24])
def test_padding_never_counts(trained, batch_size):
  """Other eval batch sizes pad a different number of rows: the metrics stay the same."""
  step, config = checkpointing.saved_config(str(trained))
  _, params = checkpointing.load(str(trained), step)
  reference = evaluate.evaluate(str(trained), step)
  config.eval.batch_size = batch_size
  exp = Experiment(config)
  result = exp.evaluate(params, exp.eval_sets()["validation"]())
  assert result["tokens"] == reference["tokens"]
  assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)


@pytest.mark.slow
def test_eval_without_a_checkpoint_names_the_problem(tmp_path):
  result = subprocess.run([sys.executable, "-m", "eval.evaluate", f"--workdir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert f"lm-evaluate: no checkpoint in {tmp_path}/checkpoints" in result.stderr
  assert "Traceback" not in result.stderr


def write_run(workdir, attention, evals, resumed_at=None):
  """A metrics log as lm-train writes it: evals maps step → perplexity, every step 100 tokens."""
  writer = metrics.Writer(str(workdir))
  writer.write(0, "run", {"attention": attention, "num_params": 1234, "tokens_per_step": 100})
  for step, ppl in evals.items():
    writer.write(step, "train", {"loss": 1.0, "tokens_per_sec": 50.0 * step, "tokens_seen": 100 * step})
    writer.write(
        step, "eval/validation", {
            "loss": float(np.log(ppl)),
            "perplexity": ppl,
            "bits_per_byte": 0.5,
            "tokens": 10,
            "tokens_seen": 100 * step
        })
  if resumed_at is not None:
    writer.write(resumed_at, "eval/validation", {
        "loss": 0.0,
        "perplexity": 1.0,
        "bits_per_byte": 0.1,
        "tokens": 10,
        "tokens_seen": 100 * resumed_at
    })
  writer.close()


def test_compare_runs_of_different_lengths(tmp_path):
  write_run(tmp_path / "a", "softmax", {10: 40.0, 20: 30.0, 30: 20.0}, resumed_at=30)
  write_run(tmp_path / "b", "hyla", {10: 50.0})
  out = tmp_path / "cmp.png"
  text = compare.compare([str(tmp_path / "a"), str(tmp_path / "b")], str(out), str(tmp_path / "t.md"))
  rows = text.splitlines()
  assert rows[0].startswith("| run | attention | parameters | tokens seen | training FLOPs | wall-clock")
  # A step logged again after a resume counts once, with its later value. No config.json: no FLOPs.
  assert rows[2] == "| a | softmax | 1,234 | 3,000 | n/a | 0 s | 0.0000 | 1.00 | 0.100 | 1,000 |"
  assert rows[3] == f"| b | hyla | 1,234 | 1,000 | n/a | 0 s | {np.log(50.0):.4f} | 50.00 | 0.500 | 500 |"
  assert (tmp_path / "t.md").read_text() == text
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  runs = [compare.read_run(str(tmp_path / d)) for d in "ab"]
  assert [len(r["evals"]) for r in runs] == [3, 1]


def test_compare_flops_wall_clock_and_seed_bands(tmp_path):
  """Two seeds per variant: one curve each with a band; FLOPs from each variant's own count; wall
  clock summed over a resume, without the time the run was down."""
  workdirs = []
  for attention in ("softmax", "hyla"):
    for seed in (0, 1):
      c = tiny.get_config()
      c.model.attention, c.seed = attention, seed
      evaluation = lambda step, t, ppl: {
          "step": step,
          "kind": "eval/validation",
          "time": t,
          "loss": float(np.log(ppl)),
          "perplexity": ppl,
          "tokens_seen": 4096 * step,
          "loss_by_position": {
              "first_position": [0, 1],
              "loss": [5.0, 4.0 + seed]
          }
      }
      start = lambda t: {
          "step": 0,
          "kind": "run",
          "time": t,
          "attention": attention,
          "num_params": 918_784,
          "tokens_per_step": 4096
      }
      workdir = tmp_path / f"{attention}{seed}"
      workdir.mkdir()
      (workdir / "config.json").write_text(c.to_json())
      records = [
          start(100.0),
          evaluation(10, 110.0, 50.0 + seed),
          start(1000.0),
          evaluation(20, 1030.0, 40.0 + 2 * seed)
      ]
      (workdir / "metrics").mkdir()
      (workdir / "metrics" / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
      workdirs.append(str(workdir))
  out = tmp_path / "cmp.png"
  text = compare.compare(workdirs, str(out))
  runs = [compare.read_run(w) for w in workdirs]
  per_token = {
      a:
          flops.flops_per_token(
              model_lib.ModelConfig.from_dict({
                  **tiny.get_config().model.to_dict(), "attention": a
              }), 918_784, 128) for a in ("softmax", "hyla")
  }
  assert per_token["hyla"] > per_token["softmax"]
  assert [r["flops_per_token"] for r in runs] == [per_token["softmax"]] * 2 + [per_token["hyla"]] * 2
  assert f"| softmax0 | softmax | 918,784 | 81,920 | {per_token['softmax'] * 81_920:.3g} | 40 s |" in text
  groups = compare.seed_groups(runs)
  assert {
      k: [r["run"] for r in v] for k, v in groups.items()
  } == {
      "softmax": ["softmax0", "softmax1"],
      "hyla": ["hyla0", "hyla1"]
  }
  for (name, x_of), want_x in zip(
      compare.AXES,
      ([40_960, 81_920], [40_960 * per_token["hyla"], 81_920 * per_token["hyla"]], [10.0, 40.0])):
    x, y, se = compare._band(groups["hyla"], x_of, lambda e: e["perplexity"])
    assert x == pytest.approx(want_x), name
    assert y == pytest.approx([50.5, 41.0]) and se == pytest.approx([0.5, 1.0])
  assert out.read_bytes()[:4] == b"\x89PNG" and compare.positions_path(str(out)).exists()


@pytest.mark.slow
def test_compare_names_a_run_without_evaluation(tmp_path):
  writer = metrics.Writer(str(tmp_path / "fresh"))
  writer.write(5, "train", {"loss": 3.0, "tokens_seen": 500})
  writer.close()
  write_run(tmp_path / "done", "softmax", {10: 40.0})
  cmd = [
      sys.executable, "-m", "eval.compare",
      str(tmp_path / "fresh"),
      str(tmp_path / "done"),
      str(tmp_path / "missing"), f"--out={tmp_path / 'x.png'}"
  ]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert (f"lm-compare: {tmp_path / 'fresh'} has no validation evaluation yet; train until the first "
          f"eval (eval.every_steps) or run `lm-evaluate --workdir={tmp_path / 'fresh'}`") in result.stderr
  assert f"{tmp_path / 'missing'} has no training log (metrics/*.jsonl)" in result.stderr
  assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_a_read_only_workdir_is_one_line_and_eval_prints_its_metrics_first(small_corpus, trained, tmp_path):
  """lm-evaluate computes the metrics, prints them, then fails to write them: the line names the file
  and why. lm-train on the same workdir stops before anything is computed."""
  with filesystems.read_only(tmp_path / "ro", trained) as workdir:
    result = subprocess.run([sys.executable, "-m", "eval.evaluate", f"--workdir={workdir}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    final = [r for r in run_log.read(trained) if r["kind"] == "eval/validation" and r["step"] == 6][-1]
    assert json.loads(result.stdout)["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert re.fullmatch(
        rf"lm-evaluate: the metrics are printed above but were not saved: (read-only file system|permission "
        rf"denied): cannot write {workdir}/eval\S* .*; (remount it read-write|make it writable by this user)\n",
        result.stderr), result.stderr
    config = tmp_path / "config.py"
    config.write_text(f"from small import small_config\n\ndef get_config():\n"
                      f"  return small_config({str(small_corpus)!r})\n")
    result = subprocess.run([sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={workdir}"],
                            capture_output=True, text=True, timeout=300, env={
                                **os.environ, "PYTHONPATH": os.path.dirname(__file__)
                            })
    assert result.returncode == 1
    assert re.fullmatch(
        rf"lm-train: cannot use {workdir} as a workdir \((Read-only file system|Permission "
        rf"denied)\); --workdir must name a directory this user can write, or one that "
        rf"can be created\n", result.stderr), result.stderr


def test_a_reader_never_sees_a_partial_result_file(tmp_path):
  """A reader during a rewrite of an evaluation's result sees the old file or the new one, whole."""
  path = evaluate.result_path(str(tmp_path), 6)
  old, new = "old\n" * 1000, "new\n" * 4_000_000
  storage.write_text(path, old)
  seen, done = set(), threading.Event()

  def read():
    while not done.is_set():
      seen.add(len(path.read_text()))

  reader = threading.Thread(target=read)
  reader.start()
  deadline = time.time() + 30
  while len(seen) < 2 and time.time() < deadline:  # until the reader has caught the new file
    storage.write_text(path, new)
    time.sleep(0.01)
    storage.write_text(path, old)
  done.set()
  reader.join()
  assert seen <= {len(old), len(new)} and len(seen) == 2, "a reader saw a partial file"


def test_compare_writes_into_a_directory_that_does_not_exist(tmp_path):
  write_run(tmp_path / "a", "softmax", {10: 40.0})
  out = tmp_path / "new" / "plots" / "cmp.png"
  compare.compare([str(tmp_path / "a")], str(out), str(tmp_path / "tables" / "t.md"))
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "tables" / "t.md").exists()


@pytest.mark.slow
def test_compare_out_below_a_file_is_one_line(tmp_path):
  """`--out=notes.txt/cmp.png`: the directory it needs is a file ('File exists' was all it said)."""
  write_run(tmp_path / "a", "softmax", {10: 40.0})
  (tmp_path / "notes.txt").write_text("a file")
  result = subprocess.run(
      [sys.executable, "-m", "eval.compare",
       str(tmp_path / "a"), f"--out={tmp_path}/notes.txt/cmp.png"], capture_output=True, text=True,
      timeout=120)
  assert result.returncode == 1
  assert re.fullmatch(
      rf"lm-compare: not a directory: cannot write {tmp_path}/notes.txt/cmp.png \(on the file system "
      r"mounted at \S+, [\d.]+ MB free\); a file stands where its path needs a directory: move the file "
      r"or choose another path\n", result.stderr), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("module, args, message", [
    ("eval.evaluate", [], "lm-evaluate: no checkpoint in {w}/checkpoints: {w} is a file; --workdir must "
     "name the directory that lm-train --workdir wrote"),
    ("eval.sample", ["--prompt=hi"], "lm-sample: no checkpoint in {w}/checkpoints: {w} is a file; "
     "--workdir must name the directory that lm-train --workdir wrote"),
    ("eval.latent", [], "lm-latent: no checkpoint in {w}/checkpoints: {w} is a file; --workdir must "
     "name the directory that lm-train --workdir wrote"),
    ("eval.compare", ["--out={tmp}/c.png"], "lm-compare: {w} is a file, not a training workdir; give the "
     "directory that lm-train --workdir wrote"),
])
def test_a_workdir_that_is_a_file_is_named_by_the_reading_tools(tmp_path, module, args, message):
  """A careless `--workdir=notes.txt` (or lm-compare notes.txt): one line saying it is a file."""
  workdir = tmp_path / "notes.txt"
  workdir.write_text("not a run")
  flag = [str(workdir)] if module == "eval.compare" else [f"--workdir={workdir}"]
  result = subprocess.run([sys.executable, "-m", module, *flag, *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr == message.format(w=workdir) + "\n"


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_line_naming_the_step_and_the_fix(trained, tmp_path):
  """lm-evaluate (lm-sample and lm-latent read it the same way) printed TensorStore's whole error."""
  workdir = tmp_path / "run"
  shutil.copytree(trained, workdir)
  for f in (workdir / "checkpoints" / "6" / "state").rglob("*"):
    if f.is_file() and f.parent.name == "d":
      f.write_bytes(f.read_bytes()[:10])
  result = subprocess.run([sys.executable, "-m", "eval.evaluate", f"--workdir={workdir}"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
  assert re.fullmatch(
      rf"lm-evaluate: the checkpoint at step 6 \({workdir}/checkpoints/6\) cannot be read: .{{10,300}}; "
      r"lm-train with --config.checkpoint.skip_damaged=true sets damaged steps aside and resumes from "
      r"the newest intact one\n", result.stderr), result.stderr


def test_curves_promise_error_bars_only_where_seeds_give_them(tmp_path):
  """The y label names the standard error over seeds only when some line has more than one seed."""
  runs = []
  for seed in (0, 1):
    write_run(tmp_path / str(seed), "softmax", {10: 40.0 + seed})
    runs.append(compare.read_run(str(tmp_path / str(seed))))
  labels = {}
  with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, not paths
    labels["one run"] = _plot_text(runs[:1], tmp_path / "one.svg")
    for seed, r in enumerate(runs):  # the same config but for the seed: one line of two seeds
      r["config"] = {"seed": seed}
    labels["two seeds"] = _plot_text(runs, tmp_path / "two.svg")
  assert ["over seeds" in labels[k] for k in ("one run", "two seeds")] == [False, True]
  assert "validation perplexity" in labels["one run"]


def _plot_text(runs, out) -> str:
  compare.plot(runs, str(out))
  return out.read_text()


@pytest.mark.parametrize("impl", ["pallas", "splash"])
def test_a_run_saved_with_a_tpu_kernel_names_the_flag_and_the_choices_here(trained, monkeypatch, impl):
  """lm-evaluate and lm-sample of a run trained with an explicit TPU kernel, on CPU: one line naming the
  field and the kernels that run here (it was Pallas's own sentence); --attention_impl reads it here."""
  from eval import sample
  step, config = checkpointing.saved_config(str(trained))
  config.model.attention_impl = impl
  saved = {"config": config}
  monkeypatch.setattr(checkpointing, "saved_config", lambda workdir, step=None:
                      (step or 6, saved["config"].copy_and_resolve_references()))
  tiling = config.copy_and_resolve_references()
  tiling.data.seq_len = 128  # a length the kernel tiles, as a TPU run's
  saved["config"] = tiling
  message = (f"model.attention_impl={impl!r} runs on TPU only, and this run's devices are cpu; set "
             f"--attention_impl to one of: auto, dot_product, blocked, reference")
  with pytest.raises(ValueError) as e:
    evaluate.evaluate(str(trained))
  assert str(e.value) == message
  with pytest.raises(ValueError) as e:
    sample.sample(str(trained), "a", sampling=sample.decode.Sampling(0.0, 0, 1.0), max_new_tokens=2)
  assert str(e.value) == message
  saved["config"] = config
  assert evaluate.evaluate(str(trained), attention_impl="auto")["step"] == step
  assert len(
      sample.sample(str(trained), "a", sampling=sample.decode.Sampling(0.0, 0, 1.0), max_new_tokens=2,
                    attention_impl="auto")) == 1


@pytest.mark.slow
def test_harness_throughput_benchmark_times_both_passes_over_what_it_scored(trained, tmp_path):
  """benchmarks/harness_throughput.py on a trained run: its counts are those of the requests it made,
  packed as lm-harness packs them, and both passes were timed."""
  out = tmp_path / "throughput.json"
  result = subprocess.run([
      sys.executable, "benchmarks/harness_throughput.py", f"--workdir={trained}", "--requests=16",
      "--batch_size=4", "--repeats=1", f"--json={out}"
  ], capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)), env={
      **os.environ, "JAX_PLATFORMS": "cpu"
  })
  assert result.returncode == 0, result.stderr[-3000:]
  r = json.loads(out.read_text())
  assert (r["step"], r["requests"], r["batch_size"]) == (6, 16, 4)
  assert r["fed_tokens"] == -(-r["packed_rows"] // 4) * 4 * 32 and 16 <= r["scored_tokens"] <= 16 * 16
  assert r["evaluate_tokens"] == evaluate.evaluate(str(trained))["tokens"]
  assert r["harness_seconds"]["min"] > 0 and r["evaluate_seconds"]["min"] > 0
  assert "fed / lm-evaluate" in result.stdout
