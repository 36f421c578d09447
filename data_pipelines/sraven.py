"""Symbolic Raven progressive matrices (SRAVEN), docs/reference/paper.md section 4.

A 3x3 grid of panels; each panel has F=4 features with values in 0..7 (arithmetic mod 8). Every
feature follows one of 8 rules along the rows, and every row is an independent draw of that rule.
A task is an unordered multiset of 4 rules (330 tasks); a seeded 25% (82) are held out as OOD.

Dimension letters: b batch, t token position (36), v one-hot value (8), f feature or slot (4),
c column (3), r row (3).
"""

import functools
import itertools

import numpy as np

NUM_VALUES = 8  # feature values 0..7; all rule arithmetic is mod 8
NUM_FEATURES = 4
GRID = 3
RULES = (
    "constant",
    "progression+1",
    "progression+2",
    "progression-1",
    "progression-2",
    "addition",
    "subtraction",
    "distribute_three",
)
CONTEXT_LEN = (GRID * GRID - 1) * NUM_FEATURES  # 32: the 8 context panels, one token per feature
SEQ_LEN = CONTEXT_LEN + NUM_FEATURES  # 36: plus 4 zero query tokens
SPLITS = ("train", "test", "ood")  # "test": fresh instances of training tasks


@functools.cache
def all_tasks() -> np.ndarray:
  """All 330 tasks as sorted rule multisets [330, 4]; a task id is a row index."""
  tasks = np.array(list(itertools.combinations_with_replacement(range(len(RULES)), NUM_FEATURES)))
  tasks.setflags(write=False)
  return tasks


def task_split(split_seed: int, frac_ood: float = 0.25) -> dict[str, np.ndarray]:
  """Task ids of the training and of the held-out OOD tasks: sorted, disjoint, covering all."""
  train, ood = _task_split(split_seed, frac_ood)
  return {"train": train, "ood": ood}


@functools.cache
def _task_split(split_seed: int, frac_ood: float) -> tuple[np.ndarray, np.ndarray]:
  num_tasks = len(all_tasks())
  num_ood = int(num_tasks * frac_ood)
  if not 0 < num_ood < num_tasks:
    raise ValueError(f"frac_ood={frac_ood} holds out {num_ood} of {num_tasks} tasks; choose it in (0, 1)")
  perm = np.random.default_rng(split_seed).permutation(num_tasks)
  train, ood = np.sort(perm[num_ood:]), np.sort(perm[:num_ood])
  train.setflags(write=False)
  ood.setflags(write=False)
  return train, ood


# Every rule but distribute-three is affine in two uniform draws (a, b) per row: the value in
# column c is (A[c]*a + B[c]*b + C[c]) mod 8. Rows are (A, B, C); distribute-three's are unused.
_AFFINE_RABC = np.array([
    [[1, 1, 1], [0, 0, 0], [0, 0, 0]],  # constant: (a, a, a)
    [[1, 1, 1], [0, 0, 0], [0, 1, 2]],  # progression +1: (a, a+1, a+2)
    [[1, 1, 1], [0, 0, 0], [0, 2, 4]],  # progression +2
    [[1, 1, 1], [0, 0, 0], [0, -1, -2]],  # progression -1
    [[1, 1, 1], [0, 0, 0], [0, -2, -4]],  # progression -2
    [[1, 0, 1], [0, 1, 1], [0, 0, 0]],  # addition: (a, b, a+b)
    [[1, 0, 1], [0, 1, -1], [0, 0, 0]],  # subtraction: (a, b, a-b)
    [[0, 0, 0], [0, 0, 0], [0, 0, 0]],  # distribute-three: not affine, see _rows
])
_DISTRIBUTE_THREE = RULES.index("distribute_three")


@functools.cache
def _arrangements(n: int, k: int) -> np.ndarray:
  """All ordered choices of k distinct values from range(n), [n!/(n-k)!, k]."""
  table = np.array(list(itertools.permutations(range(n), k)))
  table.setflags(write=False)
  return table


def _random_arrangements(rng: np.random.Generator, shape: tuple[int, ...], n: int, k: int) -> np.ndarray:
  """Uniform ordered choices [*shape, k] of k distinct values from range(n); k=n: permutations.

  A table lookup: argsort of random keys costs several times more on such short rows.
  """
  table = _arrangements(n, k)
  return table[rng.integers(0, len(table), shape)]


