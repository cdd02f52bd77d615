"""GRPO's policy loss (`megatrain_jax.rl`) against independent references.

A float64 NumPy implementation with a gradient derived by hand (each aggregation, KL on
and off, with and without "old_logprobs"), the chunked head path the trainers run, and
TRL's own `GRPOTrainer` loss, driven on a stand-in trainer and model, where its options
match ours ("grpo", "bnpo", "dapo", "dr_grpo").
"""

import collections
import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import rl
from megatrain_jax.models import loss as loss_lib

EPS_LOW, EPS_HIGH = 0.2, 0.28
# PolicyLoss keyword arguments of each aggregation under test.
AGGREGATIONS = {
    "sequence_mean": {"aggregation": "sequence_mean"},
    "token_mean": {"aggregation": "token_mean"},
    "constant": {"aggregation": "constant"},
    "constant_max_tokens": {"aggregation": "constant", "max_tokens": 13},
}


def _log_softmax(x):
  """float64 log-softmax over the last axis."""
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _away_from_clip(log_ratio):
  """Log-ratios nudged at least 1e-3 off the clip bounds, so that float32 and float64
  agree on which side of a bound every ratio lies."""
  for bound in (1 - EPS_LOW, 1 + EPS_HIGH):
    log_ratio = np.where(np.abs(np.exp(log_ratio) - bound) < 1e-3, log_ratio + 0.01, log_ratio)
  return log_ratio


def _problem(seed, b=5, t=9, v=11, row_advantages=False):
  """Random logits, labels, a mask with one empty row, and float32 policy rows
  (log-ratios to "old" of about +-0.5, so both clip bounds bind somewhere)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0.0, 2.0, (b, t, v)).astype(np.float32)
  labels = rng.integers(0, v, (b, t)).astype(np.int32)
  mask = (rng.random((b, t)) < 0.75).astype(np.float32)
  mask[0, :2] = 1.0
  mask[1] = 0.0  # a sequence without completion tokens
  logp = np.take_along_axis(_log_softmax(logits), labels[..., None], -1)[..., 0]
  if row_advantages:
    adv = (np.abs(rng.normal(size=b)) + 0.1) * np.where(np.arange(b) % 2, -1.0, 1.0)
    adv = np.repeat(adv[:, None], t, axis=1)
  else:
    adv = rng.normal(size=(b, t))
  rows = {"advantages": adv.astype(np.float32),
          "old_logprobs": (logp - _away_from_clip(rng.normal(0.0, 0.5, (b, t)))).astype(np.float32),
          "ref_logprobs": (logp + rng.normal(0.0, 0.5, (b, t))).astype(np.float32)}
  return logits, labels, mask, rows


def _reference(policy, logits, labels, mask, rows):
  """(loss, d loss / d logits, metrics) in float64 NumPy, the gradient derived by hand:
  d logp / d logits = onehot - softmax; d/d logp of the clipped term is -A r where the
  ratio's own term is the min and 0 where the clip binds; of k3 it is 1 - exp(ref - logp)."""
  b, t, v = logits.shape
  logq = _log_softmax(logits)
  probs = np.exp(logq)
  onehot = labels[..., None] == np.arange(v)
  logp = np.where(onehot, logq, 0.0).sum(-1)
  adv = rows["advantages"].astype(np.float64)
  old = rows.get("old_logprobs")
  ratio = np.ones_like(logp) if old is None else np.exp(logp - old.astype(np.float64))
  lo, hi = 1.0 - policy.clip_eps_low, 1.0 + policy.clip_eps_high
  held = ((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0))
  token = -np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv)
  d_token = np.where(held, 0.0, -adv * ratio)
  metrics = {"clip_fraction": held.astype(np.float64), "entropy": -(probs * logq).sum(-1)}
  if "ref_logprobs" in rows:
    delta = rows["ref_logprobs"].astype(np.float64) - logp
    metrics["kl"] = np.exp(delta) - delta - 1.0
    token = token + policy.kl_coef * metrics["kl"]
    d_token = d_token + policy.kl_coef * (1.0 - np.exp(delta))
  if policy.aggregation == "sequence_mean":
    weight = mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) / b
  elif policy.aggregation == "token_mean":
    weight = mask / max(mask.sum(), 1.0)
  else:
    weight = mask / (b * (policy.max_tokens or t))
  grad = (weight * d_token)[..., None] * (onehot - probs)
  tokens = max(mask.sum(), 1.0)
  return (weight * token).sum(), grad, {k: (mask * x).sum() / tokens for k, x in metrics.items()}


