"""How often a SRAVEN instance admits more than one answer panel, by brute force.

`python -m eval.sraven_ambiguity [--instances=200000] [--seed=0]` prints the rates on training tasks,
with and without the feature permutation:
  - ambiguous: more than one panel is consistent with the context under the 8 rules (with the
    permutation: under some pairing of slots across columns). No model can exceed 1 minus half
    this rate in whole-answer accuracy on such instances unless the task's rule multiset breaks
    the tie (it is not an input).
  - wholly_ambiguous: a consistent panel differs from the true one in all 4 slots, the definition
    of the paper code's checker.
"""

import itertools
import json

import numpy as np
from absl import app, flags

from data_pipelines import sraven

V = sraven.NUM_VALUES
_INSTANCES = flags.DEFINE_integer("instances", 200_000, "Instances per setting (training tasks).")
_SEED = flags.DEFINE_integer("seed", 0, "Generator seed.")
_CHUNK = 2000  # instances per brute-force pass (memory: 24 x 24 pairings each)


def answer_masks(context_bt: np.ndarray) -> np.ndarray:
  """[b, i0, i1, j, value]: can some rule end the last row in `value`, when slot i0 of column 0
  and slot i1 of column 1 are taken to hold the same feature as slot j of column 2?"""
  panels = context_bt.reshape(-1, 8, 4)  # panel 3*row + col
  a = [panels[:, 3 * r + 0, :, None, None] for r in range(3)]  # [b, i0, 1, 1]
  b = [panels[:, 3 * r + 1, None, :, None] for r in range(3)]  # [b, 1, i1, 1]
  c = [panels[:, 3 * r + 2, None, None, :] for r in range(2)]  # [b, 1, 1, j]
  shape = (len(panels), 4, 4, 4)
  masks = np.zeros(shape + (V,), bool)

  def one_hot(x):
    return np.broadcast_to(x, shape)[..., None] == np.arange(V)

  def add(fits, answer):
    masks[...] |= np.broadcast_to(fits, shape)[..., None] & one_hot(answer % V)

  for step in (0, 1, 2, -1, -2):  # constant and the four progressions
    fits = [((b[r] - a[r]) % V == step % V) & ((c[r] - b[r]) % V == step % V) for r in range(2)]
    add(fits[0] & fits[1] & ((b[2] - a[2]) % V == step % V), b[2] + step)
  add(((a[0] + b[0]) % V == c[0]) & ((a[1] + b[1]) % V == c[1]), a[2] + b[2])
  add(((a[0] - b[0]) % V == c[0]) & ((a[1] - b[1]) % V == c[1]), a[2] - b[2])
  # Distribute-three: both full rows hold the same three distinct values, the last row two.
  sets = [one_hot(a[r]).astype(int) + one_hot(b[r]) + one_hot(c[r]) for r in range(2)]
  fits = (sets[0].max(-1) == 1) & (sets[0] == sets[1]).all(-1)
  last = one_hot(a[2]).astype(int) + one_hot(b[2])
  fits &= (last <= sets[0]).all(-1) & (last.max(-1) == 1)
  masks |= fits[..., None] & (sets[0] - last == 1)
  return masks


def ambiguity(context_bt: np.ndarray, answer_bf: np.ndarray, permute: bool) -> dict:
  """Brute force over every rule per feature and every pairing of slots across columns.

  A panel (4 values in query-slot order) is consistent with the 8 context panels when some pairing
  of column-0 and column-1 slots with the query slots (all 24 x 24, or only the identity without
  feature permutation) makes every query slot's feature follow one of the 8 rules, ending in that
  panel's value. Returns, per instance:
    ambiguous: more than one panel is consistent.
    wholly_ambiguous: a consistent panel differs from the true one in all 4 slots (the
      definition of the paper's reference checker, whose rate docs/reference/paper.md quotes as < 0.5%).
    consistent: the true panel is consistent (it must be).
  """
  masks = answer_masks(context_bt)
  perms = list(itertools.permutations(range(4))) if permute else [(0, 1, 2, 3)]
  pi0, pi1 = (np.array(p) for p in zip(*itertools.product(perms, perms)))  # [pairing, j]
  slots = np.arange(4)
  pairing_pjv = masks[:, pi0, pi1, slots]  # [b, pairing, j, value]
  count_bpj = pairing_pjv.sum(-1)
  valid_bp = (count_bpj > 0).all(-1)
  # A valid pairing with one answer per slot gives one panel; code it as a number to compare.
  code_bp = (pairing_pjv.argmax(-1) * V**slots).sum(-1)
  several_per_slot = (valid_bp & (count_bpj > 1).any(-1)).any(-1)
  lo = np.where(valid_bp, code_bp, np.inf).min(-1)
  hi = np.where(valid_bp, code_bp, -np.inf).max(-1)
  true_bpj = np.take_along_axis(pairing_pjv, answer_bf[:, None, :, None], axis=-1)[..., 0]
  other_bpj = count_bpj > true_bpj  # some other value fits this slot
  return {
      "ambiguous": several_per_slot | (lo != hi),
      "wholly_ambiguous": other_bpj.all(-1).any(-1),
      "consistent": true_bpj.all(-1).any(-1),
  }


def rates(seed: int, instances: int, permute: bool) -> dict[str, float]:
  found = {"ambiguous": 0, "wholly_ambiguous": 0}
  for step, start in enumerate(range(0, instances, _CHUNK)):
    batch = sraven.sample_batch(seed, step, min(_CHUNK, instances - start), permute_features=permute)
    result = ambiguity(sraven.shown_values(batch)[:, :sraven.CONTEXT_LEN], batch["targets_bf"], permute)
    if not result["consistent"].all():
      raise AssertionError("a true answer does not follow from its context: the generator is broken")
    for k in found:
      found[k] += int(result[k].sum())
  return {k: v / instances for k, v in found.items()}


def main(argv):
  del argv
  print(
      json.dumps({
          "instances": _INSTANCES.value,
          "seed": _SEED.value,
          **{
              f"permute_features={p}": rates(_SEED.value, _INSTANCES.value, p) for p in (True, False)
          }
      }))


if __name__ == "__main__":
  app.run(main)
