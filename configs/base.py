"""Defaults every experiment builds on. Field letters follow NanoDO: V, D, H, L, F."""

import ml_collections

from lm import model as model_lib


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = "lm"  # a name in lm.tasks.TASKS
  # Every field of lm.model.ModelConfig, with its defaults (defined there only), at the paper's C4 model
  # size; `attention` is a name in lm.attention.PRESETS, or one per layer / a repeating pattern
  # ("hyla,hyla,hyla,softmax"; lm.model.layer_presets).
  c.model = ml_collections.ConfigDict(
      dict(model_lib.ModelConfig.defaults(), V=32_000, D=512, H=8, L=6, F=2048))
  c.data = ml_collections.ConfigDict(
      dict(
          source="shakespeare",  # the embedded corpus, prepared into `dir` on first use
          dir="data/shakespeare",
          tokenizer="",  # a SentencePiece .model; empty: the one trained in `dir` for model.V
          seq_len=512,
          shards=0,  # logical data shards; 0: one per process (see lm/train.py HostData)
          packing_bins=64,
          threads=2,
      ))
  c.train = ml_collections.ConfigDict(
      dict(
          steps=10_000,
          batch_size=256,  # global, in rows of seq_len tokens
          lr=1.6e-3,
          warmup_steps=1000,
          end_lr_frac=0.1,
          schedule="cosine",  # or "cosine_paper_code" (lm/optimizer.py)
          b1=0.9,
          b2=0.98,
          eps=1e-9,
          weight_decay=0.1,
          grad_clip=1.0,  # grad_clip 0: none
          microbatches=1,  # gradient accumulation: the batch is processed in this many parts
          # Language modelling's loss: "xla", "pallas" or "pallas_keep_logits" (TPU), "fused" or "auto".
          cross_entropy_impl="auto",
          on_nonfinite="stop",  # or "skip": a non-finite loss/gradient leaves the state unchanged
          log_every_steps=50,
      ))
  # Device mesh: the product must equal the device count; -1 takes what the others leave.
  # shard_state_over_data (a mesh of data alone): parameters and optimiser moments stored split over
  # the data axis, ZeRO style; each step gathers the parameters whole and scatters the summed
  # gradients back to the shards, so each device updates only its share of the state.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, shard_state_over_data=False))
  c.checkpoint = ml_collections.ConfigDict(
      dict(
          every_steps=1000,
          keep=3,  # the latest K checkpoints
          keep_every=0,  # also keep every step divisible by this (0: none)
          use_async=True,  # write in the background while training continues
          skip_damaged=False,  # resume from the newest readable step, moving damaged ones aside
      ))
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=1000,
      batch_size=64,  # global rows per evaluation step
  ))
  # JAX's persistent compilation cache, so that a restarted run skips compiling: "" keeps it in
  # WORKDIR/compilation_cache; "none" turns it off; any other value is its directory (gs:// too).
  c.compilation_cache = ""
  # XLA's CPU backend only: the operations it hands to the YNNPACK library, from "dot", "eltwise"
  # and "reduce" ("" keeps XLA's own choice, which varies by jax version: products and reductions in
  # jax 0.10.2). Handing it the element-wise work and reductions around the products as well takes
  # out most of the layout copies XLA makes between them (docs/results/nanodo_throughput.md).
  c.cpu_library_fusion = "dot,eltwise,reduce"
  # XLA's CPU backend only: run the host as this many devices, which the mesh's data axis then splits
  # each batch over (0: JAX's default, one device whose operations share the cores). Small arrays
  # keep cores idle inside one device's operations; whole batches on separate devices do not. Set
  # before JAX starts; a device count forced in XLA_FLAGS, or a JAX already started, wins.
  c.cpu_devices = 0
  # Hang watchdog of lm-train: when no step completes within step_secs, every thread's stack goes to
  # the log and the process exits with status 75, for a restart (0: off). The first step and each
  # evaluation may compile: they get first_step_secs.
  c.watchdog = ml_collections.ConfigDict(dict(step_secs=1800.0, first_step_secs=7200.0))
  # The run log (metrics/ and TensorBoard) is always written; Weights & Biases too when
  # wandb_project is set (the `wandb` extra). wandb_dir: its local files ("": the current directory).
  c.metrics = ml_collections.ConfigDict(
      dict(wandb_project="", wandb_entity="", wandb_mode="online", wandb_dir=""))
  return c
