"""SentencePiece tokenizers: training one on a corpus's train split, loading any model file.

For C4 the paper (and NanoDO) use T5's model (configs/c4_50m.py has its path): 32,000 pieces, PAD 0, EOS 1, UNK 2 and
no BOS. Without a BOS the first token of a document is never a target (nothing precedes it to
predict it from); models with a BOS predict it from the BOS.
"""

import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterator

import grain
import numpy as np
import sentencepiece as spm
from etils import epath

from data_pipelines import records, storage

# Ids fixed by our trained models; loaded models report their own (the T5 model has no BOS).
PAD, UNK, BOS, EOS = 0, 1, 2, 3


def model_path(data_dir: str | os.PathLike, vocab_size: int) -> epath.Path:
  return epath.Path(data_dir) / f"spm_bpe_{vocab_size}.model"


def _lines(paths: list[str]) -> Iterator[str]:
  for record in grain.sources.ArrayRecordDataSource(paths):
    for line in records.decode(record)["text"].splitlines():
      if line.strip():
        yield line


def train(paths: list[str], model: epath.Path, vocab_size: int) -> None:
  """Trains a byte-fallback BPE model on the text of the given shards into `model` (local or
  gs://), written whole."""
  # SentencePiece writes local files only: train into a temporary directory, then write the model.
  with tempfile.TemporaryDirectory(prefix="spm-") as tmp_dir:
    prefix = os.path.join(tmp_dir, "model")
    spm.SentencePieceTrainer.train(sentence_iterator=_lines(paths), model_prefix=prefix, model_type="bpe",
                                   vocab_size=vocab_size, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
                                   byte_fallback=True, character_coverage=1.0, num_threads=os.cpu_count() or
                                   1, minloglevel=2)
    storage.write_bytes(model, pathlib.Path(f"{prefix}.model").read_bytes())


class Tokenizer:
  """A loaded SentencePiece model; documents become [BOS] ids [EOS] (BOS only if the model has one)."""

  def __init__(self, path: str | os.PathLike):
    path = epath.Path(path)
    if not path.exists():
      raise FileNotFoundError(
          f"tokenizer model {path} does not exist; set data.tokenizer to a "
          f"SentencePiece .model file or prepare the data (docs/guides/c4_tpu.md, 'Tokenizer')")
    if path.is_dir():
      raise ValueError(f"tokenizer {path} is a directory; set data.tokenizer to a SentencePiece .model "
                       f"file (lm-prepare --train_tokenizer=V writes DIR/spm_bpe_V.model)")
    self.path = path
    proto = path.read_bytes()
    self.sha256 = hashlib.sha256(proto).hexdigest()
    try:
      self.sp = spm.SentencePieceProcessor(model_proto=proto)
    except RuntimeError as e:  # SentencePiece's only word on it is a failed protobuf parse
      raise ValueError(f"tokenizer {path} is not a SentencePiece model; set data.tokenizer to a "
                       f"SentencePiece .model file") from e
    self.vocab_size = self.sp.get_piece_size()
    self.bos, self.eos, self.pad = self.sp.bos_id(), self.sp.eos_id(), max(self.sp.pad_id(), 0)

  def encode(self, text: str) -> np.ndarray:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    """Documents → [BOS] ids [EOS] each, in one SentencePiece call. One thread per call: grain's
    read threads already tokenize groups in parallel, and SentencePiece's own threads gained
    nothing on top of them (docs/results/data_throughput.md)."""
    prefix = [self.bos] if self.bos >= 0 else []
    return [
        np.asarray(prefix + ids + [self.eos], dtype=np.int32) for ids in self.sp.encode(texts, num_threads=1)
    ]

  def encode_prompt(self, text: str) -> np.ndarray:
    """A document's beginning to continue: [BOS] ids, without EOS."""
    return self.encode(text)[:-1]

  def fingerprint(self) -> dict:
    """What pre-tokenized data records of the tokenizer that made it."""
    return {
        "model": os.fspath(self.path),
        "sha256": self.sha256,
        "vocab_size": self.vocab_size,
        "bos": self.bos,
        "eos": self.eos
    }

  def decode(self, ids) -> str:
    return self.sp.decode([int(i) for i in ids])

  def check_vocab(self, model_vocab: int) -> None:
    if model_vocab != self.vocab_size:
      raise ValueError(f"model.V={model_vocab} but the tokenizer {self.path} has {self.vocab_size} "
                       f"pieces; set --config.model.V={self.vocab_size}")

  def __getstate__(self):
    # grain may copy transforms into worker processes; the processor itself does not pickle.
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])
