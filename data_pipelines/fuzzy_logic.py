"""Fuzzy-logic in-context regression, docs/reference/paper.md section 3.

L variables x in [0, 1]^L; AND = min, OR = max, NOT x = 1 - x. A term is a full conjunction of
all L literals given by a bit vector s (literal x_i where s_i = 1, else 1 - x_i): 2^L terms. A task
is an unordered set of K distinct terms, f(x) = max_k min_i lit(s_k,i, x_i).

Choices docs/reference/paper.md leaves open: x is drawn i.i.d. uniform on [0, 1)^L; terms are ordered
by their bit vector read as a binary number (variable 0 most significant); the "unknown" split holds
the tasks whose terms are *all* unknown (docs/reference/paper.md: "combinations of unknown terms"), so a
task mixing known and unknown terms is in no split; the variance is the population variance (ddof=0)
of all N targets of a sequence, the query's included.

Dimension letters: b batch, t token (one per example, N), v token values (L + 1), n example, k term,
l variable.
"""

import functools
import itertools

import numpy as np

# "test" is the compositional OOD split: held-out combinations of known terms.
SPLITS = ("train", "test", "unknown")


@functools.cache
def all_terms(num_vars: int) -> np.ndarray:
  """All 2^L terms as bit vectors [2^L, L]; term t is t in binary, variable 0 most significant."""
  terms = np.array(list(itertools.product((0, 1), repeat=num_vars)), np.int8)
  terms.setflags(write=False)
  return terms


@functools.cache
def all_tasks(num_vars: int, num_terms: int) -> np.ndarray:
  """All tasks as increasing term indices [C(2^L, K), K]; a task id is a row index."""
  tasks = np.array(list(itertools.combinations(range(2**num_vars), num_terms)), np.int64)
  tasks = tasks.reshape(-1, num_terms)  # keeps the shape when there is no task at all
  tasks.setflags(write=False)
  return tasks


def num_unknown_terms(num_vars: int, frac_unknown: float = 0.25) -> int:
  """How many of the last terms are never trained on."""
  return int(2**num_vars * frac_unknown)


def task_split(
    num_vars: int,
    num_terms: int,
    frac_test: float,
    split_seed: int,
    frac_unknown: float = 0.25,
) -> dict[str, np.ndarray]:
  """Task ids (sorted) of the splits "train", "test" and "unknown".

  Tasks made only of known terms are permuted with `split_seed`; the first int(n * frac_test)
  are "test", the rest "train". "unknown" holds the tasks whose terms are all unknown.
  """
  return dict(zip(SPLITS, _task_split(num_vars, num_terms, frac_test, split_seed, frac_unknown)))


@functools.cache
def _task_split(num_vars: int, num_terms: int, frac_test: float, split_seed: int,
                frac_unknown: float) -> tuple[np.ndarray, ...]:
  if not 1 <= num_terms <= 2**num_vars:
    raise ValueError(f"num_terms={num_terms} must be between 1 and 2^num_vars = {2**num_vars}")
  first_unknown = 2**num_vars - num_unknown_terms(num_vars, frac_unknown)
  tasks = all_tasks(num_vars, num_terms)
  known = np.flatnonzero((tasks < first_unknown).all(axis=1))
  known = np.random.default_rng(split_seed).permutation(known)
  num_test = int(len(known) * frac_test)
  unknown = np.flatnonzero((tasks >= first_unknown).all(axis=1))
  splits = tuple(np.sort(ids) for ids in (known[num_test:], known[:num_test], unknown))
  for ids in splits:
    ids.setflags(write=False)
  return splits


def evaluate(bits_bkl: np.ndarray, x_bnl: np.ndarray) -> np.ndarray:
  """f [b, n] of each task (its K terms as bit vectors) at each of its inputs."""
  # Variables and terms go in front: numpy reduces short trailing axes several times slower.
  x_l1bn = np.ascontiguousarray(np.moveaxis(x_bnl, -1, 0))[:, None]
  bits_lkb1 = bits_bkl.transpose(2, 1, 0)[..., None].astype(bool)
  literal_lkbn = np.where(bits_lkb1, x_l1bn, 1 - x_l1bn)
  return literal_lkbn.min(axis=0).max(axis=0)  # AND over variables, then OR over terms


def sample_batch(
    seed: int,
    step: int,
    batch_size: int,
    split: str = "train",
    *,
    num_vars: int = 4,
    num_terms: int = 2,
    seq_len: int = 32,
    frac_test: float = 0.7,
    split_seed: int = 0,
    frac_unknown: float = 0.25,
) -> dict[str, np.ndarray]:
  """One batch of sequences, a deterministic function of (seed, step, split) and the settings.

  Defaults are the paper's ablation setting (L=4, K=2, N=32, frac_test=0.7). `split_seed` fixes
  the held-out tasks (see `task_split`); `seed` drives the sequences.

  Returns:
    inputs_btv: float32 [b, N, L+1], token n = [x_n, f(x_n)]; the last (query) token's f is 0.
    targets_b: float32 [b], f at the last x.
    target_var_b: float32 [b], variance of the N targets of each sequence (R² = 1 - err² / var).
    task_b: int32 [b], row of `all_tasks(L, K)`.
    terms_bk: int32 [b, K], the task's term indices (rows of `all_terms(L)`), increasing.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown fuzzy-logic split {split!r}; choose one of: {', '.join(SPLITS)}")
  task_ids = task_split(num_vars, num_terms, frac_test, split_seed, frac_unknown)[split]
  if len(task_ids) == 0:
    raise ValueError(f"fuzzy-logic split {split!r} has no task with L={num_vars}, K={num_terms}, "
                     f"frac_test={frac_test}, frac_unknown={frac_unknown}; change one of these")
  # The split is part of the seed so that "test" never replays the "train" stream.
  rng = np.random.default_rng([seed, step, SPLITS.index(split)])
  task_b = rng.choice(task_ids, batch_size)
  terms_bk = all_tasks(num_vars, num_terms)[task_b]
  x_bnl = rng.random((batch_size, seq_len, num_vars), dtype=np.float32)
  f_bn = evaluate(all_terms(num_vars)[terms_bk], x_bnl)

  inputs_btv = np.concatenate([x_bnl, f_bn[..., None]], axis=-1)
  inputs_btv[:, -1, -1] = 0.0  # the query: its answer is the target
  return {
      "inputs_btv": inputs_btv,
      "targets_b": f_bn[:, -1],
      "target_var_b": f_bn.var(axis=-1),
      "task_b": task_b.astype(np.int32),
      "terms_bk": terms_bk.astype(np.int32),
  }
