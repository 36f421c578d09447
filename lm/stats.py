"""Mean and standard error, for every average the package reports.

`Moments` holds (count, mean, m2 = Σ w (x - mean)²) of weighted values, elementwise over arrays.
A batch's moments are computed in two passes (mean, then centred squares), and batches are combined
with the parallel merge of Chan, Golub & LeVeque (1979), so no Σx² - n·mean² cancellation loses the
variance when the mean is large next to the spread. The same numbers serve a token-weighted
evaluation (one Moments per batch, merged in float64) and a mean over seeds (`mean_stderr`).
"""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Moments(NamedTuple):
  count: np.ndarray
  mean: np.ndarray
  m2: np.ndarray

  @classmethod
  def of(cls, x, weights=None, axis=None, xp=np) -> "Moments":
    """Moments of x (with 0/1 or real weights) reduced over `axis`; xp=jax.numpy inside jit."""
    w = xp.ones_like(x) if weights is None else weights.astype(x.dtype)
    count = w.sum(axis)
    mean = (w * x).sum(axis) / xp.maximum(count, 1e-30)
    centred = x - (mean if axis is None else xp.expand_dims(mean, axis))
    return cls(count, mean, (w * centred**2).sum(axis))

  @classmethod
  def from_sums(cls, total, total_sq, count) -> "Moments":
    """From Σx, Σx² and n; exact only while Σx² is not much larger than the spread (values of
    order one), so prefer `of` and `merge` where the values are at hand."""
    mean = total / max(count, 1e-30)
    return cls(count, mean, max(total_sq - count * mean**2, 0.0))

  def merge(self, other: "Moments") -> "Moments":
    n = self.count + other.count
    frac = other.count / np.maximum(n, 1e-30)
    delta = other.mean - self.mean
    return Moments(n, self.mean + delta * frac, self.m2 + other.m2 + delta**2 * self.count * frac)

  @property
  def stderr(self):
    """Standard error of the mean: sample standard deviation (n - 1) / sqrt(n); nan below 2 values."""
    n = np.asarray(self.count, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(n > 1, np.sqrt(self.m2 / np.maximum(n - 1, 1) / np.maximum(n, 1)), np.nan)


def merge_all(parts: Sequence[Moments]) -> Moments:
  """One Moments of many (e.g. per-batch, fetched from the device), merged in float64."""
  parts = [Moments(*(np.asarray(v, np.float64) for v in p)) for p in parts]
  total = parts[0]
  for p in parts[1:]:
    total = total.merge(p)
  return total


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean and standard error of the mean of a sample, e.g. one metric over seeds; None for one value."""
  m = Moments.of(np.asarray(values, np.float64))
  return float(m.mean), (float(m.stderr) if m.count > 1 else None)
