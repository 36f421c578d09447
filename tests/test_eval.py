"""lm-eval against a hand-computed loss, lm-compare on uneven and unevaluated runs, lm-sweep end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_pipelines import pipeline, sources
from eval import compare, evaluate
from lm import checkpointing, metrics, model as model_lib, train
from lm.experiment import Experiment
from small import small_config

SWEEP_CONFIG = """
from small import small_config


def get_config():
  c = small_config({corpus!r})
  c.train.update(steps=4, log_every_steps=2)
  c.eval.every_steps = 2
  return c
"""


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
  """A workdir with a checkpoint at step 6 of the small model."""
  workdir = tmp_path_factory.mktemp("run")
  c = small_config(small_corpus)
  c.train.update(steps=6, log_every_steps=3)
  c.eval.every_steps = 3
  train.train_and_evaluate(c, str(workdir))
  return workdir


def hand_nll(workdir) -> tuple[float, int, int]:
  """(Σ nll over weighted targets, their count, padded positions seen) with the model's own apply
  over the eval batches, summed in numpy."""
  config, params = checkpointing.load(str(workdir))
  model = model_lib.Transformer(model_lib.ModelConfig.from_dict(config.model.to_dict()))
  data = sources.resolve(config.data, config.model.V)
  total, count, padded = 0.0, 0, 0
  for b in pipeline.eval_dataset(data.validation, data.tokenizer, seq_len=config.data.seq_len,
                                 batch_size=config.eval.batch_size,
                                 packing_bins=config.data.packing_bins):
    logits_btv = model.apply({"params": params}, b["inputs"], positions_bt=b["positions"],
                             segment_ids_bt=b["segment_ids"])
    logits_btv = np.asarray(logits_btv, np.float64)
    logp_btv = logits_btv - np.log(np.exp(logits_btv - logits_btv.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits_btv.max(-1, keepdims=True)
    nll_bt = -np.take_along_axis(logp_btv, b["targets"][..., None], -1)[..., 0]
    keep_bt = b["weights"] > 0
    total += nll_bt[keep_bt].sum()
    count += int(keep_bt.sum())
    padded += int((~keep_bt).sum())
  return total, count, padded


def test_eval_matches_a_hand_computed_token_weighted_loss(trained):
  result = evaluate.evaluate(str(trained))
  total, count, padded = hand_nll(trained)
  assert padded > 0, "the eval set should end in a padded batch, or this test checks no padding"
  assert result["step"] == 6 and result["tokens"] == count
  assert result["loss"] == pytest.approx(total / count, rel=1e-5)
  assert result["perplexity"] == pytest.approx(np.exp(total / count), rel=1e-5)
  assert result["attention"] == "softmax" and result["num_params"] > 0
  assert result["tokens_seen"] == 6 * 8 * 32
  assert json.loads((trained / "eval" / "step_6.json").read_text()) == result
  # The trainer's own final evaluation of the same checkpoint agrees.
  logged = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
  final = [l for l in logged if l["kind"] == "eval/validation" and l["step"] == 6][-1]
  assert final["loss"] == pytest.approx(result["loss"], rel=1e-6)


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


def test_eval_without_a_checkpoint_names_the_problem(tmp_path):
  result = subprocess.run([sys.executable, "-m", "eval.evaluate", f"--workdir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert f"lm-eval: no checkpoint in {tmp_path}/checkpoints" in result.stderr
  assert "Traceback" not in result.stderr


def write_run(workdir, attention, evals, resumed_at=None):
  """A metrics log as lm-train writes it: evals maps step → perplexity, every step 100 tokens."""
  writer = metrics.Writer(str(workdir))
  writer.write(0, "run", {"attention": attention, "num_params": 1234, "tokens_per_step": 100})
  for step, ppl in evals.items():
    writer.write(step, "train", {"loss": 1.0, "tokens_per_sec": 50.0 * step, "tokens_seen": 100 * step})
    writer.write(step, "eval/validation", {"loss": float(np.log(ppl)), "perplexity": ppl,
                                           "bits_per_byte": 0.5, "tokens": 10, "tokens_seen": 100 * step})
  if resumed_at is not None:
    writer.write(resumed_at, "eval/validation", {"loss": 0.0, "perplexity": 1.0, "bits_per_byte": 0.1,
                                                 "tokens": 10, "tokens_seen": 100 * resumed_at})


def test_compare_runs_of_different_lengths(tmp_path):
  write_run(tmp_path / "a", "softmax", {10: 40.0, 20: 30.0, 30: 20.0}, resumed_at=30)
  write_run(tmp_path / "b", "hyla", {10: 50.0})
  out = tmp_path / "cmp.png"
  text = compare.compare([str(tmp_path / "a"), str(tmp_path / "b")], str(out), str(tmp_path / "t.md"))
  rows = text.splitlines()
  assert rows[0].startswith("| run | attention | parameters | tokens seen | validation loss")
  # A step logged again after a resume counts once, with its later value.
  assert rows[2] == "| a | softmax | 1,234 | 3,000 | 0.0000 | 1.00 | 0.100 | 1,000 |"
  assert rows[3] == f"| b | hyla | 1,234 | 1,000 | {np.log(50.0):.4f} | 50.00 | 0.500 | 500 |"
  assert (tmp_path / "t.md").read_text() == text
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  runs = [compare.read_run(str(tmp_path / d)) for d in "ab"]
  assert [len(r["evals"]) for r in runs] == [3, 1]


def test_compare_names_a_run_without_evaluation(tmp_path):
  writer = metrics.Writer(str(tmp_path / "fresh"))
  writer.write(5, "train", {"loss": 3.0, "tokens_seen": 500})
  write_run(tmp_path / "done", "softmax", {10: 40.0})
  cmd = [sys.executable, "-m", "eval.compare", str(tmp_path / "fresh"), str(tmp_path / "done"),
         str(tmp_path / "missing"), f"--out={tmp_path / 'x.png'}"]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert (f"lm-compare: {tmp_path / 'fresh'} has no validation evaluation yet; train until the first "
          f"eval (eval.every_steps) or run `lm-eval --workdir={tmp_path / 'fresh'}`") in result.stderr
  assert f"{tmp_path / 'missing'} has no metrics.jsonl" in result.stderr
  assert not (tmp_path / "x.png").exists()


def test_tiny_sweep_end_to_end_and_resumed(small_corpus, tmp_path):
  config = tmp_path / "sweep_config.py"
  config.write_text(SWEEP_CONFIG.format(corpus=str(small_corpus)))
  root = tmp_path / "sweep"
  cmd = [sys.executable, "-m", "eval.sweep", f"--config={config}", "--attentions=softmax,hyla",
         f"--root={root}", "--config.model.D=48"]
  env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}  # the config imports tests/small.py
  first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert first.returncode == 0, first.stderr[-3000:]
  for name in ("softmax", "hyla"):
    result = json.loads((root / name / "eval" / "step_4.json").read_text())
    assert result["attention"] == name and np.isfinite(result["perplexity"])
    assert json.loads((root / name / "config.json").read_text())["model"]["D"] == 48
  configs = [json.loads((root / n / "config.json").read_text()) for n in ("softmax", "hyla")]
  assert [c["model"].pop("attention") for c in configs] == ["softmax", "hyla"]
  assert configs[0] == configs[1], "same seed, data order and schedule: only the attention differs"
  table = (root / "compare.md").read_text()
  assert "| softmax | softmax |" in table and "| hyla | hyla |" in table
  assert (root / "compare.png").exists()
  log_before = (root / "hyla" / "metrics.jsonl").read_text()
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "sweep: hyla is done (step 4 evaluated); not retraining" in again.stdout
  assert (root / "hyla" / "metrics.jsonl").read_text() == log_before
