"""lm-harness's scoring throughput against lm-evaluate's on the same checkpoint, measured in one run.

  python benchmarks/harness_throughput.py --workdir=runs/tiny [--requests=1024] [--batch_size=32]

Requests shaped like a multiple-choice task's (a context of 16-112 tokens and a continuation of 1-16,
cut from the validation split's tokens) are scored by the harness's packed scorer
(eval/harness/scoring.py, the path every `loglikelihood` request takes); lm-evaluate's pass is the run's
own validation evaluation. The two alternate --repeats times after one warm-up each (compilation
excluded); the script prints, and with --json writes, min and median of harness requests/s, scored
tokens/s, tokens fed to the model per second (its rows, padding included), lm-evaluate's tokens/s,
and the ratio of fed tokens/s to lm-evaluate's.
"""

import json
import statistics
import time

import numpy as np
from absl import app, flags

from eval.harness import scoring
from lm import checkpointing
from lm.experiment import Experiment

FLAGS = flags.FLAGS


def make_requests(exp: Experiment, n: int, seed: int = 0) -> list[scoring.Request]:
  """n (context, continuation) requests cut from the validation split's token stream."""
  stream = np.concatenate([b["inputs"].ravel() for b in exp.eval_sets()["validation"]()])
  rng = np.random.default_rng(seed)
  requests = []
  for _ in range(n):
    context, continuation = int(rng.integers(16, 113)), int(rng.integers(1, 17))
    start = int(rng.integers(0, len(stream) - context - continuation))
    tokens = stream[start:start + context + continuation].tolist()
    requests.append(scoring.request(tokens[:context], tokens[context:], exp.config.data.seq_len))
  return requests


def timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv):
  del argv
  step, config = checkpointing.saved_config(FLAGS.workdir, None)
  exp = Experiment(config)
  _, params = checkpointing.load(FLAGS.workdir, step, exp.abstract_sharded_state())
  scorer = scoring.Scorer(exp, params, FLAGS.batch_size)
  requests = make_requests(exp, FLAGS.requests)
  rows = len(scoring.pack(requests, scorer.seq_len))
  batches = -(-rows // FLAGS.batch_size)
  fed = batches * FLAGS.batch_size * scorer.seq_len
  scored = sum(r.scored for r in requests)
  evaluated = {}

  def evaluate():
    evaluated.update(exp.evaluate(params, exp.eval_sets()["validation"]()))

  scorer.score(requests)  # compiles the scoring step
  evaluate()  # compiles the evaluation step
  harness_s, evaluate_s = [], []
  for _ in range(FLAGS.repeats):
    harness_s.append(timed(lambda: scorer.score(requests)))
    evaluate_s.append(timed(evaluate))
  summary = lambda values: {"min": min(values), "median": statistics.median(values)}
  best, typical = min(harness_s), statistics.median(harness_s)
  result = {
      "workdir": FLAGS.workdir,
      "step": step,
      "attention": exp.model_cfg.attention,
      "requests": len(requests),
      "scored_tokens": scored,
      "fed_tokens": fed,
      "packed_rows": rows,
      "batch_size": FLAGS.batch_size,
      "harness_seconds": summary(harness_s),
      "evaluate_seconds": summary(evaluate_s),
      "evaluate_tokens": evaluated["tokens"],
      "harness_requests_per_s": {
          "max": len(requests) / best,
          "median": len(requests) / typical
      },
      "harness_scored_tokens_per_s": {
          "max": scored / best,
          "median": scored / typical
      },
      "harness_fed_tokens_per_s": {
          "max": fed / best,
          "median": fed / typical
      },
      "evaluate_tokens_per_s": {
          "max": evaluated["tokens"] / min(evaluate_s),
          "median": evaluated["tokens"] / statistics.median(evaluate_s)
      },
  }
  result["fed_tokens_ratio_median"] = (result["harness_fed_tokens_per_s"]["median"] /
                                       result["evaluate_tokens_per_s"]["median"])
  print(f"{exp.model_cfg.attention}: harness {result['harness_requests_per_s']['median']:.0f} requests/s, "
        f"{result['harness_scored_tokens_per_s']['median']:.0f} scored tokens/s, "
        f"{result['harness_fed_tokens_per_s']['median']:.0f} fed tokens/s "
        f"({rows} packed rows for {len(requests)} requests); lm-evaluate "
        f"{result['evaluate_tokens_per_s']['median']:.0f} tokens/s; fed / lm-evaluate "
        f"{result['fed_tokens_ratio_median']:.2f} (medians of {FLAGS.repeats})")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A trained language model's workdir.")
  flags.DEFINE_integer("requests", 1024, "Requests to score per repeat.")
  flags.DEFINE_integer("batch_size", 32, "The scorer's rows per batch (lm-harness --batch_size).")
  flags.DEFINE_integer("repeats", 3, "Timed repeats of each, alternating.")
  flags.DEFINE_string("json", None, "Write the result here as JSON.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