def _ours(policy, logits, labels, mask, rows):
  """`rl.batch_loss` and its gradient with respect to the logits: (loss, grad, metrics)."""
  rows = {k: jnp.asarray(x) for k, x in rows.items()}
  fn = lambda lg: rl.batch_loss(policy, lg, jnp.asarray(labels), jnp.asarray(mask), rows)
  (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.asarray(logits))
  return float(loss), np.asarray(grad), {k: float(x) for k, x in metrics.items()}


def _clip_cases(policy, logits, labels, mask, rows):
  """Masked token counts of each clip case: held below, held above, and outside the
  range with the ratio's own term the min (gradient -A r, not 0)."""
  logp = np.take_along_axis(_log_softmax(logits), labels[..., None], -1)[..., 0]
  r, a = np.exp(logp - rows["old_logprobs"]), rows["advantages"]
  lo, hi = 1 - policy.clip_eps_low, 1 + policy.clip_eps_high
  on = mask > 0
  return {"held_low": int(np.sum(on & (r < lo) & (a < 0))),
          "held_high": int(np.sum(on & (r > hi) & (a > 0))),
          "outside_unheld": int(np.sum(on & (((r < lo) & (a > 0)) | ((r > hi) & (a < 0)))))}


@pytest.mark.parametrize("old", [True, False], ids=["old", "no_old"])
@pytest.mark.parametrize("kl", ["off", "metric_only", "on"])
@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_batch_loss_and_logit_gradient_equal_numpy_reference(aggregation, kl, old):
  # float32 JAX against float64 NumPy: the loss is O(0.1-1) and every logit's gradient
  # O(1e-2); float32 rounds both to ~1e-7 relative, inside rtol 1e-6, atol 1e-7.
  policy = rl.PolicyLoss(EPS_LOW, EPS_HIGH, kl_coef=0.1 if kl == "on" else 0.0,
                         **AGGREGATIONS[aggregation])
  logits, labels, mask, rows = _problem(0)
  if old:
    cases = _clip_cases(policy, logits, labels, mask, rows)
    assert min(cases.values()) >= 2, cases
  else:
    del rows["old_logprobs"]
  if kl == "off":
    del rows["ref_logprobs"]
  ref_loss, ref_grad, ref_metrics = _reference(policy, logits, labels, mask, rows)
  loss, grad, metrics = _ours(policy, logits, labels, mask, rows)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-7)
  assert np.abs(ref_grad).max() > 1e-2 and not grad[1].any()  # the empty row adds nothing
  assert set(metrics) == set(ref_metrics)
  for k in metrics:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-6, atol=1e-7, err_msg=k)
  assert (metrics["clip_fraction"] > 0.05) == old


def test_reference_gradient_is_the_derivative_of_the_reference_loss():
  # The hand-derived gradient agrees with central differences of the NumPy loss, so the
  # two can't share a mistake that the comparisons above would miss.
  policy = rl.PolicyLoss(EPS_LOW, EPS_HIGH, kl_coef=0.1, aggregation="sequence_mean")
  logits, labels, mask, rows = _problem(1, b=3, t=4, v=5)
  logits = logits.astype(np.float64)
  _, grad, _ = _reference(policy, logits, labels, mask, rows)
  numeric = np.zeros_like(logits)
  h = 1e-6
  for i in np.ndindex(logits.shape):
    up, down = logits.copy(), logits.copy()
    up[i] += h
    down[i] -= h
    numeric[i] = (_reference(policy, up, labels, mask, rows)[0]
                  - _reference(policy, down, labels, mask, rows)[0]) / (2 * h)
  np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)
  assert np.abs(grad).max() > 1e-2


