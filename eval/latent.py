"""Latent-code analysis of a SRAVEN or fuzzy-logic checkpoint (docs/reference/paper.md section 5), by two
protocols.

`lm-latent --workdir=DIR [--step=N] [--examples=2048] [--paper_examples=N]`

The latent code of a (query, key) pair is the H-vector of normalised scores across heads, per layer.
Our protocol (top-level keys of latent.json) fits a decoder per layer on codes of training tasks and
scores it on held-out (OOD) tasks: SRAVEN's codes of each query token towards the same feature in the
last row's earlier panels, labelled by that feature's rule; fuzzy logic's query self-code, labelled by
the task's K terms (`analyse`). The paper code's protocol (key "paper_code", `paper_code_protocol`):
SRAVEN's last query token on unpermuted data; fuzzy logic's self-codes of all layers, ridge regression
onto the terms' bit-vectors scored by R². docs/guides/compositional.md describes both. Also writes
DIR/latent.json (printed too) and DIR/latent_embedding.png: a PCA of the final layer's OOD codes (our
protocol), coloured by rule (SRAVEN) or by the task's first term (fuzzy logic).
"""

import json

import jax
import matplotlib
import numpy as np
from absl import flags
from etils import epath
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import r2_score
from sklearn.multiclass import OneVsRestClassifier
from sklearn.preprocessing import MultiLabelBinarizer

from data_pipelines import fuzzy_logic, sraven, storage
from eval import compare
from lm import checkpointing, model as model_lib
from lm.runtime import cli
from lm.tasks_compositional import EVAL_STEP0, split_seed

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)

_BATCH = 256
PAPER_EXAMPLES = {"sraven": 51_200, "fuzzy_logic": 16_000}  # the paper code's callback set sizes


def codes_fn(config, params):
  """inputs [B, T, I] -> per-layer normalised scores, a list of [B, H, T, T] numpy arrays."""
  model = model_lib.Transformer(model_lib.ModelConfig.from_dict(config.model.to_dict()))
  apply = jax.jit(lambda x: model_lib.latent_codes(model, params, x))
  return lambda inputs: [np.asarray(c) for c in apply(inputs)]


def sraven_codes(config, codes, split: str, examples: int, slots=range(sraven.NUM_FEATURES),
                 permute: bool | None = None):
  """Features [L, n*len(slots), 2H] and rule labels [n*len(slots)] of one split. permute: the
  feature permutation (default: as in training)."""
  d, feats, labels = config.data, [], []
  permute = d.permute_features if permute is None else permute
  for i in range(0, examples, _BATCH):
    b = sraven.sample_batch(config.seed, EVAL_STEP0 + i, min(_BATCH, examples - i), split,
                            split_seed=split_seed(config), frac_ood=d.frac_ood, permute_features=permute)
    layers = codes(b["inputs_btv"])
    rows = np.arange(len(b["task_b"]))[:, None]
    per_slot = []
    for slot in slots:
      keys_b2 = sraven.same_feature_positions(b["perm_bcf"], slot)
      query = sraven.CONTEXT_LEN + slot
      # a_bhqk[b, :, query, keys_b2[b]] for each layer -> [L, B, 2H]
      per_slot.append(np.stack([a[rows, :, query, keys_b2].reshape(len(rows), -1) for a in layers]))
    feats.append(np.concatenate(per_slot, axis=1))
    labels.append(b["query_rules_bf"][:, list(slots)].T.reshape(-1))
  return np.concatenate(feats, axis=1), np.concatenate(labels)