def _take_last(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
  """np.take_along_axis(x, idx, axis=-1) as one flat gather, several times faster on small arrays.

  idx's leading dimensions must broadcast to x's.
  """
  n = x.shape[-1]
  rows = np.arange(x.size // n).reshape(x.shape[:-1] + (1,))
  return x.reshape(-1)[rows * n + idx]


def _rows(rules_bf: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Grid values [b, f, r, c]: each feature follows its rule, each row drawn anew."""
  batch = rules_bf.shape[0]
  a_bfr1, b_bfr1 = rng.integers(0, NUM_VALUES, (2, batch, NUM_FEATURES, GRID, 1))
  coef_bfkc = _AFFINE_RABC[rules_bf]
  affine_bfrc = coef_bfkc[:, :, None, 0] * a_bfr1 + coef_bfkc[:, :, None, 1] * b_bfr1
  affine_bfrc = (affine_bfrc + coef_bfkc[:, :, None, 2]) % NUM_VALUES
  # Distribute-three: 3 distinct values drawn once per feature, then a fresh permutation per row.
  three_bf3 = _random_arrangements(rng, (batch, NUM_FEATURES), NUM_VALUES, GRID)
  order_bfrc = _random_arrangements(rng, (batch, NUM_FEATURES, GRID), GRID, GRID)
  three_bfrc = _take_last(three_bf3[:, :, None, :], order_bfrc)
  return np.where((rules_bf == _DISTRIBUTE_THREE)[..., None, None], three_bfrc, affine_bfrc)


def sample_batch(
    seed: int,
    step: int,
    batch_size: int,
    split: str = "train",
    *,
    split_seed: int = 0,
    frac_ood: float = 0.25,
    permute_features: bool = True,
) -> dict[str, np.ndarray]:
  """One batch of SRAVEN instances, a deterministic function of (seed, step, split).

  `split_seed` fixes which tasks are held out (see `task_split`); `seed` drives the instances.

  Returns:
    inputs_btv: float32 [b, 36, 8], one-hot tokens; the last 4 (query) tokens are zero.
    targets_bf: int32 [b, 4], the missing panel's slots in the order the query tokens take.
    task_b: int32 [b], row of `all_tasks()`.
    rules_bf: int32 [b, 4], rule (index into RULES) of each underlying feature.
    perm_bcf: int32 [b, 3, 4], slot s of every panel in column c shows feature perm_bcf[b, c, s].
    query_rules_bf: int32 [b, 4], rule of the feature behind each query slot.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown SRAVEN split {split!r}; choose one of: {', '.join(SPLITS)}")
  # The split is part of the seed so that "test" never replays the "train" stream.
  rng = np.random.default_rng([seed, step, SPLITS.index(split)])
  task_ids = task_split(split_seed, frac_ood)["ood" if split == "ood" else "train"]
  task_b = rng.choice(task_ids, batch_size)
  # Rules go to features in a random order: sorted multisets would put the task's largest rule on
  # the last feature every time (docs/reference/paper.md, section 4, last item).
  order_bf = _random_arrangements(rng, (batch_size,), NUM_FEATURES, NUM_FEATURES)
  rules_bf = _take_last(all_tasks()[task_b], order_bf)
  values_bfrc = _rows(rules_bf, rng)

  # Drawn even when unused so that the flag changes the slot order and nothing else.
  perm_bcf = _random_arrangements(rng, (batch_size, GRID), NUM_FEATURES, NUM_FEATURES)
  if not permute_features:
    perm_bcf = np.broadcast_to(np.arange(NUM_FEATURES), perm_bcf.shape)
  panels_brcf = values_bfrc.transpose(0, 2, 3, 1)
  shown_brcf = _take_last(panels_brcf, perm_bcf[:, None])
  tokens_bt = shown_brcf.reshape(batch_size, SEQ_LEN)

  inputs_btv = np.zeros((batch_size, SEQ_LEN, NUM_VALUES), np.float32)
  flat_bt = np.arange(batch_size * SEQ_LEN).reshape(batch_size, SEQ_LEN) * NUM_VALUES + tokens_bt
  inputs_btv.reshape(-1)[flat_bt[:, :CONTEXT_LEN]] = 1.0  # one-hot by a flat scatter: fastest
  return {
      "inputs_btv": inputs_btv,
      "targets_bf": tokens_bt[:, CONTEXT_LEN:].astype(np.int32),
      "task_b": task_b.astype(np.int32),
      "rules_bf": rules_bf.astype(np.int32),
      "perm_bcf": perm_bcf.astype(np.int32),
      "query_rules_bf": _take_last(rules_bf, perm_bcf[:, -1]).astype(np.int32),
  }


def shown_values(batch: dict[str, np.ndarray]) -> np.ndarray:
  """The 36 values a sample_batch shows [b, 36]: the context from the one-hot inputs, then the answer."""
  context_bt = batch["inputs_btv"][:, :CONTEXT_LEN].argmax(-1)
  return np.concatenate([context_bt, batch["targets_bf"]], axis=1)


def same_feature_positions(perm_bcf: np.ndarray, slot: int) -> np.ndarray:
  """Token positions [b, 2] of the query slot's feature in the last row's two earlier panels.

  These are the keys of the SRAVEN latent code (docs/reference/paper.md section 5); the query token
  itself sits at position CONTEXT_LEN + slot.
  """
  feature_b = perm_bcf[:, -1, slot]
  # argsort inverts each column's permutation: slot_bcf[b, c, f] is feature f's slot in column c.
  slot_bcf = np.argsort(perm_bcf, axis=-1)
  slot_b2 = np.take_along_axis(slot_bcf[:, :GRID - 1], feature_b[:, None, None], axis=-1)[..., 0]
  first_panel = (GRID - 1) * GRID  # panel index of the last row's first column
  return (first_panel + np.arange(GRID - 1)) * NUM_FEATURES + slot_b2