@pytest.mark.parametrize("chunk", [1, 7, None], ids=["chunk1", "chunk7", "chunkN"])
@pytest.mark.parametrize("aggregation,kl_coef,keys", [
    ("sequence_mean", 0.1, ("advantages", "old_logprobs", "ref_logprobs")),
    ("token_mean", 0.0, ("advantages",)),
    ("constant_max_tokens", 0.1, ("advantages", "ref_logprobs")),
])
def test_chunked_policy_loss_equals_batch_loss(aggregation, kl_coef, keys, chunk):
  # 5 x 9 = 45 tokens: chunks of 7 pad the last one with 4 zero rows.
  policy = rl.PolicyLoss(EPS_LOW, EPS_HIGH, kl_coef=kl_coef, **AGGREGATIONS[aggregation])
  _, labels, mask, rows = _problem(2)
  rows = {k: jnp.asarray(rows[k]) for k in keys}
  b, t = labels.shape
  n, d, v = b * t, 6, 11
  chunk = chunk or n
  rng = np.random.default_rng(3)
  h = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  w = jnp.asarray(rng.normal(0.0, 0.8, (d, v)), jnp.float32)
  labels, mask = jnp.asarray(labels), jnp.asarray(mask)

  def whole(h, w):
    logits = jnp.dot(h, w, precision="highest").reshape(b, t, v)
    return rl.batch_loss(policy, logits, labels, mask, rows)

  def chunked(h, w):
    total, sums = loss_lib.policy_loss_sum(
        h, w, labels.reshape(-1), mask.reshape(-1), policy.weights(mask).reshape(-1),
        {k: x.reshape(-1) for k, x in rows.items()}, chunk, policy)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    return total / jnp.maximum(policy.normalizer(mask), 1.0), {
        k: x / tokens for k, x in sums.items()}

  grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(h, w)
  (ref, ref_metrics), ref_grads = grad(whole)
  (got, metrics), grads = grad(chunked)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  for a, b_ in zip(grads, ref_grads):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)
    assert np.abs(b_).max() > 1e-3
  assert set(metrics) == set(ref_metrics) == (
      {"clip_fraction", "entropy"} | ({"kl"} if "ref_logprobs" in keys else set()))
  for k in metrics:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)


# --- TRL ---------------------------------------------------------------------------

TRL_AGGREGATIONS = {"grpo": "sequence_mean", "bnpo": "token_mean", "dapo": "token_mean",
                    "dr_grpo": "constant"}
TRL_MAX_COMPLETION_LENGTH = 13  # more than the batch's T: "constant" must use it, not T
TRL_PROMPT = 3


def _trl_classes():
  """(stand-in trainer class, stand-in model class, add_fused_lm_head) over the
  installed TRL."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers
  from trl import GRPOTrainer
  from trl.trainer.utils import add_fused_lm_head

  class Backbone(torch.nn.Module):
    """Returns fixed hidden states, whatever the tokens."""

    def __init__(self, hidden):
      super().__init__()
      self.hidden = hidden

    def forward(self, input_ids, attention_mask=None, **kwargs):
      """The fixed hidden states as a backbone's output."""
      del attention_mask, kwargs
      assert input_ids.shape == self.hidden.shape[:2]
      return types.SimpleNamespace(last_hidden_state=self.hidden)

  class LogitsModel(torch.nn.Module):
    """A causal LM whose hidden states are the logits: the head is the identity, so the
    gradient TRL sends to the hidden states is the gradient to the logits."""

    def __init__(self, hidden):
      super().__init__()
      v = hidden.shape[-1]
      self.config = transformers.PretrainedConfig()
      self.backbone = Backbone(hidden)
      self.lm_head = torch.nn.Linear(v, v, bias=False, dtype=hidden.dtype)
      with torch.no_grad():
        self.lm_head.weight.copy_(torch.eye(v, dtype=hidden.dtype))
      self.lm_head.weight.requires_grad_(False)

    @property
    def base_model(self):
      """The backbone, where `add_fused_lm_head` looks for it."""
      return self.backbone

    def get_output_embeddings(self):
      """The LM head."""
      return self.lm_head

    def forward(self, input_ids, attention_mask=None, **kwargs):
      """Replaced by `add_fused_lm_head`'s forward."""
      raise NotImplementedError

  class OneProcess:
    """The accelerator of a single process."""

    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def autocast(self):
      """No autocast."""
      return contextlib.nullcontext()

    def reduce(self, x, reduction="sum"):
      """One process: the tensor itself."""
      del reduction
      return x

    def gather(self, x):
      """One process: the tensor itself."""
      return x

    gather_for_metrics = gather

  class Trainer(GRPOTrainer):
    """A GRPOTrainer with only what its loss reads: no model loading, no generation."""

    def __init__(self, model, loss_type, beta):
      self.model = model
      self.accelerator = OneProcess()
      self.args = types.SimpleNamespace(report_to=[], use_bias_correction_kl=False, delta=None,
                                        steps_per_generation=1)
      self.state = types.SimpleNamespace(global_step=0)
      self.loss_type, self.beta = loss_type, beta
      self.epsilon_low, self.epsilon_high = EPS_LOW, EPS_HIGH
      self.max_completion_length = TRL_MAX_COMPLETION_LENGTH
      self.importance_sampling_level = "token"
      self.top_entropy_quantile = 1.0
      self.aux_loss_enabled = False
      self.off_policy_mask_threshold = None
      self.use_vllm = False
      self.vllm_importance_sampling_correction = False
      self.current_gradient_accumulation_steps = 1
      self._entropy_bonus_enabled = False
      self._metrics = {"train": collections.defaultdict(list),
                       "eval": collections.defaultdict(list)}

    def logged(self):
      """The metrics the last loss logged."""
      return {k: x[-1] for k, x in self._metrics["train"].items()}

  return Trainer, LogitsModel, add_fused_lm_head


