"""A seqio Task or Mixture → token-id ArrayRecord shards, the form `lm-prepare --pretokenize` writes
(the library of `lm-prepare --seqio_task`, whose command line is launch/prepare.py).

The modules that register the user's tasks are imported (and ours, data_pipelines/seqio_tasks.py),
then each split becomes N shards (N per split): shard i holds what seqio gives for
`seqio.ShardInfo(i, N)`, from the task's own source, preprocessors and vocabulary, one pass,
unshuffled (lm-train shuffles, packs and splits it between hosts itself). A record is one `targets`
sequence as the task ends it. A pool of worker processes writes the shards; a shard is done once its
stats file exists, so a rerun keeps the finished ones. The vocabulary's SentencePiece model, as seqio
tokenizes with it (extra ids included), is written into the directory, and DIR/tokenized_by.json
names it, its size and the task, so that training checks model.V against it.

Imports seqio and TensorFlow: of the commands, only `lm-prepare --seqio_task` imports this module.
"""

import contextlib
import difflib
import functools
import hashlib
import importlib
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np
from etils import epath

from data_pipelines import prepare, records, storage, tokenizer as tokenizer_lib


@contextlib.contextmanager
def _native_stderr_discarded():
  saved = os.dup(2)
  try:
    with open(os.devnull, "w", encoding="utf-8") as null:
      os.dup2(null.fileno(), 2)
      yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


# TensorFlow's native libraries print banners (oneDNN, CUDA drivers looked for) as they load, before
# any setting of theirs can stop them: lm-prepare's own lines are then the only ones a user reads.
with _native_stderr_discarded():
  import seqio

  from data_pipelines import seqio_tasks

VOCABULARY = "seqio_vocabulary.model"  # the targets vocabulary's model, in the prepared directory
SPLITS = {"train": "train", "validation": "validation"}  # our split → the task's


def parse_splits(text: str) -> dict[str, str]:
  """`train,validation=test` → {"train": "train", "validation": "test"}: our split = the task's."""
  pairs = [item.split("=", 1) if "=" in item else (item, item) for item in filter(None, text.split(","))]
  return {ours.strip(): theirs.strip() for ours, theirs in pairs}


def parse_shards(text: str, splits: Sequence[str]) -> dict[str, int]:
  """`64`: 64 shards of each split; `train=1024,validation=8`: per split (8 for a split not named)."""
  try:
    pairs = [item.split("=", 1) for item in filter(None, text.split(","))] if "=" in text else []
    counts = {**dict.fromkeys(splits, 8), **{k.strip(): int(v) for k, v in pairs}}
    if not pairs:
      counts = dict.fromkeys(splits, int(text))
  except ValueError:
    counts = {}
  if set(counts) != set(splits) or min(counts.values()) < 1:
    raise ValueError(f"--seqio_shards={text}: give a count of 1 or more for each split, or SPLIT=COUNT "
                     f"pairs of the splits {', '.join(splits)}")
  return counts


def _is(task_or_mixture) -> str:
  return "mixture" if isinstance(task_or_mixture, seqio.Mixture) else "task"


def _kind(task_or_mixture) -> str:
  return f"seqio {_is(task_or_mixture)} '{task_or_mixture.name}'"


def import_modules(modules: Sequence[str], name: str) -> None:
  """Imports the modules that register the tasks; one that fails is a ValueError naming the fix."""
  for module in modules:
    try:
      importlib.import_module(module)
    except Exception as e:  # pylint: disable=broad-except  # whatever the module raises
      fix = ("install it, or put the folder that holds it on PYTHONPATH" if isinstance(
          e, ModuleNotFoundError) else "fix the module")
      raise ValueError(f"--seqio_module={module} (for --seqio_task={name}) does not import: "
                       f"{type(e).__name__}: {e}; {fix}") from e


def find(name: str) -> seqio.Task | seqio.Mixture:
  """The registered Task or Mixture `name`; an unknown one is a ValueError listing near names."""
  names = sorted({*seqio.TaskRegistry.names(), *seqio.MixtureRegistry.names()})
  if name in names:
    return seqio.get_mixture_or_task(name)
  near = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
  listed = f"near names: {', '.join(near)}" if near else f"registered: {', '.join(names[:10])}"
  raise ValueError(f"no seqio task or mixture '{name}' is registered ({listed}); give the name as its "
                   f"module registers it, and --seqio_module=PKG.MODULE for each module that registers it")


@functools.cache
def provider(name: str, modules: tuple[str, ...], tfds_data_dir: str = "") -> seqio.Task | seqio.Mixture:
  """The Task or Mixture, once per process (the main one and each worker)."""
  if tfds_data_dir:
    seqio.set_tfds_data_dir_override(tfds_data_dir)
  import_modules(modules, name)
  return find(name)


