"""Resolves the `data` config section into the train and validation splits and a tokenizer.

data.source is one of
  shakespeare   the embedded corpus, prepared into data.dir on first use;
  array_record  a directory that `lm-prepare` wrote (text or pre-tokenized ArrayRecord shards);
  c4            TFDS's c4/en:3.1.0 in ArrayRecord format under the TFDS data dir data.dir (local or
                gs://), read with `tfds.data_source`.
"""

import dataclasses
import json
import os

import ml_collections
from etils import epath

from data_pipelines import corpus, records
from data_pipelines.records import Documents
from data_pipelines.tokenizer import Tokenizer, model_path

SOURCES = ("shakespeare", "array_record", "c4")
SPLITS = ("train", "validation")
C4 = "c4/en:3.1.0"


@dataclasses.dataclass
class Splits:
  train: Documents
  validation: Documents
  tokenizer: Tokenizer
  unigram_perplexity: float | None = None  # known for the embedded corpus only


def tfds_split(data_dir: str | os.PathLike, split: str, name: str = C4) -> Documents:
  """A split of a prepared TFDS dataset in ArrayRecord format; one clear error if it is not there."""
  dataset, version = name.split(":")
  builder_dir = epath.Path(data_dir) / dataset / version
  prepare = (f"prepare it with `tfds build {dataset}:{version} --data_dir={data_dir} "
             f"--file_format=array_record` (an Apache Beam job over Common Crawl), or download "
             f"AllenAI's c4/en json.gz shards, convert them with `lm-prepare` and train with "
             f"data.source=array_record (docs/guides/c4_tpu.md)")
  if not (builder_dir / "dataset_info.json").exists():
    raise FileNotFoundError(f"no TFDS dataset {name} in {data_dir}: {builder_dir / 'dataset_info.json'} "
                            f"is missing; point data.dir at the TFDS data dir that holds "
                            f"{dataset}/{version}, or {prepare}")
  stem = dataset.split("/")[0]
  if not list(builder_dir.glob(f"{stem}-{split}.array_record-*")):
    if list(builder_dir.glob(f"{stem}-{split}.tfrecord-*")):
      raise FileNotFoundError(
          f"{builder_dir} holds the '{split}' split as TFRecord, which has no random access; "
          f"convert it once with `tfds convert_format --dataset_dir={builder_dir} "
          f"--out_file_format=array_record --out_dir=NEW_DIR/{dataset}/{version}` and set data.dir "
          f"to NEW_DIR")
    raise FileNotFoundError(f"{builder_dir} has no '{split}' split ({stem}-{split}.array_record-*); "
                            f"{prepare}")
  shards = sorted(builder_dir.glob(f"{stem}-{split}.array_record-*-of-*"))
  if missing := records.missing_shards(shards, split, builder_dir):
    raise FileNotFoundError(
        f"{missing[0]} is missing: the '{split}' split in {builder_dir} has {len(shards)} "
        f"of its {missing[1]} shards; copy it again from where the dataset was built, or "
        f"build it again with `tfds build {dataset}:{version} --data_dir={data_dir} "
        f"--file_format=array_record`")
  # Imported here: TFDS takes seconds to import and is needed by data.source "c4" alone.
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  return Documents(tfds.data_source(name, data_dir=os.fspath(data_dir), split=split), records.TFDS)


def _tokenizer(cfg: ml_collections.ConfigDict, vocab_size: int) -> Tokenizer:
  """data.tokenizer (default: the one trained into data.dir for V, or the one that pre-tokenized
  it); for pre-tokenized data it must be the one that tokenized it."""
  stamp_path = epath.Path(cfg.dir) / records.TOKENIZED_BY
  stamp = json.loads(stamp_path.read_text()) if cfg.source == "array_record" and stamp_path.exists() else None
  if cfg.tokenizer:
    path = cfg.tokenizer
  elif stamp:
    path = stamp["model"]
  elif cfg.source == "c4":
    raise ValueError("data.tokenizer is empty; set it to a SentencePiece .model file, e.g. T5's "
                     "(configs/c4_50m.py)")
  else:
    path = model_path(cfg.dir, vocab_size)
  tokenizer = Tokenizer(path)
  if stamp and stamp["sha256"] != tokenizer.sha256:
    raise ValueError(f"{cfg.dir} was pre-tokenized by {stamp['model']} (sha256 {stamp['sha256'][:12]}…) "
                     f"but data.tokenizer is {path} (sha256 {tokenizer.sha256[:12]}…); set "
                     f"data.tokenizer to the model that tokenized it, or run `lm-prepare` again "
                     f"into another directory with this tokenizer")
  if stamp and "seqio" in stamp and tokenizer.vocab_size != vocab_size:
    made = stamp["seqio"]
    raise ValueError(f"model.V={vocab_size} but {cfg.dir} holds seqio {made['kind']} '{made['task']}', "
                     f"tokenized by its vocabulary {made['vocabulary']} of {tokenizer.vocab_size} "
                     f"ids; set --config.model.V={tokenizer.vocab_size}")
  return tokenizer


def load_tokenizer(cfg: ml_collections.ConfigDict, vocab_size: int) -> Tokenizer:
  """The run's tokenizer as its data pipeline finds it, checked against the model's vocabulary."""
  tokenizer = _tokenizer(cfg, vocab_size)
  tokenizer.check_vocab(vocab_size)
  return tokenizer


def _check_before_preparing(cfg: ml_collections.ConfigDict, vocab_size: int) -> None:
  """The embedded corpus writes its shards and trains a tokenizer of V pieces into data.dir: what
  would refuse the run once that is done is checked first, so nothing is written for a refused run."""
  stamp_path = epath.Path(cfg.dir) / records.TOKENIZED_BY
  if stamp_path.exists():
    stamp = json.loads(stamp_path.read_text())
    size = stamp.get("vocab_size")
    also = f" and --config.model.V={size}" if size not in (None, vocab_size) else ""
    raise ValueError(f"data.dir={cfg.dir} holds shards lm-prepare pre-tokenized with {stamp.get('model')} "
                     f"({size} pieces; model.V={vocab_size}), not the embedded corpus; set "
                     f"--config.data.source=array_record{also}, or point --config.data.dir at another "
                     f"directory")
  if cfg.tokenizer:
    load_tokenizer(cfg, vocab_size)


def resolve(cfg: ml_collections.ConfigDict, vocab_size: int) -> Splits:
  """cfg: the `data` section; vocab_size: the model's V, which the tokenizer must match."""
  if cfg.source not in SOURCES:
    raise ValueError(f"unknown data.source {cfg.source!r}; choose one of: {', '.join(SOURCES)}")
  baseline = None
  if cfg.source == "shakespeare":
    _check_before_preparing(cfg, vocab_size)
    baseline = corpus.prepare(cfg.dir, vocab_size)
  if cfg.source == "c4":
    splits = {s: tfds_split(cfg.dir, s) for s in SPLITS}
  else:
    remedy = corpus.REMEDY if cfg.source == "shakespeare" else records.prepared_remedy
    splits = {s: records.open_split(cfg.dir, s, remedy) for s in SPLITS}
  tokenizer = load_tokenizer(cfg, vocab_size)
  for split, documents in splits.items():
    if not len(documents.source):
      raise ValueError(f"the '{split}' split in {cfg.dir} has no records; prepare it again "
                       f"(docs/guides/c4_tpu.md) or point data.dir at a non-empty directory")
  return Splits(splits["train"], splits["validation"], tokenizer, baseline)
