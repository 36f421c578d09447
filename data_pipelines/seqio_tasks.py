"""seqio Tasks of ours, registered when this module is imported (`lm-prepare --seqio_task` imports it;
a user's task module may too). Imports seqio and TensorFlow: only the prepare step imports it.

`c4_v310_lm` is the T5 ecosystem's decoder-only C4 task (`c4_v220_full_lm` of T5's task registry)
on TFDS c4/en:3.1.0, the version data.source=c4 reads, with the same vocabulary (T5's
cc_all.32000.100extra SentencePiece model, as configs/c4_50m.py) and the same preprocessors up to
whole documents: the text rekeyed to `targets`, tokenized, then EOS appended. It stops there:
full_lm's last steps concatenate documents and split them into rows, which is packing, and lm-train
packs itself with segment ids, so that nothing is predicted across documents.
"""

import functools

import seqio

C4 = "c4/en:3.1.0"
C4_TASK = "c4_v310_lm"
T5_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"


def c4_preprocessors() -> list:
  """C4's text → its token ids and EOS, in `targets` (`inputs` empty, as in T5's LM tasks)."""
  return [
      functools.partial(seqio.preprocessors.rekey, key_map={
          "inputs": None,
          "targets": "text"
      }),
      seqio.preprocessors.tokenize,
      seqio.CacheDatasetPlaceholder(),
      seqio.preprocessors.append_eos,
  ]


def register_c4(name: str = C4_TASK, *, vocabulary: str = T5_VOCABULARY,
                source: seqio.DataSource | None = None) -> seqio.Task:
  """Registers the C4 task as `name` over `source` (default: TFDS c4/en:3.1.0) with the SentencePiece
  model file `vocabulary`; the tests register it over local documents with a local model."""
  targets = seqio.Feature(vocabulary=seqio.SentencePieceVocabulary(vocabulary), add_eos=True)
  return seqio.TaskRegistry.add(name, source=source or seqio.TfdsDataSource(tfds_name=C4),
                                preprocessors=c4_preprocessors(), output_features={"targets": targets},
                                metric_fns=[])


register_c4()