def _fix(task_or_mixture) -> str:
  """What to do when reading a task fails: for TFDS sources, where seqio looks for the data."""
  tfds = [
      t.source.tfds_dataset
      for t in seqio.get_subtasks(task_or_mixture)
      if isinstance(t.source, seqio.TfdsDataSource)
  ]
  if tfds:
    where = tfds[0].data_dir or "the default TFDS data dir"
    return (f"it reads TFDS {tfds[0].name} from {where}: build it there first (`tfds build`; seqio reads "
            f"TFDS through tf.data, so TFRecord files, not ArrayRecord), or give --seqio_tfds_data_dir=DIR "
            f"where it is built")
  return "fix the task's source or preprocessors, then run the same command again: it keeps finished shards"


def vocabulary(task_or_mixture) -> seqio.SentencePieceVocabulary:
  """The vocabulary of `targets`, checked: every task has that feature, of token ids, tokenized by one
  SentencePiece model (training reads its .model file)."""
  found = {}
  for task in seqio.get_subtasks(task_or_mixture):
    where = f"seqio task '{task.name}'" + (f" (of {_kind(task_or_mixture)})"
                                           if task is not task_or_mixture else "")
    feature = task.output_features.get("targets")
    if feature is None:
      raise ValueError(f"{where} has no 'targets' output feature (it has: "
                       f"{', '.join(task.output_features) or 'none'}); lm-prepare reads a decoder-only "
                       f"task's targets: rekey its text to 'targets' and tokenize it, as "
                       f"{seqio_tasks.C4_TASK} in data_pipelines/seqio_tasks.py does")
    if not isinstance(feature.vocabulary, seqio.SentencePieceVocabulary) or feature.rank != 1:
      raise ValueError(f"{where}: its 'targets' are {type(feature.vocabulary).__name__} ids of rank "
                       f"{feature.rank}; lm-prepare needs rank-1 ids of a seqio.SentencePieceVocabulary "
                       f"(training reads its .model file)")
    found[(feature.vocabulary.sentencepiece_model_file, feature.vocabulary.extra_ids)] = feature.vocabulary
  if len(found) > 1:
    raise ValueError(f"the tasks of {_kind(task_or_mixture)} tokenize 'targets' with {len(found)} "
                     f"vocabularies ({', '.join(f for f, _ in found)}); a run trains on one: give its "
                     f"tasks one vocabulary")
  return next(iter(found.values()))


def _check_splits(task_or_mixture, splits: dict[str, str]) -> None:
  try:
    have = task_or_mixture.splits
  except Exception as e:  # pylint: disable=broad-except  # a TFDS source not built, among others
    raise ValueError(f"{_kind(task_or_mixture)} cannot list its splits ({e}); {_fix(task_or_mixture)}") from e
  for ours, theirs in splits.items():
    if theirs not in have:
      raise ValueError(f"{_kind(task_or_mixture)} has no split '{theirs}' (its splits: "
                       f"{', '.join(sorted(have))}); give --seqio_splits=train,{ours}=SPLIT to take "
                       f"our '{ours}' split from one of its")


def _source(name: str, split: str, index: int, count: int) -> str:
  """What a shard is made from, as its stats record it (a rerun keeps it only for the same)."""
  return f"seqio '{name}', split '{split}', shard {index + 1} of {count}"


def _targets(task_or_mixture, split: str, shard: seqio.ShardInfo, length: int,
             stats: dict) -> Iterator[np.ndarray]:
  mixture = {"copy_pretokenized": True} if isinstance(task_or_mixture, seqio.Mixture) else {}
  ds = task_or_mixture.get_dataset(sequence_length={"targets": length} if length else None, split=split,
                                   shuffle=False, shard_info=shard, num_epochs=1, **mixture)
  vocab = task_or_mixture.output_features["targets"].vocabulary
  for example in ds.as_numpy_iterator():
    ids = example["targets"]
    if not len(ids):
      continue  # no token to train on
    # Bits per byte count the text's bytes; a task that dropped its text (one that packs) counts what
    # its ids decode to.
    text = example.get("targets_pretokenized")
    stats["bytes"] += len(text) if isinstance(text, bytes) else len(vocab.decode(ids.tolist()).encode())
    stats["documents"] += 1
    stats["tokens"] += len(ids)
    yield ids


