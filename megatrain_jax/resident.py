"""The reference trainer: the whole model on the device, one jitted step."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.batch import check_batch
from megatrain_jax.models.llama import Llama
from megatrain_jax.models.loss import model_loss


class ResidentTrainer:
  """Trains `model` with `optimizer` in one `jax.jit` step, params donated.

  This is the yardstick: `StreamingTrainer` must give the same parameters.
  `remat=True` recomputes each block in the backward (`jax.checkpoint`), the
  same recompute work the streaming engine does. The model is copied, not
  modified; `params()` returns the trained tree.
  """

  def __init__(self, model: Llama, optimizer: optax.GradientTransformation,
               remat: bool = False, compute_dtype=jnp.float32,
               loss_chunk_tokens: int | None = None):
    self.cfg = model.cfg
    self.optimizer = optimizer
    self.remat = remat
    self.compute_dtype = compute_dtype
    self._chunk = loss_chunk_tokens
    self._params = jax.tree.map(lambda a: jnp.array(a, copy=True),
                                model.param_tree())
    self._opt_state = optimizer.init(self._params)
    self._step_count = 0
    self._jit_step = jax.jit(self._step_fn, donate_argnums=(0, 1))
    self._jit_grad = jax.jit(jax.value_and_grad(self._loss))

  def _loss(self, params, batch):
    return model_loss(self.cfg, params, batch, self.compute_dtype, self._chunk,
                      self.remat)

  def _step_fn(self, params, opt_state, batch):
    loss, grads = jax.value_and_grad(self._loss)(params, batch)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

  def step(self, batch: dict[str, Any]) -> dict[str, float]:
    batch = check_batch(self.cfg, batch)
    self._params, self._opt_state, metrics = self._jit_step(
        self._params, self._opt_state, batch)
    self._step_count += 1
    out = {k: float(v) for k, v in metrics.items()}
    if not math.isfinite(out["loss"]):
      raise FloatingPointError(
          f"Non-finite loss {out['loss']} at step {self._step_count}.")
    out["tokens"] = float(batch["loss_mask"].sum())
    return out

  def loss_and_grads(self, batch: dict[str, Any]):
    """(loss, gradient tree as numpy) at the current parameters; no update."""
    loss, grads = self._jit_grad(self._params, check_batch(self.cfg, batch))
    return float(loss), jax.tree.map(np.asarray, grads)

  def params(self) -> dict[str, Any]:
    return jax.tree.map(np.asarray, self._params)

  @property
  def step_count(self) -> int:
    return self._step_count