def _trl_loss(loss_type, beta, logits, labels, mask, rows):
  """TRL's GRPO loss on the logits, through `GRPOTrainer.compute_loss` with TRL's own
  fused LM head at temperature 1: (loss, d loss / d logits, logged metrics).

  TRL scores completion token t with the hidden state before it (prompt length P - 1 +
  t), so the logits sit there; the prompt's other positions and the last one are unused.
  """
  trainer_cls, model_cls, add_fused_lm_head = _trl_classes()
  import torch
  b, t, v = logits.shape
  hidden = np.random.default_rng(9).normal(size=(b, TRL_PROMPT + t, v))
  hidden[:, TRL_PROMPT - 1:TRL_PROMPT - 1 + t] = logits
  hidden = torch.tensor(hidden, dtype=torch.float64, requires_grad=True)
  model = model_cls(hidden)
  add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
  model.train()
  inputs = {"prompt_ids": torch.zeros((b, TRL_PROMPT), dtype=torch.long),
            "prompt_mask": torch.ones((b, TRL_PROMPT), dtype=torch.long),
            "completion_ids": torch.tensor(labels, dtype=torch.long),
            "completion_mask": torch.tensor(mask, dtype=torch.long),
            "advantages": torch.tensor(rows["advantages"][:, 0], dtype=torch.float64),
            "num_items_in_batch": torch.tensor(float(mask.sum()))}
  if "old_logprobs" in rows:
    inputs["old_per_token_logps"] = torch.tensor(rows["old_logprobs"], dtype=torch.float64)
  if "ref_logprobs" in rows:
    inputs["ref_per_token_logps"] = torch.tensor(rows["ref_logprobs"], dtype=torch.float64)
  trainer = trainer_cls(model, loss_type, beta)
  loss = trainer.compute_loss(model, inputs)
  loss.backward()
  grad = hidden.grad.numpy()
  outside = np.delete(grad, np.s_[TRL_PROMPT - 1:TRL_PROMPT - 1 + t], axis=1)
  assert not outside.any()
  return loss.item(), grad[:, TRL_PROMPT - 1:TRL_PROMPT - 1 + t], trainer.logged()


