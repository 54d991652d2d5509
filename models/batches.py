"""The corpus and its batches: the text of the Python standard library's modules (or a file or
directory of text), bytes as tokens; the batch of step s drawn from (seed, s) alone, so that a
resumed run sees the batches an unstopped one would; and the batch placed on the mesh."""

from __future__ import annotations

import hashlib
import pathlib
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from models import llama
from models.hparams import TrainConfig, UsageError

CORPUS_BYTES = 8 << 20  # the standard library's first 8 MiB of module text, in path order


def corpus(path: str | None = None, limit: int = CORPUS_BYTES) -> tuple[np.ndarray, str]:
  """(the bytes, as uint8; what they are): ``path`` (a file, or a directory's files in path
  order), else the Python standard library's module text. At most ``limit`` bytes."""
  if path is None:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    described = f"the Python {sys.version_info.major}.{sys.version_info.minor} standard library"
  else:
    root = pathlib.Path(path)
    if not root.exists():
      raise UsageError(f"--corpus {path}: no such file or directory")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    described = str(path)
  chunks, size = [], 0
  for file in files:
    if size >= limit:
      break
    chunks.append(file.read_bytes()[:limit - size])
    size += len(chunks[-1])
  data = np.frombuffer(b"".join(chunks), np.uint8)
  return data, f"{described}: {len(data)} bytes"


def fingerprint(data: np.ndarray) -> str:
  return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def batch_at(data: np.ndarray, step: int, tc: TrainConfig) -> np.ndarray:
  """Step ``step``'s (batch, seq_len + 1) windows of the corpus: drawn from (seed, step) alone,
  so that a resumed run sees the batches an uninterrupted one would."""
  span = tc.seq_len + 1
  if len(data) < tc.batch * span:
    raise UsageError(f"the corpus ({len(data)} bytes) is shorter than one batch: batch "
                     f"{tc.batch} x (seq_len {tc.seq_len} + 1) = {tc.batch * span} tokens")
  return _windows(data, _starts(data, step, tc), span)


def _windows(data: np.ndarray, starts: np.ndarray, span: int) -> np.ndarray:
  """The corpus' windows of ``span`` tokens at ``starts``, int32 (batch_at's rows)."""
  return np.stack([data[s:s + span] for s in starts]).astype(np.int32)


def _starts(data: np.ndarray, step: int, tc: TrainConfig) -> np.ndarray:
  """Where each of step ``step``'s windows starts in the corpus."""
  span = tc.seq_len + 1
  return np.random.default_rng([tc.seed, step]).integers(0, len(data) - span + 1, tc.batch)


def batch_sharding(where: jax.sharding.Mesh | None) -> NamedSharding | None:
  """The batch's layout on ``where``: its rows split over both axes."""
  return None if where is None else NamedSharding(where, P(llama.BATCH, None))


def shard_batch(tokens, where: jax.sharding.Mesh | None):
  """The (whole) batch ``tokens`` laid out on ``where``; each process places its rows."""
  if where is None:
    return jnp.asarray(tokens)
  return jax.make_array_from_callback(tokens.shape, batch_sharding(where),
                                      lambda index: tokens[index])


def batch_on(data: np.ndarray, step: int, tc: TrainConfig, where: jax.sharding.Mesh):
  """Step ``step``'s batch (:func:`batch_at`'s) laid out on ``where``, each process reading
  only the rows its devices hold (the data loader sharded per process)."""
  span = tc.seq_len + 1
  starts = _starts(data, step, tc)

  def rows(index):
    return _windows(data, starts[np.arange(tc.batch)[index[0]]], span)[:, index[1]]

  return jax.make_array_from_callback((tc.batch, span), batch_sharding(where), rows)
