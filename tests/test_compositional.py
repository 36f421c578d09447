"""SRAVEN and fuzzy-logic tasks in the trainer: losses and metrics by hand, batches, the configs with
every attention preset (single-head too), and tiny end-to-end runs with the latent-code probe (the
ablation grid: tests/test_grid.py)."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small import tiny_compositional as tiny

from configs import fuzzy_logic as fuzzy_config, sraven as sraven_config
from data_pipelines import pipeline, sraven
from eval import latent
from lm import tasks, tasks_compositional as tc, train
from lm.experiment import Experiment


def test_sraven_sums_match_hand_computation():
  logits_bfv = np.full((2, 4, 8), -5.0, np.float32)
  targets_bf = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
  logits_bfv[0, np.arange(4), targets_bf[0]] = 5.0  # instance 0: all four right
  logits_bfv[1, np.arange(4), [4, 5, 6, 0]] = 5.0  # instance 1: three of four right
  sums = {k: float(v) for k, v in tc.sraven_sums(jnp.asarray(logits_bfv), jnp.asarray(targets_bf)).items()}
  right = -math.log(math.exp(5) / (math.exp(5) + 7 * math.exp(-5)))
  wrong = -math.log(math.exp(-5) / (math.exp(5) + 7 * math.exp(-5)))
  assert sums["examples"] == 2 and sums["correct"] == 1 and sums["features_correct"] == pytest.approx(1.75)
  assert sums["nll"] == pytest.approx(right + (3 * right + wrong) / 4, rel=1e-5)
  task = tasks.TASKS["sraven"](tiny(sraven_config), 8)
  metrics = task.summarize(sums)
  assert metrics["accuracy"] == 0.5 and metrics["feature_accuracy"] == 0.875
  assert metrics["accuracy_stderr"] == pytest.approx(math.sqrt(0.25 / 2))


def test_fuzzy_sums_match_hand_computation():
  pred, target, var = np.array([0.5, 0.2, 0.9]), np.array([0.4, 0.2, 0.6]), np.array([0.01, 0.04, 0.09])
  sums = {k: float(v) for k, v in tc.fuzzy_sums(*map(jnp.asarray, (pred, target, var))).items()}
  r2 = [1 - 0.01 / 0.01, 1.0, 1 - 0.09 / 0.09]
  assert sums["sq_err"] == pytest.approx(0.1, rel=1e-5) and sums["r2"] == pytest.approx(sum(r2), abs=1e-5)
  metrics = tasks.TASKS["fuzzy_logic"](tiny(fuzzy_config), 1).summarize(sums)
  assert metrics["r2"] == pytest.approx(np.mean(r2), abs=1e-5)
  assert metrics["r2_stderr"] == pytest.approx(np.std(r2, ddof=1) / math.sqrt(3), abs=1e-5)
  assert metrics["mse"] == pytest.approx(0.1 / 3, rel=1e-5)


def test_sraven_batches_are_a_function_of_seed_and_step_and_resume():
  task = tasks.TASKS["sraven"](tiny(sraven_config), 8)
  it = task.train_iterator(pipeline.Shard(1, 2), 4)
  first = next(it)
  assert first["inputs"].shape == (4, 36, 8) and first["targets"].shape == (4, 4)
  assert np.all(first["inputs"][:, -4:] == 0) and np.all(first["inputs"][:, :32].sum(-1) == 1)
  # Shard 1 of 2 takes generator steps 1, 3, 5, ...
  np.testing.assert_array_equal(first["inputs"], sraven.sample_batch(0, 1, 4)["inputs_btv"])
  state = it.get_state()
  second = next(it)
  again = task.train_iterator(pipeline.Shard(1, 2), 4)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["targets"], second["targets"])
  test, ood = (next(task.eval_sets(pipeline.Shard(), 4)[s]()) for s in ("test", "ood"))
  assert not np.array_equal(test["inputs"], ood["inputs"])


def test_fuzzy_batches_and_eval_sets():
  task = tasks.TASKS["fuzzy_logic"](tiny(fuzzy_config), 1)
  batch = next(task.train_iterator(pipeline.Shard(), 3))
  assert batch["inputs"].shape == (3, 32, 5) and np.all(batch["inputs"][:, -1, -1] == 0)
  assert set(task.eval_sets(pipeline.Shard(), 3)) == {"test", "ood", "unknown"}


def test_wrong_model_for_the_task_names_the_fix():
  c = tiny(sraven_config)
  c.model.input_dim = 0
  with pytest.raises(ValueError, match="SRAVEN needs model.V=8 and model.input_dim=8"):
    tasks.build(c, 8)


# Every preset's math is covered by tests/test_train.py; here the paper's three, single-head, on SRAVEN.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "linear", "hyla"])
def test_single_head_models_train_on_sraven(name):
  exp = Experiment(tiny(sraven_config, attention=name, H=1))
  it = exp.task.train_iterator(pipeline.Shard(), 8)
  state = exp.init_state()
  losses = []
  for _ in range(2):
    state, stats = exp.train_step(state, exp.global_batch(next(it)))
    losses.append(float(stats["loss"]))
  assert np.all(np.isfinite(losses)), losses


@pytest.mark.slow
def test_microbatches_with_attention_dropout_train_what_one_batch_does():
  """configs/sraven.py splits its batch in parts for the CPU's caches: with attention dropout (one mask
  per step, shared over the batch) the parts must give the same step as the whole batch."""
  runs = {}
  for k, rate in ((1, 0.3), (4, 0.3), (1, 0.0)):
    c = tiny(sraven_config, attention="hyla", attention_dropout=rate)
    c.train.microbatches = k
    exp = Experiment(c)
    it = exp.task.train_iterator(pipeline.Shard(), 8)
    state = exp.init_state()
    for _ in range(2):
      state, stats = exp.train_step(state, exp.global_batch(next(it)))
    runs[k, rate] = (float(stats["loss"]), state.params)
  assert runs[4, 0.3][0] == pytest.approx(runs[1, 0.3][0], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), runs[4, 0.3][1],
               runs[1, 0.3][1])
  assert runs[1, 0.0][0] != pytest.approx(runs[1, 0.3][0], rel=1e-3)  # the dropout is there to share


@pytest.mark.slow
def test_sraven_end_to_end_with_latent_codes(tmp_path):
  final = train.train_and_evaluate(tiny(sraven_config, attention="hyla"), str(tmp_path))
  assert set(final) == {"test", "ood"} and final["ood"]["examples"] == 32  # eval.final_batches
  assert 0 <= final["ood"]["accuracy"] <= final["ood"]["feature_accuracy"] <= 1
  result = latent.analyse(str(tmp_path), examples=64, paper_examples=96)
  for protocol in (result, result["paper_code"]):
    assert len(protocol["ood_decoding_accuracy_per_layer"]) == 2
    assert all(0 <= a <= 1 for a in protocol["ood_decoding_accuracy_per_layer"])
  assert result["paper_code"]["examples_per_split"] == 96
  assert json.loads((tmp_path / "latent.json").read_text()) == result
  assert (tmp_path / "latent_embedding.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_lm_latent_on_a_language_model_run_is_a_clear_error(tmp_path):
  cmd = [sys.executable, "-m", "eval.latent", f"--workdir={tmp_path}"]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0 and "lm-latent: no checkpoint" in result.stderr
  assert "Traceback" not in result.stderr


def test_ridge_r2_of_the_paper_code_protocol():
  rng = np.random.default_rng(0)
  x_nf = rng.normal(size=(400, 6))
  y_nt = np.stack([x_nf @ rng.normal(size=6), rng.normal(size=400)], axis=1)
  # Target 0 is linear in x (R² near 1), target 1 is noise (R² near 0 or below): the mean of the two.
  assert latent.ridge_r2(x_nf, y_nt) == pytest.approx(0.5, abs=0.03)


@pytest.mark.slow
def test_fuzzy_paper_code_protocol_uses_one_query_point_and_all_layers():
  c = tiny(fuzzy_config)
  exp = Experiment(c)
  codes = latent.codes_fn(c, exp.init_state().params)
  x_lnh, terms_nk = latent.fuzzy_codes(c, codes, "train", 32, fixed_query=True)
  assert x_lnh.shape == (2, 32, 4) and terms_nk.shape == (32, 2)
  # One query point for all sequences, different contexts: the self-codes still vary.
  assert np.ptp(x_lnh, axis=1).max() > 0
  result = latent.paper_code_protocol(c, codes, 64)
  assert result["examples"] == 64 and result["term_bits_r2"] <= 1


@pytest.mark.parametrize("flag", ["--examples=0", "--examples=-3", "--paper_examples=0", "--examples=1"])
def test_lm_latent_counts_below_two_are_one_line(tmp_path, flag):
  """--examples=0 was a traceback; the decoders need two instances at least."""
  cmd = [sys.executable, "-m", "eval.latent", f"--workdir={tmp_path}", flag]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and result.stderr.strip() == (
      f"lm-latent: {flag}: give 2 or more instances (the decoders are fitted on them)"), result.stderr


def test_too_few_instances_to_fit_the_decoders_name_the_flag():
  x_lnf, y_n = np.zeros((1, 3, 4)), np.zeros(3, int)  # one class only: logistic regression cannot fit
  with pytest.raises(
      ValueError, match=r"^--examples=3 instances are too few to fit the decoders \(.*\); "
      r"give more \(default 2048\)$"):
    latent.fitted(latent.decode_rules, x_lnf[0], y_n, x_lnf[0], y_n, flag="--examples=3")
