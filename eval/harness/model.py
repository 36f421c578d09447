"""Our model behind the harness's model interface: its three request kinds on scoring.py.

Text becomes tokens as the harness's own Hugging Face model does it: a context's trailing spaces move
to the continuation, the continuation's tokens are those the whole text has beyond the context's, and
the first token is predicted from a prefix token (the tokenizer's BOS, or its EOS when it has none).
Rolling log-likelihood cuts a document into windows of the trained context with the harness's own
window helpers, each token predicted once with as much context as a window allows.
"""

import lm_eval.api.model
import numpy as np
from lm_eval import utils as lm_eval_utils
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from data_pipelines.tokenizer import Tokenizer
from eval.harness import scoring


class HarnessLM(lm_eval.api.model.LM):
  """scorer: the restored model (scoring.Scorer); tokenizer: the run's own."""

  def __init__(self, scorer: scoring.Scorer, tokenizer: Tokenizer):
    super().__init__()
    self.scorer, self.sp = scorer, tokenizer
    self.seq_len = scorer.seq_len
    self.prefix = tokenizer.bos if tokenizer.bos >= 0 else tokenizer.eos

  def encode(self, text: str) -> list[int]:
    return self.sp.sp.encode(text)

  def pair(self, context: str, continuation: str) -> scoring.Request:
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
      return scoring.request([self.prefix], self.encode(continuation), self.seq_len)
    whole, head = self.encode(context + continuation), self.encode(context)
    return scoring.request([self.prefix, *head], whole[len(head):], self.seq_len)

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    return self.scorer.score([self.pair(*r.args) for r in requests])

  def rolling_requests(self, text: str) -> list[scoring.Request]:
    """The windows of a document: every token scored once."""
    windows = lm_eval_utils.get_rolling_token_windows(token_list=self.encode(text), prefix_token=self.prefix,
                                                      max_seq_len=self.seq_len, context_len=1)
    return [
        scoring.request(context, continuation, self.seq_len)
        for context, continuation in map(lm_eval_utils.make_disjoint_window, windows)
    ]

  def loglikelihood_rolling(self, requests) -> list[float]:
    windows = [self.rolling_requests(r.args[0]) for r in requests]
    scores = self.scorer.score([w for mine in windows for w in mine])
    out, at = [], 0
    for mine in windows:
      out.append(float(np.sum([s for s, _ in scores[at:at + len(mine)]])))
      at += len(mine)
    return out

  def generate(self, context: str, until: list[str], max_gen_toks: int) -> str:
    """Greedy continuation of context up to the first stop sequence, the end-of-document token or
    max_gen_toks tokens. Prompt and continuation share the trained context: a long prompt keeps its
    last tokens, at least half the context, and the continuation gets what is left."""
    prompt = [self.prefix, *self.encode(context)]
    keep = min(len(prompt), max(self.seq_len - max_gen_toks, self.seq_len // 2))
    prompt, max_new = prompt[len(prompt) - keep:], min(max_gen_toks, self.seq_len - keep)
    prompt_text = self.sp.decode(prompt)

    def text(new: list[int]) -> str:
      if self.sp.eos in new:
        new = new[:new.index(self.sp.eos)]
      whole = self.sp.decode([*prompt, *new])
      return whole[len(prompt_text):] if whole.startswith(prompt_text) else self.sp.decode(new)

    def stop(new: list[int]) -> bool:
      return new[-1] == self.sp.eos or any(s and s in text(new) for s in until)

    out = text(self.scorer.generate(prompt, max_new, stop))
    for s in until:
      if s:
        out = out.split(s)[0]
    return out

  def generate_until(self, requests) -> list[str]:
    out = []
    for r in requests:
      context, gen_kwargs = r.args
      kwargs = normalize_gen_kwargs(dict(gen_kwargs))
      if kwargs.get("do_sample"):
        raise ValueError("lm-harness decodes greedily; this task asks for sampling (do_sample=True)")
      until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
      out.append(self.generate(context, until, int(kwargs.pop("max_gen_toks"))))
    return out
