"""The training loop end to end on a generated corpus, and every attention preset taking steps."""

import json
import subprocess
import sys

import numpy as np
import pytest

from data_pipelines import pipeline, sources
from lm import attention, train
from lm.experiment import Experiment
from small import small_config


def test_training_lowers_validation_loss_and_logs(small_corpus, tmp_path, capsys):
  c = small_config(small_corpus)
  final = train.train_and_evaluate(c, str(tmp_path))
  out = capsys.readouterr().out
  assert "step 40/40 | loss" in out and "tok/s | MFU " in out and "% | ETA" in out
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
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


def test_bad_attention_name_stops_before_training(tmp_path):
  cmd = [sys.executable, "-m", "lm.train", "--config=configs/tiny.py", f"--workdir={tmp_path}",
         "--config.model.attention=hyla2"]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "lm-train: unknown attention 'hyla2'; choose one of: softmax, linear, hyla" in result.stderr
  assert "Traceback" not in result.stderr
