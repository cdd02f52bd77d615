"""Autoregressive generation with a key/value cache, the weights resident or streamed.

`generate(model_or_trainer, prompts, max_new_tokens, ...)` (`mt.generate`) continues
each prompt (a list of token ids; the prompts may differ in length) and returns a
`Generation`: each row's new tokens and their log-probabilities, for evaluation and
for RL. Two ways to run, the same numbers either way:

  resident  the compute-dtype weights on the device; one jitted prefill of the
            prompts and one jitted one-token step (each compiled once per shape).
  streamed  the weights in host memory, as a `StreamingTrainer` keeps them: each
            unit is read from the trainer once per call, in the compute dtype, and
            every model call (the prefill, each step) streams the layers through the
            device once for the whole batch: `jax.device_put` a layer's weights (the
            next layer's put while this one runs), run its decode function (jitted
            once per layer structure; weights are arguments), drop them.

The caches (`models.decode`) stay on the device, or with `kv_cache="host"` each
layer's cache lives in host memory (`pinned_host`) and visits the device for its
layer's turn. Prompts are right-padded and a token's cache slot is its position, so
rows of any length run together and finish independently: a row stops after
`eos_id` (kept in its output) or after `max_new_tokens`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from megatrain_jax import generation_weights as weights
from megatrain_jax.models import decode
from megatrain_jax.models.config import LlamaConfig
KV_CACHES = ("auto", "device", "host")
# Below this temperature softmax(logits / T) overflows in fp32: use 0 for greedy.
MIN_TEMPERATURE = 1e-3


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` returns, one entry per prompt, in the prompts' order.

  Attributes:
    tokens: each row's generated tokens as Python ints (the prompt not included, no
      padding); ends with `eos_id` when the row reached it.
    logprobs: each row's float32 [len(tokens[b])] log-probabilities of its tokens
      under the model's raw logits: log_softmax(logits)[token], i.e. at temperature 1
      and before top-p, whatever the sampling settings (RL's behaviour log-probs).
    eos: per row, whether it ended at `eos_id` (False: it ran to `max_new_tokens`).
    pad_id: what `padded` fills the rows' ends with.
    stats: "calls" (the prefill and the decode steps), "weight_h2d_bytes" (weight
      bytes put on the device: resident, the model once; streamed, every block and
      the head each call, plus the new tokens' embedding rows), "seconds",
      "tokens_per_s" (generated tokens a second, compiles included).
  """

  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  eos: list[bool]
  pad_id: int = 0
  stats: dict[str, float] = dataclasses.field(default_factory=dict)

  def padded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows as arrays of the longest row's length N.

    Returns:
      (tokens int32 [B, N], `pad_id` after each row's end; logprobs float32 [B, N],
      0 there; mask float32 [B, N], 1 on generated tokens).
    """
    n = max(len(t) for t in self.tokens)
    tokens = np.full((len(self.tokens), n), self.pad_id, np.int32)
    logprobs = np.zeros((len(self.tokens), n), np.float32)
    mask = np.zeros((len(self.tokens), n), np.float32)
    for r, (t, lp) in enumerate(zip(self.tokens, self.logprobs)):
      tokens[r, :len(t)], logprobs[r, :len(t)], mask[r, :len(t)] = t, lp, 1.0
    return tokens, logprobs, mask


def _check(cfg: LlamaConfig, prompts, max_new_tokens, temperature, top_p, key, eos_id,
           pad_id, kv_cache) -> list[np.ndarray]:
  """The prompts as int32 arrays, once every argument is known to be usable."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: generate at least one token "
                     "(a positive int).")
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts is empty (or not a list): pass a list of token-id lists, "
                     "e.g. [[1, 5, 9], [1, 7]].")
  rows = []
  for r, p in enumerate(prompts):
    a = np.asarray(p)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
      raise ValueError(f"prompts[{r}] is {'empty' if a.size == 0 else 'not a list of ints'}: "
                       "each prompt needs at least one token id.")
    if a.min() < 0 or a.max() >= cfg.vocab_size:
      raise ValueError(f"prompts[{r}] has token ids outside [0, vocab_size={cfg.vocab_size}) "
                       f"(min {a.min()}, max {a.max()}): tokenize with the model's vocabulary.")
    if a.size + max_new_tokens > cfg.max_seq_len:
      raise ValueError(f"prompts[{r}] has {a.size} tokens; with max_new_tokens="
                       f"{max_new_tokens} that is past the model's max_seq_len="
                       f"{cfg.max_seq_len}: shorten the prompt or generate fewer tokens.")
    rows.append(a.astype(np.int32))
  if not (isinstance(temperature, numbers.Real) and not isinstance(temperature, bool)
          and np.isfinite(temperature)
          and temperature >= 0):
    raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                     "(0: greedy).")
  if not (isinstance(top_p, numbers.Real) and 0 < top_p <= 1):
    raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1: no nucleus filtering).")
  if 0 < temperature < MIN_TEMPERATURE:
    raise ValueError(f"temperature={temperature!r} is below {MIN_TEMPERATURE}, where "
                     "logits / temperature overflow: use temperature=0.0 for greedy.")
  if temperature > 0 and key is None:
    raise ValueError(f"temperature={temperature} samples, which needs an explicit PRNG key: "
                     "pass key=jax.random.key(0) (or temperature=0.0 for greedy decoding).")
  if key is not None and not isinstance(key, jax.Array):
    raise ValueError(f"key={key!r} is not a PRNG key: pass e.g. jax.random.key(0).")
  if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(
      eos_id, (int, np.integer)) or not 0 <= eos_id < cfg.vocab_size):
    raise ValueError(f"eos_id={eos_id!r} must be a token id in [0, vocab_size="
                     f"{cfg.vocab_size}).")
  if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
    raise ValueError(f"pad_id={pad_id!r} must be an int (what `Generation.padded` fills "
                     "with; it never reaches the model).")
  if kv_cache not in KV_CACHES:
    raise ValueError(f"kv_cache={kv_cache!r} is not one of {KV_CACHES}.")
  return rows


