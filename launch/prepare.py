"""`lm-prepare`: text and JSON(.gz) files → ArrayRecord shards that `data.source=array_record` reads.

    lm-prepare --train='c4/en/c4-train.*.json.gz' --validation='c4/en/c4-validation.*.json.gz' \
        --output=DIR [--tokenizer=MODEL --pretokenize] [--train_tokenizer=V] [--workers=N]
    lm-prepare --seqio_task=NAME [--seqio_module=PKG.MODULE ...] --output=DIR [--seqio_shards=N]

What the inputs may be and how an interrupted run resumes: data_pipelines/prepare.py; a seqio Task or
Mixture (the `seqio` extra): data_pipelines/seqio_prepare.py.
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
  if FLAGS.seqio_task:
    given = [
        f"--{f}" for f in ("train", "validation", "tokenizer", "pretokenize", "train_tokenizer")
        if FLAGS[f].present
    ]
    if given:
      raise SystemExit(
          f"lm-prepare: --seqio_task takes its text and vocabulary from the task; drop {', '.join(given)}")
  elif not (FLAGS.train and FLAGS.validation):
    raise SystemExit("lm-prepare: give --train=GLOB and --validation=GLOB, or --seqio_task=NAME")
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
  if FLAGS.seqio_task:
    return _prepare_seqio(output)
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


def _prepare_seqio(output: epath.Path) -> dict:
  # Imported here: it imports seqio and TensorFlow, which nothing else of ours needs.
  try:
    from data_pipelines import seqio_prepare  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    raise ValueError(f"--seqio_task needs the seqio extra ({e}): pip install -e '.[seqio]', in a venv of "
                     f"its own (docs/guides/seqio.md)") from e
  splits = seqio_prepare.parse_splits(FLAGS.seqio_splits)
  totals = seqio_prepare.prepare_task(FLAGS.seqio_task, output, modules=FLAGS.seqio_module, splits=splits,
                                      shards=seqio_prepare.parse_shards(FLAGS.seqio_shards, list(splits)),
                                      workers=FLAGS.workers, length=FLAGS.seqio_sequence_length,
                                      tfds_data_dir=FLAGS.seqio_tfds_data_dir)
  tok = tokenizer_lib.Tokenizer(output / seqio_prepare.VOCABULARY)
  print(f"vocabulary: {tok.path}, {tok.vocab_size} ids (set model.V={tok.vocab_size})")
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
  flags.DEFINE_integer("workers", os.cpu_count() or 1, "Worker processes (files or shards in parallel).")
  flags.DEFINE_string("seqio_task", None, "A registered seqio Task or Mixture to prepare instead of files "
                      "(the seqio extra).")
  flags.DEFINE_multi_string("seqio_module", [], "A module that registers seqio tasks (PKG.MODULE); repeat "
                            "for more.")
  flags.DEFINE_string(
      "seqio_splits", "train,validation", "Splits to write, comma-separated; OURS=THEIRS "
      "takes our split from another of the task's (validation=test).")
  flags.DEFINE_string(
      "seqio_shards", "8", "Shards per split, each seqio.ShardInfo(i, N) of the task: N, or "
      "SPLIT=N pairs (train=1024,validation=8; at most a split's files, or each shard reads them all).")
  flags.DEFINE_integer(
      "seqio_sequence_length", 0, "Targets length for tasks whose preprocessors need one "
      "(seqio trims to it); 0: none, whole documents.")
  flags.DEFINE_string("seqio_tfds_data_dir", "",
                      "TFDS data dir the task's TFDS sources read (default: TFDS's).")
  flags.mark_flags_as_required(["output"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
