"""`lm-prepare`: text and JSON(.gz) files → ArrayRecord shards that `data.source=array_record` reads.

    lm-prepare --train='c4/en/c4-train.*.json.gz' --validation='c4/en/c4-validation.*.json.gz' \
        --output=DIR [--tokenizer=MODEL --pretokenize] [--train_tokenizer=V] [--workers=N]

What the inputs may be and how an interrupted run resumes: data_pipelines/prepare.py.
"""

import json
import os

from absl import flags
from etils import epath

from data_pipelines import prepare, records, storage, tokenizer as tokenizer_lib
from lm.runtime import cli

FLAGS = flags.FLAGS


def main(argv):
  del argv
  if FLAGS.workers < 1:
    raise SystemExit(f"lm-prepare: --workers={FLAGS.workers}: give 1 or more worker processes")
  output = epath.Path(FLAGS.output)
  if output.is_file():
    raise SystemExit(f"lm-prepare: --output={output} is a file; give a directory (it is created if missing)")
  if FLAGS.train_tokenizer and FLAGS.pretokenize:
    raise SystemExit("lm-prepare: --train_tokenizer needs text shards: prepare the text first, then "
                     "pre-tokenize into another directory with --tokenizer=the trained model")
  try:
    totals = _prepare(output)
  except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: SentencePiece's
    if refused := storage.write_refused(e):
      raise SystemExit(f"lm-prepare: {refused}; then run the same command again: it keeps the "
                       f"finished shards and redoes the rest") from e
    raise SystemExit(f"lm-prepare: {e}") from e
  print(json.dumps(totals, indent=1))


def _prepare(output: epath.Path) -> dict:
  """What main() does once the flags are checked; its errors become one line there."""
  splits = {"train": prepare.expand(FLAGS.train), "validation": prepare.expand(FLAGS.validation)}
  for split, files in splits.items():
    if not files:
      raise ValueError(f"--{split}={getattr(FLAGS, split)!r} matches no file")
  totals = prepare.prepare(splits, output, tokenizer=FLAGS.tokenizer, pretokenize=FLAGS.pretokenize,
                           workers=FLAGS.workers)
  if FLAGS.train_tokenizer:
    model = tokenizer_lib.model_path(output, FLAGS.train_tokenizer)
    if not model.exists():
      tokenizer_lib.train(records.shard_paths(output, "train"), model, FLAGS.train_tokenizer)
    print(f"tokenizer: {model}")
  elif FLAGS.tokenizer:
    tok = tokenizer_lib.Tokenizer(FLAGS.tokenizer)
    print(f"tokenizer: {FLAGS.tokenizer}, {tok.vocab_size} pieces (set model.V={tok.vocab_size})")
  return totals


def run():
  flags.DEFINE_string("train", None, "Glob(s), comma-separated, of the train split's input files.")
  flags.DEFINE_string("validation", None, "Glob(s) of the validation split's input files.")
  flags.DEFINE_string("output", None, "Directory of the ArrayRecord shards (data.dir).")
  flags.DEFINE_string("tokenizer", "", "A SentencePiece .model file (local or gs://).")
  flags.DEFINE_bool("pretokenize", False, "Store token ids instead of text (needs --tokenizer).")
  flags.DEFINE_integer(
      "train_tokenizer", 0, "Train a BPE SentencePiece model of this many pieces "
      "on the train split into the output directory (not with --pretokenize).")
  flags.DEFINE_integer("workers", os.cpu_count() or 1, "Worker processes (files in parallel).")
  flags.mark_flags_as_required(["train", "validation", "output"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