@pytest.mark.parametrize("old", [True, False], ids=["old", "no_old"])
@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["kl_off", "kl_on"])
@pytest.mark.parametrize("loss_type", list(TRL_AGGREGATIONS))
def test_loss_and_logit_gradient_equal_trl_grpo(loss_type, beta, old):
  # TRL computes the log-probabilities and entropies in float32 (its fused head folds
  # each tile in float32), as our float32 path does: each is within ~1e-7 of the exact
  # value, so they agree at rtol 1e-6, atol 1e-7.
  logits, labels, mask, rows = _problem(4, b=6, row_advantages=True)
  if not old:
    del rows["old_logprobs"]
  if not beta:
    del rows["ref_logprobs"]
  agg = TRL_AGGREGATIONS[loss_type]
  policy = rl.PolicyLoss(EPS_LOW, EPS_HIGH, kl_coef=beta, aggregation=agg,
                         max_tokens=TRL_MAX_COMPLETION_LENGTH if agg == "constant" else None)
  trl_loss, trl_grad, logged = _trl_loss(loss_type, beta, logits, labels, mask, rows)
  loss, grad, metrics = _ours(policy, logits, labels, mask, rows)
  np.testing.assert_allclose(loss, trl_loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, trl_grad, rtol=1e-6, atol=1e-7)
  assert np.abs(trl_grad).max() > 1e-2
  if old:  # the data reach both clip bounds (TRL's own count)
    assert logged["clip_ratio/low_mean"] > 0 and logged["clip_ratio/high_mean"] > 0, logged
  pairs = {"clip_fraction": "clip_ratio/region_mean", "entropy": "entropy", "kl": "kl"}
  assert {pairs[k] for k in metrics} <= set(logged)
  for k in metrics:
    np.testing.assert_allclose(metrics[k], logged[pairs[k]], rtol=1e-6, atol=1e-7, err_msg=k)


# --- group advantages and argument checks ------------------------------------------

@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("group_size", [4, 3, 1])
def test_group_advantages_equal_trl_normalization(group_size, scale):
  import torch  # pylint: disable=import-outside-toplevel
  from trl.trainer.utils import nanstd
  rng = np.random.default_rng(5)
  rewards = np.round(rng.normal(size=(12 // group_size) * group_size) * 3, 1)
  rewards[:group_size] = 0.5  # a group whose rewards are all equal
  # TRL's GRPOTrainer._generate_and_score_completions, scale_rewards "group" / "none":
  r = torch.tensor(rewards, dtype=torch.float64)
  mean = torch.nanmean(r.view(-1, group_size), dim=1).repeat_interleave(group_size)
  std = (nanstd(r.view(-1, group_size), dim=1).repeat_interleave(group_size)
         if group_size > 1 else torch.zeros_like(r))
  expected = r - mean
  if scale:
    expected = expected / (std + 1e-4)
  got = rl.group_advantages(rewards, group_size, scale=scale)
  assert got.dtype == np.float32 and got.shape == rewards.shape
  np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6, atol=1e-6)
  assert not got[:group_size].any()
  if group_size > 1:
    assert np.abs(got).max() > 0.3


@pytest.mark.parametrize("rewards,group_size", [
    (np.arange(5.0), 2), (np.arange(4.0), 0), (np.array([1.0, np.nan, 0.0, 1.0]), 2),
    (np.array([1.0, np.inf]), 2)])
def test_group_advantages_refuse_bad_input(rewards, group_size):
  with pytest.raises(ValueError):
    rl.group_advantages(rewards, group_size)


@pytest.mark.parametrize("kwargs,field", [
    ({"aggregation": "mean"}, "aggregation"), ({"kl_coef": -0.1}, "kl_coef"),
    ({"clip_eps_low": 1.0}, "clip_eps_low"), ({"clip_eps_low": -0.1}, "clip_eps_low"),
    ({"clip_eps_high": -0.1}, "clip_eps_high"), ({"max_tokens": 0}, "max_tokens")])
def test_policy_loss_refuses_bad_arguments(kwargs, field):
  with pytest.raises(ValueError, match=field):
    rl.PolicyLoss(**kwargs)


def test_policy_loss_check_names_missing_keys():
  rows = {"advantages": np.zeros((1, 2), np.float32)}
  rl.PolicyLoss().check(rows)  # kl_coef 0: no reference needed
  with pytest.raises(ValueError, match="advantages"):
    rl.PolicyLoss().check({"old_logprobs": np.zeros((1, 2), np.float32)})
  with pytest.raises(ValueError, match="ref_logprobs"):
    rl.PolicyLoss(kl_coef=0.1).check(rows)
  rl.PolicyLoss(kl_coef=0.1).check(dict(rows, ref_logprobs=rows["advantages"]))