def fuzzy_codes(config, codes, split: str, examples: int, fixed_query: bool = False):
  """Features [L, n, H] and term sets [n, K] of one split; fixed_query: every sequence's query
  point is one point drawn from the run's seed (the paper code's probe set)."""
  d, feats, labels = config.data, [], []
  x_query_l = np.random.default_rng(config.seed).random(d.num_vars, dtype=np.float32)
  for i in range(0, examples, _BATCH):
    b = fuzzy_logic.sample_batch(config.seed, EVAL_STEP0 + i, min(_BATCH,
                                                                  examples - i), split, num_vars=d.num_vars,
                                 num_terms=d.num_terms, seq_len=d.seq_len, frac_test=d.frac_test,
                                 split_seed=split_seed(config), frac_unknown=d.frac_unknown)
    if fixed_query:
      b["inputs_btv"][:, -1, :d.num_vars] = x_query_l  # the query's answer slot stays 0
    feats.append(np.stack([a[:, :, -1, -1] for a in codes(b["inputs_btv"])]))
    labels.append(b["terms_bk"])
  return np.concatenate(feats, axis=1), np.concatenate(labels)


def decode_rules(x_train, y_train, x_ood, y_ood) -> float:
  clf = LogisticRegression(max_iter=2000).fit(x_train, y_train)
  return float((clf.predict(x_ood) == y_ood).mean())


def decode_terms(x_train, terms_train, x_ood, terms_ood) -> float:
  """Accuracy of the decoded term set: the K highest-scoring terms equal the task's terms."""
  binarizer = MultiLabelBinarizer().fit(np.concatenate([terms_train, terms_ood]))
  clf = OneVsRestClassifier(LogisticRegression(max_iter=2000)).fit(x_train, binarizer.transform(terms_train))
  top_nk = binarizer.classes_[np.argsort(-clf.decision_function(x_ood), axis=1)[:, :terms_ood.shape[1]]]
  return float((np.sort(top_nk, axis=1) == np.sort(terms_ood, axis=1)).all(axis=1).mean())


def ridge_r2(x_nf, y_nt) -> float:
  """Ridge regression (l2 = 1) fitted on the first half, R² on the second, averaged over targets."""
  half = len(x_nf) // 2
  fit = Ridge(alpha=1.0).fit(x_nf[:half], y_nt[:half])
  return float(r2_score(y_nt[half:], fit.predict(x_nf[half:])))


def fitted(decode, *args, flag: str):
  """decode(*args), with scikit-learn's refusal of too few instances (one class only, fewer
  instances than components) as one line naming the flag that set their number."""
  try:
    return decode(*args)
  except ValueError as e:
    raise ValueError(f"{flag} instances are too few to fit the decoders ({_first_line(e)}); give more "
                     f"(default 2048)") from e


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def paper_code_protocol(config, codes, examples: int) -> dict:
  """The paper code's protocol. SRAVEN: the last query token only, on unpermuted data; logistic
  regression per layer from fresh instances of training tasks to OOD tasks (`examples` each). Fuzzy
  logic: all layers' query self-codes (L*H values) on fixed-query sequences (one query point for every
  sequence) of training tasks, ridge regression onto the task's term bit-vectors (K*L targets),
  `ridge_r2`."""
  if config.task == "sraven":
    (x_tr, y_tr), (x_ood, y_ood) = (
        sraven_codes(config, codes, s, examples, slots=(3,), permute=False) for s in ("test", "ood"))
    return {
        "protocol": "last query token, unpermuted data, logistic regression training -> OOD tasks",
        "examples_per_split": examples,
        "ood_decoding_accuracy_per_layer": [
            fitted(decode_rules, x_tr[l], y_tr, x_ood[l], y_ood, flag=f"--paper_examples={examples}")
            for l in range(len(x_tr))
        ],
        "majority_class_accuracy": float(np.bincount(y_ood).max() / len(y_ood))
    }
  x_lnh, terms_nk = fuzzy_codes(config, codes, "train", examples, fixed_query=True)
  bits_nkl = fuzzy_logic.all_terms(config.data.num_vars)[terms_nk]
  return {
      "protocol":
          "all layers' query self-codes, fixed-query sequences of training tasks, "
          "ridge (l2=1) onto term bits, R² on the held-out half",
      "examples":
          examples,
      "term_bits_r2":
          fitted(ridge_r2, np.concatenate(list(x_lnh), axis=1), bits_nkl.reshape(len(bits_nkl), -1),
                 flag=f"--paper_examples={examples}")
  }


