"""Fuzzy-logic generator: terms and truth tables, task splits, sequence layout, determinism."""

import itertools
import statistics

import numpy as np
import pytest

from data_pipelines import fuzzy_logic as fl


def _f(terms: list[tuple[int, ...]], x) -> float:
  """f(x) = OR over terms of AND over literals, written out with Python's min and max."""
  return max(min(xi if si else 1.0 - xi for si, xi in zip(term, x)) for term in terms)


def test_terms_are_the_bit_vectors_in_binary_order():
  terms = fl.all_terms(4)
  assert terms.shape == (16, 4)
  for t, bits in enumerate(terms):
    assert int("".join(map(str, bits)), 2) == t


def test_evaluate_matches_brute_force():
  rng = np.random.default_rng(0)
  bits_bkl = rng.integers(0, 2, (20, 3, 4))
  x_bnl = rng.random((20, 7, 4))
  f_bn = fl.evaluate(bits_bkl, x_bnl)
  for b, n in itertools.product(range(20), range(7)):
    assert f_bn[b, n] == pytest.approx(_f([tuple(t) for t in bits_bkl[b]], x_bnl[b, n]))
  # By hand: (x0 AND NOT x1) OR (NOT x0 AND x1) at x = (0.2, 0.9): max(min(.2, .1), min(.8, .9)).
  assert fl.evaluate(np.array([[[1, 0], [0, 1]]]), np.array([[[0.2, 0.9]]]))[0, 0] == 0.8


def test_truth_table_at_the_corners_is_the_crisp_disjunction():
  # At x in {0, 1}^L a term is 1 exactly at its own bit pattern, so f is 1 exactly on the task's
  # terms: the fuzzy task is a smooth extension of a Boolean function in disjunctive normal form.
  corners = fl.all_terms(4).astype(float)
  tasks = fl.all_tasks(4, 2)
  f_bn = fl.evaluate(fl.all_terms(4)[tasks], np.broadcast_to(corners, (len(tasks), 16, 4)))
  expected = np.zeros((len(tasks), 16))
  expected[np.arange(len(tasks))[:, None], tasks] = 1.0
  np.testing.assert_array_equal(f_bn, expected)


@pytest.mark.parametrize("frac_test, num_test, num_train", [(0.3, 19, 47), (0.5, 33, 33), (0.7, 46, 20)])
def test_split_sizes(frac_test, num_test, num_train):
  # L=4: 16 terms, the last 4 unknown; C(12, 2) = 66 tasks of known terms, C(4, 2) = 6 of unknown
  # ones, and 12 * 4 = 48 mixed tasks that are in no split.
  assert fl.all_tasks(4, 2).shape == (120, 2)
  assert fl.num_unknown_terms(4) == 4
  split = fl.task_split(4, 2, frac_test, split_seed=0)
  assert len(split["test"]) == num_test
  assert len(split["train"]) == num_train
  assert len(split["unknown"]) == 6


@pytest.mark.parametrize("frac_test", [0.3, 0.5, 0.7])
def test_splits_are_disjoint_and_made_of_the_right_terms(frac_test):
  tasks = fl.all_tasks(4, 2)
  split = {name: set(ids) for name, ids in fl.task_split(4, 2, frac_test, 1).items()}
  assert not split["train"] & split["test"]
  assert not (split["train"] | split["test"]) & split["unknown"]
  known = {i for i, task in enumerate(tasks) if max(task) < 12}
  unknown = {i for i, task in enumerate(tasks) if min(task) >= 12}
  assert split["train"] | split["test"] == known
  assert split["unknown"] == unknown
  # The held-out combinations depend on the split seed and only on it.
  assert split["test"] == set(fl.task_split(4, 2, frac_test, 1)["test"])
  assert split["test"] != set(fl.task_split(4, 2, frac_test, 2)["test"])


def test_sequences_hold_examples_of_one_task_and_a_zeroed_query():
  batch = fl.sample_batch(3, 5, 16, seq_len=12)
  inputs, terms = batch["inputs_btv"], fl.all_terms(4)
  assert inputs.shape == (16, 12, 5) and inputs.dtype == np.float32
  assert batch["targets_b"].shape == batch["target_var_b"].shape == (16,)
  np.testing.assert_array_equal(inputs[:, -1, -1], 0.0)
  for b in range(16):
    task = [tuple(terms[t]) for t in batch["terms_bk"][b]]
    f = [_f(task, x) for x in inputs[b, :, :4]]
    np.testing.assert_allclose(inputs[b, :-1, 4], f[:-1], rtol=1e-6)
    assert batch["targets_b"][b] == pytest.approx(f[-1])
    assert batch["target_var_b"][b] == pytest.approx(statistics.pvariance(f), rel=1e-4)


def test_inputs_are_uniform_on_the_unit_cube():
  x = fl.sample_batch(0, 0, 256)["inputs_btv"][..., :4]
  assert x.min() >= 0.0 and x.max() < 1.0
  assert abs(x.mean() - 0.5) < 0.01 and abs(x.var() - 1 / 12) < 0.005


@pytest.mark.parametrize("split", ["train", "test", "unknown"])
def test_instances_come_from_their_split(split):
  batch = fl.sample_batch(0, 2, 400, split, frac_test=0.5, split_seed=4)
  assert set(batch["task_b"]) <= set(fl.task_split(4, 2, 0.5, 4)[split])
  np.testing.assert_array_equal(batch["terms_bk"], fl.all_tasks(4, 2)[batch["task_b"]])
  assert len(set(batch["task_b"])) == len(fl.task_split(4, 2, 0.5, 4)[split])


def _x(seed: int = 5, step: int = 11, split: str = "train") -> np.ndarray:
  return fl.sample_batch(seed, step, 8, split)["inputs_btv"][..., :4]


def test_deterministic_in_seed_and_step():
  batch = fl.sample_batch(5, 11, 8)
  for key, value in fl.sample_batch(5, 11, 8).items():
    np.testing.assert_array_equal(value, batch[key])


@pytest.mark.parametrize("change", [{"step": 12}, {"seed": 6}, {"split": "test"}])
def test_inputs_change_with_seed_step_and_split(change):
  # Compared on x alone: the held-out split must not replay the training inputs with other f.
  assert not np.array_equal(_x(), _x(**change))


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="train, test, unknown"):
    fl.sample_batch(0, 0, 4, "ood")
  # L=2 has one unknown term, too few for a task of K=2 unknown terms.
  with pytest.raises(ValueError, match="'unknown' has no task"):
    fl.sample_batch(0, 0, 4, "unknown", num_vars=2)
  with pytest.raises(ValueError, match="num_terms"):
    fl.sample_batch(0, 0, 4, num_vars=2, num_terms=5)