# -- the model calls -----------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("greedy", "nucleus"))
def _sample(logits_BxV, key, temperature, top_p, *, greedy: bool, nucleus: bool):
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  if greedy:
    token_B = jnp.argmax(logits_BxV, axis=-1)
  else:
    scaled = logits_BxV / temperature
    if nucleus:  # keep the most likely tokens whose mass reaches top_p (the first always)
      probs = jax.nn.softmax(scaled, axis=-1)
      order = jnp.argsort(-probs, axis=-1)  # ties: the lower id first, as argmax
      desc = jnp.take_along_axis(probs, order, axis=-1)
      kept_sorted = (jnp.cumsum(desc, axis=-1) - desc) < top_p
      kept = jnp.take_along_axis(kept_sorted, jnp.argsort(order, axis=-1), axis=-1)
      scaled = jnp.where(kept, scaled, -jnp.inf)
    token_B = jax.random.categorical(key, scaled, axis=-1)
  token_B = token_B.astype(jnp.int32)
  return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]


# -- the loop ------------------------------------------------------------------------

def generate(model_or_trainer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 1.0, top_p: float = 1.0, key: jax.Array | None = None,
             eos_id: int | None = None, pad_id: int = 0, streamed: bool | None = None,
             kv_cache: str = "auto", compute_dtype=None) -> Generation:
  """Continues each prompt by up to `max_new_tokens` tokens.

  Args:
    model_or_trainer: an `mt.Llama`, a `ResidentTrainer` (its `params()`) or a
      `StreamingTrainer` (each unit fetched as its steps fetch it: no copy of the
      model is made on the host).
    prompts: token-id lists, one per row, of any lengths (at least one token each).
    max_new_tokens: the most tokens a row gets.
    temperature: 0: greedy (argmax); > 0: sample from softmax(logits / temperature).
    top_p: nucleus sampling: draw among the most likely tokens whose probability
      mass reaches top_p (1: all).
    key: the PRNG key of the draws (needed when temperature > 0); the same key, the
      same tokens. Step t draws with `jax.random.fold_in(key, t)`.
    eos_id: a row ends once it produced this token (kept in its output); None: rows
      run to `max_new_tokens`.
    pad_id: what `Generation.padded` fills with (never fed to the model).
    streamed: stream the layers through the device each step, or keep them there;
      None: as `models.decode.placement` decides for the device's memory (a
      StreamingTrainer's `device_budget_bytes`, else the accelerator's), resident
      where it is unknown (the CPU backend) except for a StreamingTrainer.
    kv_cache: "device", "host" (each layer's cache waits in host memory and comes to
      the device for its layer's turn), or "auto": as `placement` decides ("device"
      where the memory is unknown).
    compute_dtype: the dtype the model computes in (None: the model's or trainer's).

  Returns:
    The `Generation` (tokens, log-probs, whether each row hit EOS, stats).

  Raises:
    ValueError: an empty prompt list or prompt, token ids outside [0, vocab_size), a
      prompt plus max_new_tokens past `max_seq_len`, max_new_tokens < 1, top_p
      outside (0, 1], a negative temperature or one below `MIN_TEMPERATURE`,
      sampling without a key, an eos_id outside the vocabulary, a pad_id that is not
      an int, or an unknown kv_cache.
    TypeError: `model_or_trainer` is none of the three.
  """
  src = weights.source(model_or_trainer)
  cfg = src.cfg
  rows = _check(cfg, prompts, max_new_tokens, temperature, top_p, key, eos_id, pad_id,
                kv_cache)
  dtype = jnp.dtype(compute_dtype or src.compute_dtype)
  b, width = len(rows), max(len(r) for r in rows)
  capacity = width + max_new_tokens
  fits = (None, None) if src.budget is None else decode.placement(cfg, dtype, b, capacity,
                                                                    src.budget)
  if streamed is None:
    streamed = src.streams if fits[0] is None else fits[0]
  if kv_cache == "auto":
    kv_cache = fits[1] or "device"
  start = time.perf_counter()
  runner = (weights.ResidentRunner(cfg, weights.device_units(src, dtype), dtype, b, capacity)
            if not streamed and kv_cache == "device" else
            weights.StreamedRunner(cfg, src, dtype, b, capacity, kv_cache,
                                   keep_weights=not streamed))
  logging.vlog(1, "generate: %d rows, prompts of %d-%d tokens, up to %d new, %s, %s, "
               "kv cache on the %s.", b, min(len(r) for r in rows), width, max_new_tokens,
               "streamed" if streamed else "resident", dtype.name, kv_cache)
  ids = np.zeros((b, width), np.int32)
  for r, row in enumerate(rows):
    ids[r, :len(row)] = row
  lengths = np.array([len(r) for r in rows], np.int32)
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width))
  logits = runner(ids, positions, lengths, lengths - 1)
  greedy = temperature == 0
  settings = dict(greedy=greedy, nucleus=not greedy and top_p < 1)
  temp, nucleus_p = jnp.float32(temperature or 1.0), jnp.float32(top_p)
  tokens = np.zeros((b, max_new_tokens), np.int32)
  logprobs = np.zeros((b, max_new_tokens), np.float32)
  count, done, eos = np.zeros(b, np.int64), np.zeros(b, bool), np.zeros(b, bool)
  calls = 1
  for t in range(max_new_tokens):
    step_key = None if greedy else jax.random.fold_in(key, t)
    token, logprob = map(np.asarray, _sample(logits, step_key, temp, nucleus_p, **settings))
    live = ~done
    tokens[live, t], logprobs[live, t] = token[live], logprob[live]
    count += live
    if eos_id is not None:
      eos |= live & (token == eos_id)
      done |= eos
    if done.all() or t + 1 == max_new_tokens:
      break
    # Each row's new token goes to the slot after its last; finished rows feed id 0.
    positions, lengths = lengths[:, None], lengths + 1
    logits = runner(np.where(done, 0, token)[:, None].astype(np.int32), positions,
                    lengths, np.zeros(b, np.int32))
    calls += 1
  seconds = time.perf_counter() - start
  stats = {"calls": calls, "weight_h2d_bytes": runner.h2d_bytes, "seconds": seconds,
           "tokens_per_s": float(count.sum()) / max(seconds, 1e-9)}
  logging.vlog(1, "generate: %d tokens in %.2f s (%.1f tokens/s), %d model calls, "
               "%.1f MB of weights moved to the device.", count.sum(), seconds,
               stats["tokens_per_s"], calls, runner.h2d_bytes / 1e6)
  return Generation(tokens=[tokens[r, :count[r]].tolist() for r in range(b)],
                    logprobs=[logprobs[r, :count[r]].copy() for r in range(b)],
                    eos=[bool(e) for e in eos], pad_id=pad_id, stats=stats)