def analyse(workdir: str, step: int | None = None, examples: int = 2048,
            paper_examples: int | None = None) -> dict:
  """paper_examples: instances per set of the paper code's protocol (default: its sizes)."""
  config, params = checkpointing.load(workdir, step)
  codes = codes_fn(config, params)
  if config.task == "sraven":
    (x_tr, y_tr), (x_ood, y_ood) = (sraven_codes(config, codes, s, examples) for s in ("train", "ood"))
    decode, label_name, colour = decode_rules, "rule", y_ood
    chance = float(np.bincount(y_ood).max() / len(y_ood))
  elif config.task == "fuzzy_logic":
    (x_tr, y_tr), (x_ood, y_ood) = (fuzzy_codes(config, codes, s, examples) for s in ("train", "test"))
    decode, label_name, colour = decode_terms, "first term", y_ood[:, 0]
    chance = None
  else:
    raise SystemExit(f"lm-latent: {workdir} is a {config.task!r} run; latent codes are analysed for "
                     "sraven and fuzzy_logic runs only")
  result = {
      "task":
          config.task,
      "attention":
          config.model.attention,
      "heads":
          config.model.H,
      "protocol":
          "ours: " + ("every query token, training distribution, logistic regression "
                      "training -> OOD tasks" if config.task == "sraven" else
                      "query self-code, term set by one-vs-rest logistic regression, "
                      "training -> OOD tasks"),
      "examples_per_split":
          examples,
      "ood_decoding_accuracy_per_layer": [
          fitted(decode, x_tr[l], y_tr, x_ood[l], y_ood, flag=f"--examples={examples}")
          for l in range(len(x_tr))
      ],
      "majority_class_accuracy":
          chance,
      "paper_code":
          paper_code_protocol(config, codes, paper_examples or PAPER_EXAMPLES[config.task])
  }
  embedding = PCA(n_components=2).fit_transform(x_ood[-1]) if x_ood.shape[-1] > 1 else \
      np.concatenate([x_ood[-1], np.zeros_like(x_ood[-1])], axis=1)
  fig, ax = plt.subplots(figsize=(5, 4.5))
  points = ax.scatter(embedding[:, 0], embedding[:, 1], c=colour, cmap="tab10", s=4)
  ax.legend(*points.legend_elements(), title=label_name, fontsize=7, loc="best")
  ax.set(title=f"{config.task}, {config.model.attention}: final-layer OOD codes (PCA)", xlabel="PC 1",
         ylabel="PC 2")
  compare.save_figure(fig, epath.Path(workdir) / "latent_embedding.png")
  storage.write_text(epath.Path(workdir) / "latent.json", json.dumps(result, indent=1))
  return result


def main(argv):
  del argv
  for name in ("examples", "paper_examples"):
    if (n := getattr(flags.FLAGS, name)) is not None and n < 2:
      raise SystemExit(f"lm-latent: --{name}={n}: give 2 or more instances (the decoders are fitted on them)")
  try:
    result = analyse(flags.FLAGS.workdir, flags.FLAGS.step, flags.FLAGS.examples, flags.FLAGS.paper_examples)
  except (FileNotFoundError, ValueError) as e:  # ValueError: DamagedCheckpointError, too few instances
    raise SystemExit(f"lm-latent: {e}") from e
  print(json.dumps(result, indent=1))


def run():
  flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
  flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest.")
  flags.DEFINE_integer("examples", 2048, "Instances per split (training tasks, OOD tasks), our protocol.")
  flags.DEFINE_integer(
      "paper_examples", None, "Instances per set of the paper code's protocol; "
      "default: its sizes (SRAVEN 51,200, fuzzy logic 16,000).")
  flags.mark_flags_as_required(["workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