def convert(job: tuple[str, str, str, int, int], *, name: str, modules: tuple[str, ...], length: int,
            tfds_data_dir: str) -> dict:
  """Writes one shard of a split (unless done before); returns its stats."""
  shard, split, their_split, index, count = job
  shard = epath.Path(shard)
  stats_file = records.stats_path(shard)
  if stats_file.exists():
    return {"split": split, "skipped": True, **json.loads(stats_file.read_text())}
  task_or_mixture = provider(name, modules, tfds_data_dir)
  stats = {"source": _source(name, their_split, index, count), "documents": 0, "bytes": 0, "tokens": 0}
  try:
    targets = _targets(task_or_mixture, their_split, seqio.ShardInfo(index, count), length, stats)
    records.write_shard(shard, targets, records.to_ids)
  except OSError:
    raise  # the output's: lm-prepare names it and how to resume
  except Exception as e:  # pylint: disable=broad-except  # TensorFlow's and the task's own errors
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"{_kind(task_or_mixture)}, split '{their_split}' (shard {index + 1} of {count}): "
                     f"{reason}; {_fix(task_or_mixture)}") from e
  records.write_stats(shard, stats)  # last: the shard is done only once its stats exist
  return {"split": split, "skipped": False, **stats}


def _check_made_from(jobs: list[tuple[str, str, str, int, int]], name: str) -> None:
  for shard, _, their_split, index, count in jobs:
    stats_file = records.stats_path(epath.Path(shard))
    if stats_file.exists() and (saved := json.loads(stats_file.read_text())["source"]) != _source(
        name, their_split, index, count):
      raise ValueError(f"{epath.Path(shard).name} in {epath.Path(shard).parent} was made from {saved}, not "
                       f"from {_source(name, their_split, index, count)}: the directory holds another "
                       f"preparation; use an empty --output directory, or give the task it was made from")


def _model_bytes(task_or_mixture, vocab: seqio.SentencePieceVocabulary) -> bytes:
  """The vocabulary's SentencePiece model as seqio tokenizes with it (extra ids added)."""
  try:
    return vocab.sp_model
  except Exception as e:  # pylint: disable=broad-except  # tf.io.gfile's errors
    raise ValueError(f"{_kind(task_or_mixture)}: its vocabulary {vocab.sentencepiece_model_file} cannot be "
                     f"read ({type(e).__name__}: {str(e).strip()[:200]}); make it readable from here") from e


def _write_vocabulary(output: epath.Path, task_or_mixture, vocab: seqio.SentencePieceVocabulary,
                      model_bytes: bytes) -> None:
  """The vocabulary's model into output, and tokenized_by.json naming it, its size and the task."""
  model = output / VOCABULARY
  if not model.exists() or model.read_bytes() != model_bytes:  # not there, or left by a refused run
    storage.write_bytes(model, model_bytes)
  # An absolute path: training may start in another directory.
  tok = tokenizer_lib.Tokenizer(model if "://" in os.fspath(model) else os.path.abspath(model))
  made = {
      "task": task_or_mixture.name,
      "kind": _is(task_or_mixture),
      "vocabulary": vocab.sentencepiece_model_file,
      "extra_ids": vocab.extra_ids
  }
  stamp = {**tok.fingerprint(), "seqio": made}
  storage.write_bytes(output / records.TOKENIZED_BY, json.dumps(stamp, indent=1).encode())


def prepare_task(name: str, output: epath.Path, *, modules: Sequence[str] = (),
                 splits: dict[str, str] = SPLITS, shards: dict[str, int] | None = None, workers: int = 1,
                 length: int = 0, tfds_data_dir: str = "", progress: bool = True) -> dict[str, dict]:
  """Writes shards[split] shards (default 8) of each split of the task or mixture `name` into output
  (`splits`: our split → the task's; `length`: the targets length for tasks whose preprocessors need one, which seqio
  then trims to); returns per-split totals."""
  modules, shards = tuple(modules), shards or dict.fromkeys(splits, 8)
  task_or_mixture = provider(name, modules, tfds_data_dir)
  vocab = vocabulary(task_or_mixture)
  _check_splits(task_or_mixture, splits)
  model_bytes = _model_bytes(task_or_mixture, vocab)
  output.mkdir(parents=True, exist_ok=True)
  (output / "stats").mkdir(exist_ok=True)
  # What output holds of another preparation refuses the run before anything is written.
  prepare.check_output(output, hashlib.sha256(model_bytes).hexdigest(), shards)
  jobs = [(os.fspath(output / records.shard_name(split, i, shards[split])), split, theirs, i, shards[split])
          for split, theirs in splits.items()
          for i in range(shards[split])]
  _check_made_from(jobs, name)
  _write_vocabulary(output, task_or_mixture, vocab, model_bytes)
  totals = {s: {"shards": shards[s], "documents": 0, "bytes": 0, "tokens": 0, "skipped": 0} for s in splits}
  work = functools.partial(convert, name=name, modules=modules, length=length, tfds_data_dir=tfds_data_dir)
  return prepare.run_jobs(work, jobs, [job[0] for job in jobs], totals, workers=workers, progress=progress)
