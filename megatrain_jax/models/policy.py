"""The clipped policy-gradient loss of GRPO and its variants, per token.

A `PolicyLoss` is given to a trainer (`loss=`) in place of cross-entropy. Its batch
carries, beside "input_ids", "labels" and "loss_mask" (1 on completion tokens):
"advantages" (float32 [B, T]), and optionally "old_logprobs" (the policy that
sampled; absent: the current one, so the ratio is 1 but its gradient is not 0) and
"ref_logprobs" (needed when `kl_coef` > 0). With logp the current log-probability
of each label, r = exp(logp - old) and A the advantage, a token's loss is

  -min(r A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) A) + kl_coef * k3,
  k3 = exp(ref - logp) - (ref - logp) - 1,

and the aggregation turns token losses into the batch's loss:
"sequence_mean" (GRPO): the mean over sequences of each one's token mean;
"token_mean" (DAPO): the sum over the batch's tokens over their count;
"constant" (Dr. GRPO): the sum over B x `max_tokens` (None: the batch's T).

Each is written as sum(weight * loss) / normalizer with a weight per token and a
normalizer per batch, so that micro-batches and processes add their sums and one
division ends the step, as for cross-entropy. The metrics are token means over the
mask: "clip_fraction" (tokens whose ratio the clip holds, the side that binds),
"kl" (the k3 estimate; only with "ref_logprobs"), "entropy" (of the whole distribution).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

AGGREGATIONS = ("sequence_mean", "token_mean", "constant")
# Optional float32 [B, T] batch keys of a policy-gradient batch.
POLICY_KEYS = ("advantages", "old_logprobs", "ref_logprobs")


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """The clipped surrogate with an optional KL penalty (see the module docstring).

  Attributes:
    clip_eps_low: the ratio is clipped below at 1 - clip_eps_low.
    clip_eps_high: ... and above at 1 + clip_eps_high (DAPO raises it, e.g. 0.28).
    kl_coef: the weight of the k3 KL estimate to the reference (0: none).
    aggregation: one of `AGGREGATIONS`.
    max_tokens: the per-sequence constant of "constant" (None: the batch's T).
  """

  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0
  aggregation: str = "sequence_mean"
  max_tokens: int | None = None

  def __post_init__(self):
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"PolicyLoss aggregation={self.aggregation!r}; choose one of "
                       f"{AGGREGATIONS}.")
    if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
      raise ValueError(f"PolicyLoss clips the ratio to [1 - {self.clip_eps_low}, 1 + "
                       f"{self.clip_eps_high}]: clip_eps_low must lie in [0, 1) and "
                       "clip_eps_high be >= 0.")
    if self.kl_coef < 0:
      raise ValueError(f"PolicyLoss kl_coef={self.kl_coef} must be >= 0.")
    if self.max_tokens is not None and self.max_tokens < 1:
      raise ValueError(f"PolicyLoss max_tokens={self.max_tokens} must be >= 1 (or None).")

  def check(self, batch: Mapping[str, Any]) -> None:
    """Checks that a batch carries what the loss reads.

    Args:
      batch: a batch already through `check_batch`.

    Raises:
      ValueError: "advantages" missing, or "ref_logprobs" missing with `kl_coef` > 0.
    """
    needed = ["advantages"] + (["ref_logprobs"] if self.kl_coef else [])
    missing = [k for k in needed if k not in batch]
    if missing:
      raise ValueError(f"A policy-gradient batch needs {missing} (float32 [B, T]); "
                       + ("compute them with trainer.logprobs on the reference model, or "
                          "set kl_coef=0." if "ref_logprobs" in missing else
                          "compute them with mt.rl.group_advantages."))

  def normalizer(self, mask_BxT) -> Any:
    """The batch's part of the loss's denominator (summed over micro-batches and
    processes).

    Args:
      mask_BxT: the loss mask (numpy or JAX).

    Returns:
      A scalar: the rows for "sequence_mean", rows times `max_tokens` (or T) for
      "constant", the mask's sum for "token_mean".
    """
    b, t = mask_BxT.shape
    if self.aggregation == "sequence_mean":
      return float(b)
    if self.aggregation == "constant":
      return float(b * (self.max_tokens or t))
    return mask_BxT.sum()

  def weights(self, mask_BxT: jax.Array) -> jax.Array:
    """Each token's weight in the loss's sum.

    Args:
      mask_BxT: the loss mask.

    Returns:
      float32 [B, T]: mask / the row's mask sum for "sequence_mean", else the mask.
    """
    mask = mask_BxT.astype(jnp.float32)
    if self.aggregation == "sequence_mean":
      return mask / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    return mask

  def token_terms(self, logits_NxV: jax.Array, labels_N: jax.Array, mask_N: jax.Array,
                  rows: Mapping[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each token's loss and metrics from its fp32 logits.

    Args:
      logits_NxV: fp32 logits.
      labels_N: the sampled tokens.
      mask_N: the loss mask: a masked-out token's log-ratios are taken as 0 before
        any exp, so that its values (a pad's, a prompt's) can never overflow into
        the loss or the gradient.
      rows: "advantages", optionally "old_logprobs" and "ref_logprobs", each [N].

    Returns:
      (loss [N], {metric name: [N]}), before any weight (0 where masked out).
    """
    live = mask_N > 0
    logz_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    logp_N = jnp.take_along_axis(logits_NxV, labels_N[:, None], axis=-1)[:, 0] - logz_N
    adv = jnp.where(live, rows["advantages"], 0.0)
    old = rows.get("old_logprobs")
    log_ratio = logp_N - (jax.lax.stop_gradient(logp_N) if old is None else old)
    ratio = jnp.exp(jnp.where(live, log_ratio, 0.0))
    clipped = jnp.clip(ratio, 1.0 - self.clip_eps_low, 1.0 + self.clip_eps_high)
    loss_N = -jnp.minimum(ratio * adv, clipped * adv)
    held = ((ratio < 1.0 - self.clip_eps_low) & (adv < 0)) | (
        (ratio > 1.0 + self.clip_eps_high) & (adv > 0))
    probs_NxV = jax.nn.softmax(jax.lax.stop_gradient(logits_NxV), axis=-1)
    entropy_N = jax.lax.stop_gradient(logz_N) - jnp.sum(
        probs_NxV * jax.lax.stop_gradient(logits_NxV), axis=-1)
    metrics = {"clip_fraction": held.astype(jnp.float32), "entropy": entropy_N}
    ref = rows.get("ref_logprobs")
    if ref is not None:
      delta = jnp.where(live, ref - logp_N, 0.0)
      kl_N = jnp.exp(delta) - delta - 1.0
      metrics["kl"] = jax.lax.stop_gradient(kl_N)
      if self.kl_coef:
        loss_N = loss_N + self.kl_coef * kl_N
    return loss_N, metrics


def token_means(sums: Mapping[str, float], tokens: float) -> dict[str, float]:
  """Metric sums as means over the masked tokens.

  Args:
    sums: metric name -> its masked sum.
    tokens: the mask's sum.

  Returns:
    metric name -> its mean.
  """
  return {k: v / max(tokens, 1.0) for k, v in sums.items()}


def check_keys(policy: PolicyLoss | None, batch: Mapping[str, Any]) -> None:
  """Checks that a batch's keys suit the trainer's loss.

  Args:
    policy: the trainer's policy loss, or None for cross-entropy.
    batch: the batch.

  Raises:
    ValueError: policy-gradient keys given to a cross-entropy trainer, or a policy
      batch without what its loss reads (`PolicyLoss.check`).
  """
  if policy is not None:
    policy.check(batch)
    return
  given = [k for k in POLICY_KEYS if k in batch]
  if given:
    raise ValueError(f"The batch holds {given}, which only a policy-gradient loss reads, "
                     "but this trainer minimizes cross-entropy: build it with "
                     "loss=mt.rl.PolicyLoss(...).")


def group_advantages(rewards, group_size: int, scale: bool = True,
                     eps: float = 1e-4) -> np.ndarray:
  """GRPO's advantages: each reward less its group's mean, over the group's spread.

  Args:
    rewards: [N] rewards, groups of `group_size` consecutive completions of one
      prompt.
    group_size: completions per prompt.
    scale: divide by the group's standard deviation (GRPO; Dr. GRPO leaves it out).
    eps: added to the standard deviation.

  Returns:
    float32 [N] advantages (0 for a group whose rewards are all equal).

  Raises:
    ValueError: N not a multiple of `group_size`, or non-finite rewards.
  """
  r = np.asarray(rewards, np.float64).reshape(-1)
  if group_size < 1 or r.size % group_size:
    raise ValueError(f"{r.size} rewards do not split into groups of {group_size}: give "
                     "group_size completions per prompt, consecutively.")
  if not np.all(np.isfinite(r)):
    raise ValueError("Rewards hold NaN or infinite values.")
  g = r.reshape(-1, group_size)
  adv = g - g.mean(axis=1, keepdims=True)
  if scale:
    adv = adv / (g.std(axis=1, ddof=1 if group_size > 1 else 0, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


def batch_loss(policy: PolicyLoss, logits_BxTxV: jax.Array, labels_BxT: jax.Array,
               mask_BxT: jax.Array, rows: Mapping[str, jax.Array]
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The loss of one whole batch from its logits: what the trainers compute chunk by
  chunk from the head's activations (`models.loss.policy_loss_sum`), in one piece.

  Args:
    policy: the loss.
    logits_BxTxV: fp32 logits.
    labels_BxT: the sampled tokens.
    mask_BxT: 1 on completion tokens.
    rows: the loss's keys present in the batch, each [B, T].

  Returns:
    (the loss, {metric: its mean over the masked tokens}).
  """
  b, t, v = logits_BxTxV.shape
  mask = mask_BxT.astype(jnp.float32)
  loss_N, metrics = policy.token_terms(logits_BxTxV.reshape(b * t, v), labels_BxT.reshape(-1),
                                       mask.reshape(-1),
                                       {k: x.reshape(-1) for k, x in rows.items()})
  total = jnp.sum(policy.weights(mask).reshape(-1) * loss_N)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  return total / jnp.maximum(policy.normalizer(mask), 1.0), {
      k: jnp.sum(mask.reshape(-1) * x) / tokens for k, x in metrics.items()}
