"""The paper's C4 run (docs/reference/paper.md, section 6): ~52M parameters, 130B tokens, a 16-chip v5e slice.

data.source picks how C4 is held (docs/guides/c4_tpu.md):
  "c4"            TFDS's c4/en:3.1.0 in ArrayRecord format; data.dir is the TFDS data dir (local or
                  gs://) that holds c4/en/3.1.0/;
  "array_record"  shards that `lm-prepare` made from AllenAI's c4-train.*.json.gz files, as text or
                  pre-tokenized (then data.tokenizer must be the model that tokenized them).

Launch: `lm-launch tpu up -- lm-train --config=configs/c4_50m.py --workdir=gs://BUCKET/run
--config.model.attention=hyla --config.data.dir=gs://BUCKET/tensorflow_datasets`.
"""

from configs import base

TOKENS = 130e9
# T5's SentencePiece model (NanoDO's vocabulary): 32,000 pieces, no BOS; the 100 extra ids of its
# name are T5's sentinel tokens, added by T5's code, not pieces of this file, and unused here.
T5_VOCAB = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"


def get_config():
  c = base.get_config()
  # 6 layers, width 512, 8 heads of 64, MLP 2048, GELU, rotary, pre-norm, untied output:
  # 51,655,680 parameters (lm-train prints the count at start).
  c.model.update(V=32_000, D=512, H=8, L=6, F=2048, positions="rotary", tied_embeddings=False, max_len=512,
                 dtype="bfloat16")
  # Each q and k rotation's partner comes from a second product rather than from slicing q and k, so
  # XLA fuses the rotation into the projections; the MLP is not recomputed in the backward pass
  # (model.remat=mlp), which costs more than it saves. Both by the v5e estimate in
  # docs/results/compile_v5e.md.
  c.model.rope_by_product = True
  c.data.update(source="c4", dir="gs://BUCKET/tensorflow_datasets", tokenizer=T5_VOCAB, seq_len=512,
                threads=8)
  # AdamW, 1000 warmup steps, cosine decay to 0.1x the peak (NanoDO's defaults).
  c.train.update(batch_size=256, lr=1.6e-3, warmup_steps=1000, end_lr_frac=0.1, log_every_steps=100)
  # The step count follows from the token budget: 130e9 / (256 x 512) = 991,821 steps.
  c.train.steps = int(TOKENS // (c.train.batch_size * c.data.seq_len))
  # The paper's 16 chips (v5e-16: 4 hosts of 4); elsewhere set --config.mesh.data=-1.
  # The state split over the 16 chips (ZeRO style): each chip's optimiser update then reads and writes
  # a sixteenth of the state (docs/results/compile_v5e.md).
  c.mesh.update(data=16, fsdp=1, tensor=1, shard_state_over_data=True)
  c.checkpoint.update(every_steps=2000, keep=3, keep_every=100_000)
  c.eval.update(every_steps=10_000, batch_size=256)
  return c
