"""Generates text from a checkpoint: `lm-sample --workdir=DIR [--step=S] --prompt=TEXT|--prompt_file=F
[--max_new_tokens=N --temperature=T --top_k=K --top_p=P --seed=S --num_samples=N]`.

Restores the parameters sharded over the devices present (as lm-evaluate does), tokenizes the prompt with
the run's tokenizer ([BOS] and its pieces: an empty prompt starts from BOS alone when the tokenizer
has one), and decodes the samples as one batch (lm/decode.py). Each sample is printed after a header
line, as the prompt followed by its continuation, cut at the first end-of-document token.
"""

from absl import flags
from etils import epath

from data_pipelines import sources
from eval import evaluate
from lm import checkpointing, decode
from lm.runtime import cli


def sample(workdir: str, prompt: str, *, step: int | None = None, max_new_tokens: int = 64,
           sampling: decode.Sampling, seed: int = 0, num_samples: int = 1,
           attention_impl: str | None = None) -> list[str]:
  """The prompt followed by each sample's continuation, up to the first end-of-document token;
  `attention_impl` replaces the run's kernel, as in lm-evaluate."""
  step, config = checkpointing.saved_config(workdir, step)
  if config.task != "lm":
    raise ValueError(f"this checkpoint is of task {config.task!r}, which does not generate text; "
                     f"sample from a language model's run (task lm)")
  exp = evaluate.experiment_here(config, attention_impl)
  tokenizer = sources.load_tokenizer(config.data, exp.model_cfg.V)
  prompt_ids = tokenizer.encode_prompt(prompt)
  decode.check_context(len(prompt_ids), max_new_tokens, config.data.seq_len)
  _, params = checkpointing.load(workdir, step, exp.abstract_sharded_state())
  new_ids = decode.generate(exp.model_cfg, params, prompt_ids, max_new_tokens=max_new_tokens,
                            context=config.data.seq_len, sampling=sampling, seed=seed,
                            num_samples=num_samples)
  texts = []
  for row in new_ids.tolist():
    if tokenizer.eos in row:
      row = row[:row.index(tokenizer.eos)]
    texts.append(tokenizer.decode([*prompt_ids, *row]))
  return texts


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  if (FLAGS.prompt is None) == (FLAGS.prompt_file is None):
    raise SystemExit("lm-sample: give exactly one of --prompt=TEXT and --prompt_file=FILE")
  try:
    prompt = FLAGS.prompt if FLAGS.prompt is not None else epath.Path(FLAGS.prompt_file).read_text()
  except OSError as e:  # missing, a directory, unreadable
    raise SystemExit(f"lm-sample: --prompt_file={FLAGS.prompt_file}: {e.strerror or e}; give a text "
                     f"file") from e
  except UnicodeDecodeError as e:  # a binary file
    raise SystemExit(f"lm-sample: --prompt_file={FLAGS.prompt_file}: not UTF-8 text (byte "
                     f"0x{e.object[e.start]:02x} at offset {e.start}); give a text file") from e
  try:
    sampling = decode.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    texts = sample(FLAGS.workdir, prompt, step=FLAGS.step, max_new_tokens=FLAGS.max_new_tokens,
                   sampling=sampling, seed=FLAGS.seed, num_samples=FLAGS.num_samples,
                   attention_impl=FLAGS.attention_impl)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"lm-sample: {e}") from e
  for i, text in enumerate(texts):
    print(f"--- sample {i} ---\n{text}")


def run():
  flags.DEFINE_string("workdir", None, "A training run's directory (lm-train --workdir).")
  flags.DEFINE_integer("step", None, "Checkpoint step to sample from; default: the latest.")
  flags.DEFINE_string("prompt", None, "Text to continue (may be empty: then BOS, if the tokenizer has one).")
  flags.DEFINE_string("prompt_file", None, "A file whose text to continue, instead of --prompt.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate; prompt plus these must fit data.seq_len.")
  flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0 decodes greedily.")
  flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens only; 0: all.")
  flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens holding this much probability; 1: all.")
  flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed gives the same samples.")
  flags.DEFINE_integer("num_samples", 1, "Samples of the prompt, decoded as one batch.")
  flags.DEFINE_string(evaluate.ATTENTION_IMPL, None, evaluate.ATTENTION_IMPL_HELP)
  flags.mark_flags_as_required(["workdir"])
  cli.run(main, __name__)


if __name__ == "__main__":
  run()
