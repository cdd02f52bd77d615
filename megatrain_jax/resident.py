"""The reference trainer: the whole model on the device, one jitted step."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.host.state import Snapshot, static_snapshot
from megatrain_jax.models.batch import check_batch
from megatrain_jax.models.llama import Llama
from megatrain_jax.models import lora
from megatrain_jax.models import trainable as trainable_lib
from megatrain_jax.models.loss import model_logprobs, model_loss_and_metrics
from megatrain_jax.models.policy import POLICY_KEYS, PolicyLoss, check_keys
from megatrain_jax.models.trainable import Filter


class ResidentTrainer:
  """Trains `model` with `optimizer` in one `jax.jit` step, params donated.

  This is the yardstick: `StreamingTrainer` must give the same parameters.
  `remat=True` recomputes each block in the backward (`jax.checkpoint`), the
  same recompute work the streaming engine does. The model is copied, not
  modified; `params()` returns the trained tree.
  """

  def __init__(self, model: Llama, optimizer: optax.GradientTransformation,
               remat: bool = False, compute_dtype=jnp.float32,
               loss_chunk_tokens: int | None = None, *, trainable: Filter = None,
               loss: PolicyLoss | None = None):
    """Copies `model`'s parameters onto the device.

    Args:
      model: the NNX model (not modified).
      optimizer: any Optax transform; it sees the parameters that train only.
      remat: recompute each block in the backward.
      compute_dtype: the dtype the blocks compute in.
      loss_chunk_tokens: tokens per chunk of logits in the loss (None: the default).
      trainable: which parameters train, as `StreamingTrainer`'s (None: all).
      loss: None for masked cross-entropy, or a policy-gradient loss
        (`mt.rl.PolicyLoss`), as `StreamingTrainer`'s.
    """
    self.cfg = model.cfg
    self.optimizer = optimizer
    self.remat = remat
    self.compute_dtype = compute_dtype
    self._chunk = loss_chunk_tokens
    self._policy = loss
    params = jax.tree.map(lambda a: jnp.array(a, copy=True), model.param_tree())
    self._mask = None if trainable is None else trainable_lib.mask(model, trainable)
    self._params, self._frozen = (params, None) if self._mask is None else \
        trainable_lib.split(params, self._mask)
    self._opt_state = optimizer.init(self._params)
    self._step_count = 0
    self._jit_step = jax.jit(self._step_fn, donate_argnums=(0, 1))
    self._jit_grad = jax.jit(jax.value_and_grad(self._loss, has_aux=True))
    self._jit_eval = jax.jit(lambda params, frozen, batch: model_loss_and_metrics(
        self.cfg, self._whole(params, frozen), batch, self.compute_dtype, self._chunk,
        aux=False, policy=loss))
    self._jit_logprobs = jax.jit(lambda params, frozen, batch, adapters: model_logprobs(
        self.cfg if adapters else self.cfg.replace(lora=None),
        self._whole(params, frozen) if adapters else lora.strip_adapters(
            self._whole(params, frozen)), batch, self.compute_dtype, self._chunk),
        static_argnums=(3,))

  def _whole(self, params, frozen):
    return params if self._mask is None else trainable_lib.merge(params, frozen, self._mask)

  def _loss(self, params, frozen, batch, keys=None):
    return model_loss_and_metrics(self.cfg, self._whole(params, frozen), batch,
                                  self.compute_dtype, self._chunk, self.remat, keys,
                                  policy=self._policy)

  def _step_fn(self, params, opt_state, frozen, batch, keys):
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
        params, frozen, batch, keys)
    updates, new_state = self.optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    grad_norm = optax.global_norm(grads)
    # A non-finite loss or gradient leaves parameters and state as they were.
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(ok, new, old)
    return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_state, opt_state),
            {"loss": loss, "grad_norm": grad_norm, **metrics})

  def step(self, batch: dict[str, Any], key: jax.Array | None = None) -> dict[str, float]:
    """One step; a non-finite loss or gradient raises FloatingPointError and
    changes nothing.

    Args:
      batch: the batch, in the format of `check_batch`.
      key: the step's PRNG key, for LoRA dropout (`LoraConfig.dropout`); sequence r
        of the batch draws its masks from `fold_in(key, r)`.

    Returns:
      {"loss", "grad_norm", "tokens"}: the loss, the gradient's global norm and the
      loss mask's sum; a policy loss adds its metrics (`StreamingTrainer.step`).

    Raises:
      FloatingPointError: the loss or the gradient norm is NaN or infinite.
      TypeError: the batch is not a mapping (see `check_batch`).
      ValueError: a malformed batch (see `check_batch`), keys that do not suit
        the loss, or LoRA dropout without a key.
    """
    batch = self._check(batch)
    lora.check_key(self.cfg.lora, key)
    self._params, self._opt_state, metrics = self._jit_step(
        self._params, self._opt_state, self._frozen, batch, self._keys(batch, key))
    out = {k: float(v) for k, v in metrics.items()}
    if not (math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])):
      what = "loss" if not math.isfinite(out["loss"]) else "gradient norm"
      raise FloatingPointError(
          f"Non-finite {what} ({out['loss']}, gradient norm {out['grad_norm']}) at step "
          f"{self._step_count + 1}. No parameter or optimizer state was changed.")
    self._step_count += 1
    out["tokens"] = float(batch["loss_mask"].sum())
    return out

  def evaluate(self, batch: dict[str, Any]) -> dict[str, float]:
    """The loss at the current parameters, forward only; nothing changes.

    Args:
      batch: the batch, in the format of `check_batch` (no LoRA dropout).

    Returns:
      {"loss": the loss (cross-entropy's: the mean over the masked tokens),
      without an MoE model's load-balancing loss; "tokens": the masked tokens'
      count}, and a policy loss's metrics.
    """
    batch = self._check(batch)
    loss, metrics = self._jit_eval(self._params, self._frozen, batch)
    return {"loss": float(loss), "tokens": float(batch["loss_mask"].sum()),
            **{k: float(v) for k, v in metrics.items()}}

  def logprobs(self, batch: dict[str, Any], adapters: bool = True) -> np.ndarray:
    """Each label's log-probability at the current parameters; nothing changes.

    Args:
      batch: the batch, in the format of `check_batch` (a policy loss's keys may be
        absent).
      adapters: False leaves LoRA adapters out (the frozen base's log-probs).

    Returns:
      float32 [B, T]: log softmax(logits)[label] at each position.

    Raises:
      ValueError: a malformed batch (see `check_batch`).
    """
    batch = check_batch(self.cfg, {k: v for k, v in batch.items() if k not in POLICY_KEYS})
    return np.asarray(self._jit_logprobs(self._params, self._frozen, batch,
                                         bool(adapters) or self.cfg.lora is None))

  def _check(self, batch):
    batch = check_batch(self.cfg, batch)
    check_keys(self._policy, batch)
    return batch

  def loss_and_grads(self, batch: dict[str, Any], key: jax.Array | None = None):
    """(loss, gradient tree as numpy) at the current parameters; no update.

    Args:
      batch: the batch, in the format of `check_batch`.
      key: as `step`.
    """
    batch = self._check(batch)
    lora.check_key(self.cfg.lora, key)
    (loss, _), grads = self._jit_grad(self._params, self._frozen, batch,
                                      self._keys(batch, key))
    return float(loss), jax.tree.map(np.asarray, grads)

  def _keys(self, batch, key):
    """LoRA dropout's per-sequence keys, or None without dropout."""
    if key is None or self.cfg.lora is None or not self.cfg.lora.dropout:
      return None
    return lora.sequence_keys(key, np.arange(batch["input_ids"].shape[0]))

  def params(self) -> dict[str, Any]:
    """The current parameters.

    Returns:
      The parameter tree (frozen ones included), as host numpy arrays.
    """
    return jax.tree.map(np.asarray, self._whole(self._params, self._frozen))

  loss = property(lambda self: self._policy, doc="The policy loss, or None: cross-entropy.")

  @property
  def step_count(self) -> int:
    return self._step_count

  # Checkpoints (see megatrain_jax.checkpoint): two parts, "params" and "opt_state".

  def _parts(self) -> dict[str, Any]:
    return {"params": self._params, "opt_state": self._opt_state}

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """What `snapshot` holds.

    Returns:
      For "params" and "opt_state", the (shape, dtype name) of each leaf, keyed
      "leaf_NNNN" in `jax.tree` order.
    """
    return {k: {f"leaf_{i:04d}": (tuple(x.shape), str(x.dtype))
                for i, x in enumerate(jax.tree.leaves(t))}
            for k, t in self._parts().items()}

  def snapshot(self) -> Snapshot:
    """Host copies of the whole state, taken now (the next step donates it).

    Returns:
      The `Snapshot` of the parts of `state_layout()`.
    """
    return static_snapshot({k: {f"leaf_{i:04d}": np.array(x)
                                for i, x in enumerate(jax.tree.leaves(t))}
                            for k, t in self._parts().items()})

  def stats(self) -> dict[str, Any]:
    """Counters, as `StreamingTrainer.stats` names them.

    Returns:
      {"steps", "skipped_steps"} (a non-finite step raises here: none is skipped).
    """
    return {"steps": self._step_count, "skipped_steps": 0}

  def wait(self) -> None:
    """Nothing runs after a step returns: returns at once."""

  def close(self) -> None:
    """Nothing to stop (the device arrays go with the trainer)."""

  def __enter__(self) -> "ResidentTrainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def restore(self, read, step_count: int) -> None:
    """Replaces the whole state with the parts of `state_layout()` from `read`.

    Args:
      read: part name -> its arrays, keyed as in `state_layout()`.
      step_count: the step the state belongs to.
    """
    parts = {}
    for k, t in self._parts().items():
      leaves, treedef = jax.tree.flatten(t)
      arrays = read(k)
      parts[k] = treedef.unflatten(
          [jnp.asarray(arrays[f"leaf_{i:04d}"]) for i in range(len(leaves))])
    self._params, self._opt_state = parts["params"], parts["opt_state"]
    self._step_count = int(step_count)
