"""task=mqar: the generator's rows (pairs, one query per key, power-law gaps, filler), the fixed test
set from its own seed, metrics and loss counted at the queries only, resumable and host-sharded
training batches, and training through lm-train."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small import COMPILATION_CACHE, xla_flags

from configs import mqar as mqar_config
from data_pipelines import mqar, pipeline
from eval import compare
from lm import cross_entropy, tasks, train

SETTINGS = dict(vocab_size=64, seq_len=32, num_kv_pairs=4, power_a=0.01)


def tiny(**model):
  c = mqar_config.get_config()
  c.data.update(vocab_size=64, seq_len=32, num_kv_pairs=4, train_examples=64, test_examples=20)
  c.model.update(**{"D": 16, "H": 2, **model})
  c.train.update(steps=6, batch_size=8, warmup_steps=1, log_every_steps=2)
  c.eval.update(every_steps=3, batch_size=8)
  c.checkpoint.update(every_steps=3, use_async=False)
  c.compilation_cache = COMPILATION_CACHE
  return c


def test_a_row_opens_with_the_pairs_and_asks_every_key_once():
  V, n = SETTINGS["vocab_size"], SETTINGS["num_kv_pairs"]
  b = mqar.sample_batch(0, range(200), **SETTINGS)
  for inputs_t, query_n, targets_n, distances_n in zip(b["inputs_bt"], b["query_positions_bn"],
                                                       b["targets_bn"], b["distances_bn"]):
    keys_n, values_n = inputs_t[0:2 * n:2], inputs_t[1:2 * n:2]
    assert ((1 <= keys_n) & (keys_n < V // 2)).all() and ((V // 2 <= values_n) & (values_n < V)).all()
    assert len(set(keys_n)) == len(set(values_n)) == n
    # Each key once more, after the pairs, at an even offset; its target is its value.
    assert (query_n >= 2 * n).all() and (query_n % 2 == 0).all() and len(set(query_n)) == n
    np.testing.assert_array_equal(inputs_t[query_n], keys_n)
    np.testing.assert_array_equal(targets_n, values_n)
    np.testing.assert_array_equal(distances_n, query_n - 2 * np.arange(n))
    rest = np.delete(np.arange(2 * n, len(inputs_t)), query_n - 2 * n)
    assert (inputs_t[rest] == 0).all()  # filler
  filled = mqar.sample_batch(0, range(20), **SETTINGS, random_filler=True)["inputs_bt"]
  assert len(np.unique(filled[:, 2 * n:])) > n + 1


def test_query_gaps_follow_the_power_law():
  one = dict(SETTINGS, num_kv_pairs=1)
  slots = (one["seq_len"] - 2) // 2
  for power_a in (0.01, 1.0):
    gaps = (mqar.sample_batch(0, range(3000), **dict(one, power_a=power_a))["query_positions_bn"][:, 0] -
            2) // 2
    counts = np.bincount(gaps, minlength=slots) / len(gaps)
    np.testing.assert_allclose(counts, mqar.gap_probabilities(slots, power_a), atol=0.03)
  assert mqar.gap_probabilities(slots, 0.01)[0] > 10 * mqar.gap_probabilities(slots, 0.01)[-1]


@pytest.mark.parametrize("bad,message", [(dict(num_kv_pairs=9), "num_kv_pairs <= data.seq_len / 4"),
                                         (dict(seq_len=33, num_kv_pairs=2), "must be even"),
                                         (dict(vocab_size=8), "fewer than data.num_kv_pairs"),
                                         (dict(power_a=0.0), "power_a must be > 0")])
def test_settings_that_make_no_row_name_the_fix(bad, message):
  with pytest.raises(ValueError, match=message):
    mqar.check(**{**SETTINGS, **bad})


def test_the_test_set_is_fixed_and_drawn_from_another_seed():
  c = tiny()
  task = tasks.build(c, 64)
  test = list(task.eval_sets(pipeline.Shard(), 8)["test"]())
  assert [len(b["inputs"]) for b in test] == [8, 8, 8] and sum(b["weights"][:, 0].sum() for b in test) == 20
  again = list(task.eval_sets(pipeline.Shard(), 8)["test"]())
  np.testing.assert_array_equal(test[0]["inputs"], again[0]["inputs"])
  rows = np.concatenate([b["inputs"] for b in test])[:20]
  np.testing.assert_array_equal(rows, mqar.sample_batch(c.data.test_seed, range(20), **SETTINGS)["inputs_bt"])
  train_rows = mqar.sample_batch(c.data.train_seed, range(c.data.train_examples), **SETTINGS)["inputs_bt"]
  assert not {r.tobytes() for r in rows} & {r.tobytes() for r in train_rows}
  # Two processes' shares of the test set: disjoint, together the whole set.
  halves = [
      np.concatenate(
          [b["inputs"][b["weights"][:, 0] > 0]
           for b in task.eval_sets(pipeline.Shard(j, 2), 8)["test"]()])
      for j in range(2)
  ]
  assert sorted(r.tobytes() for r in np.concatenate(halves)) == sorted(r.tobytes() for r in rows)
  c.data.test_seed = c.data.train_seed
  with pytest.raises(ValueError, match="the test set must come from another seed"):
    tasks.build(c, 64)
  with pytest.raises(ValueError, match="MQAR needs model.V = data.vocab_size"):
    tasks.build(tiny(), 65)


def _batch_and_logits(right_at_queries: bool, right_elsewhere: bool):
  task = tasks.build(tiny(), 64)
  batch = task.batch(0, np.arange(4), real=3)
  B, T, V = 4, 32, 64
  next_bt = np.roll(batch["inputs"], -1, axis=1)  # any other target: the next input token
  wanted_bt = np.where(right_elsewhere, next_bt, (next_bt + 1) % V)
  at_queries = np.zeros((B, T), bool)
  np.put_along_axis(at_queries, batch["query_positions"], True, axis=1)
  right_bt = np.zeros((B, T), np.int64)
  np.put_along_axis(right_bt, batch["query_positions"], batch["targets"], axis=1)
  wrong_bt = (right_bt + 1) % V
  wanted_bt = np.where(at_queries, right_bt if right_at_queries else wrong_bt, wanted_bt)
  wanted_bt[3] = (wanted_bt[3] + 7) % V  # the padding row is wrong everywhere and must not count
  logits_btv = jax.nn.one_hot(wanted_bt, V) * 10.0
  return task, {k: jnp.asarray(v) for k, v in batch.items()}, logits_btv


@pytest.mark.parametrize("right_at_queries", [True, False])
def test_accuracy_is_counted_at_the_queries_only(right_at_queries):
  task, batch, logits_btv = _batch_and_logits(right_at_queries, right_elsewhere=not right_at_queries)
  sums = jax.device_get(task.eval_sums(logits_btv, batch))
  result = task.summarize(sums)
  assert result["accuracy"] == (1.0 if right_at_queries else 0.0) and result["queries"] == 3 * 4
  by_distance = result["accuracy_by_distance"]
  assert sum(by_distance["queries"]) == 12 and by_distance["first_distance"] == tasks.position_buckets(32)
  assert all(a == result["accuracy"] for a in by_distance["accuracy"] if a is not None)


def test_the_loss_reads_the_readout_at_the_queries_only():
  task, batch, _ = _batch_and_logits(True, False)
  ks = jax.random.split(jax.random.key(0))
  x_btd, w_dv = jax.random.normal(ks[0], (4, 32, 8)), jax.random.normal(ks[1], (8, 64))
  mean, count = task.loss(cross_entropy.Readout(x_btd, w_dv, 0.5), batch)
  logits_bnv = jnp.take_along_axis(x_btd @ w_dv * 0.5, batch["query_positions"][..., None], axis=1)
  expected = (cross_entropy.token_nll(logits_bnv, batch["targets"]) * batch["weights"]).sum() / 12
  assert count == 12
  np.testing.assert_allclose(mean, expected, rtol=1e-5)


def test_training_batches_resume_exactly_and_shards_split_the_stream():
  task = tasks.build(tiny(), 64)
  it = task.train_iterator(pipeline.Shard(), 8)
  batches = [next(it) for _ in range(12)]  # 96 examples: past the end of the first epoch of 64
  resumed = task.train_iterator(pipeline.Shard(), 8)
  first = task.train_iterator(pipeline.Shard(), 8)
  for _ in range(5):
    next(first)
  resumed.set_state(json.loads(json.dumps(first.get_state())))
  for b in batches[5:]:
    np.testing.assert_array_equal(next(resumed)["inputs"], b["inputs"])
  # An epoch is every training example once, in an order the run's seed shuffles.
  epoch = np.concatenate([b["inputs"] for b in batches[:8]])
  assert len({r.tobytes() for r in epoch}) == 64
  shards = [task.train_iterator(pipeline.Shard(j, 2), 4) for j in range(2)]
  halves = np.concatenate([next(s)["inputs"] for s in shards])
  assert {r.tobytes() for r in halves} == {r.tobytes() for r in batches[0]["inputs"]}


@pytest.mark.slow
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path):
  """A run that lost its last checkpoint resumes from step 3 (model, optimiser and data iterator) and
  ends where the uninterrupted run ended."""
  c = tiny(attention="softmax,gla")
  whole = train.train_and_evaluate(c, str(tmp_path / "whole"))
  shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "6")
  resumed = train.train_and_evaluate(c, str(tmp_path / "resumed"))
  for key in ("loss", "accuracy"):
    assert resumed["test"][key] == pytest.approx(whole["test"][key], rel=1e-6)
  assert resumed["test"]["queries"] == 20 * 4


@pytest.mark.slow
def test_every_main_variant_trains_through_lm_train(tmp_path):
  c = tiny(attention="softmax,linear,hyla,gla", L=4)
  args = [
      f"--config.{k}={v}" for k, v in (("data.vocab_size", 64), ("data.seq_len", 32),
                                       ("data.num_kv_pairs", 4), ("data.train_examples", 64),
                                       ("data.test_examples", 20), ("model.D", 16), ("model.H", 2),
                                       ("model.L", 4), ("model.attention", c.model.attention),
                                       ("train.steps", 4), ("train.batch_size", 8), ("train.warmup_steps", 1),
                                       ("train.log_every_steps", 2), ("eval.every_steps", 4),
                                       ("eval.batch_size", 8), ("compilation_cache", COMPILATION_CACHE))
  ]
  env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(
      [sys.executable, "-m", "lm.train", "--config=configs/mqar.py", f"--workdir={tmp_path}", *args],
      capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert result.returncode == 0, result.stderr[-3000:]
  assert "step 4/4 | loss" in result.stdout
  final = compare.read_run(str(tmp_path), "test")["evals"][-1]
  assert final["step"] == 4 and final["queries"] == 80 and 0 <= final["accuracy"] <= 1


@pytest.mark.slow
def test_report_plots_accuracy_against_width_and_the_decoding_states_bytes(tmp_path):
  """benchmarks/mqar_report.py on a hand-made summary: the state is the key/value cache for softmax
  and HYLA (L x 2 x H x T x K floats) and the constant recurrent state for linear attention and GLA
  (L x H x K x K), plus the cache's one position counter."""
  best = {}
  for preset in ("softmax", "linear", "hyla", "gla"):
    for width, accuracy in (("32", [0.5, 0.1]), ("64", [0.9, None])):
      name = f"{preset}_seed0_model.D={width}_data.num_kv_pairs=8_train.lr=1e-3"
      c = mqar_config.get_config()
      c.model.update(D=int(width), attention=preset)
      (tmp_path / name).mkdir()
      (tmp_path / name / "config.json").write_text(c.to_json())
      best[f"{preset} (model.D={width}, data.num_kv_pairs=8)"] = {
          "preset": preset,
          "values": {
              "model.D": width,
              "data.num_kv_pairs": "8",
              "train.lr": "1e-3"
          },
          "seeds": [0],
          "points": [name],
          "query accuracy": accuracy
      }
  (tmp_path / "summary.json").write_text(
      json.dumps({
          "task": "mqar",
          "axes": ["model.D", "data.num_kv_pairs", "train.lr"],
          "best": best
      }))
  out = tmp_path / "report"
  result = subprocess.run(
      [sys.executable, "benchmarks/mqar_report.py", f"--summary={tmp_path}/summary.json", f"--prefix={out}"],
      capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)), env={
          **os.environ, "JAX_PLATFORMS": "cpu"
      })
  assert result.returncode == 0, result.stderr[-3000:]
  table = json.loads((tmp_path / "report.json").read_text())
  assert [(r["variant"], r["D"]) for r in table
         ] == [(p, d) for p in ("softmax", "linear", "hyla", "gla") for d in (32, 64)]
  d = mqar_config.get_config()
  L, H, T, V = d.model.L, d.model.H, d.data.seq_len, d.data.vocab_size
  for r in table:
    K = r["D"] // H
    cache = L * 2 * H * T * K * 4 if r["variant"] in ("softmax", "hyla") else L * H * K * K * 4
    assert r["state_bytes"] == cache + 4, r
    assert r["floor"] == 1 / (V - V // 2)  # a guess among the value tokens
  assert f"| 8 | softmax | 64 | 1e-3 | 0 | 0.900 | {L * 2 * H * T * (64 // H) * 4 + 4:,} |" in result.stdout
  for plot in ("report_width.png", "report_state.png"):
    assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
