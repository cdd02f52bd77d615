"""AdamW with a fused host path.

`adamw(...)` behaves as `optax.adamw(...)` everywhere (same init, same update, same
state). It also carries its hyperparameters, so the streaming engine's host
optimizer can apply optax's own sequence of element-wise operations straight to each
unit's flat buffers: in place, a cache-sized chunk at a time, one thread per part of
the unit (`engine/host/optimizer.py`), so p, m and v are each read and written once
from memory. For a given gradient the result is `optax.adamw`'s, bit for bit (tests
check this). Any other transform goes through optax as it is.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


class AdamWHyper(NamedTuple):
  """The hyperparameters of an `adamw` transform, as `optax.adamw` takes them."""
  learning_rate: Any  # float or optax schedule
  b1: float
  b2: float
  eps: float
  eps_root: float
  weight_decay: float


class AdamW(NamedTuple):
  """An optax GradientTransformation (init, update) that also names its hyperparameters."""
  init: Callable
  update: Callable
  hyper: AdamWHyper


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, weight_decay: float = 1e-4) -> AdamW:
  """`optax.adamw` (no mask, no Nesterov) that the engine can run fused on the host.

  Args:
    learning_rate: a float, or an optax schedule of the step count.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the second moment.
    eps_root: added to the second moment inside the root.
    weight_decay: the decoupled weight decay rate (scaled by the learning rate).

  Returns:
    optax.adamw's init and update, with the hyperparameters.
  """
  tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   weight_decay=weight_decay)
  return AdamW(tx.init, tx.update,
               AdamWHyper(learning_rate, b1, b2, eps, eps_root, weight_decay))


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0) -> AdamW:
  """`optax.adam` as the fused-capable AdamW with zero weight decay.

  Note: with weight_decay=0 optax.adamw's update equals optax.adam's except for the
  `u + 0 * p` term, which changes no finite value.

  Args:
    learning_rate: a float, or an optax schedule of the step count.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the second moment.
    eps_root: added to the second moment inside the root.

  Returns:
    The `adamw` transform with weight_decay=0.
  """
  return adamw(learning_rate, b1, b2, eps, eps_root, weight_decay=0.0)


def fused_adamw_update(h: AdamWHyper, params, grads, state):
  """optax.adamw's update and apply_updates on one flat buffer, as one expression.

  `state` is what `optax.adamw(...).init(params)` returns for a flat `params`.
  Returns (new_params, new_state).

  Args:
    h: the hyperparameters.
    params: the flat parameters.
    grads: their gradient.
    state: the optimizer state of `params`.
  """
  adam_state, decay_state, lr_state = state
  scalars, new_lr_state = adamw_scalars(h, adam_state.count, lr_state)
  mu, nu = adamw_moments(h, grads, adam_state.mu, adam_state.nu)
  new_params = adamw_params(h, params, mu, nu, scalars)
  new_state = (adam_state._replace(count=scalars.count, mu=mu, nu=nu), decay_state, new_lr_state)
  return new_params, new_state


class AdamWScalars(NamedTuple):
  """The per-step scalars of an AdamW update (the same for every element)."""
  count: Any  # the incremented step count
  bias1: Any  # 1 - b1 ** count, as an fp32 scalar
  bias2: Any
  step_size: Any  # -learning_rate: a Python float, or an fp32 array for a schedule


def adamw_scalars(h: AdamWHyper, count, lr_state):
  """optax.adamw's scalars for the step after `count`; returns (scalars, new lr_state).

  Args:
    h: the hyperparameters.
    count: the step count of the Adam state.
    lr_state: the learning-rate part of the state (a step count for a schedule); it
      advances only for a schedule.
  """
  count_inc = optax.safe_increment(count)
  bias1 = (1 - h.b1 ** count_inc).astype(jnp.float32)
  bias2 = (1 - h.b2 ** count_inc).astype(jnp.float32)
  if callable(h.learning_rate):
    step_size = jnp.array(-h.learning_rate(lr_state.count), dtype=jnp.float32)
    lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
  else:
    step_size = -h.learning_rate
  return AdamWScalars(count_inc, bias1, bias2, step_size), lr_state


def adamw_moments(h: AdamWHyper, grads, mu, nu):
  """The new first and second moments, as optax.scale_by_adam computes them.

  Args:
    h: the hyperparameters.
    grads: the gradient.
    mu: the first moment.
    nu: the second moment.

  Returns:
    (new mu, new nu).
  """
  mu = (1 - h.b1) * (grads ** 1) + h.b1 * mu
  nu = (1 - h.b2) * (grads ** 2) + h.b2 * nu
  return mu, nu


def adamw_params(h: AdamWHyper, params, mu, nu, s: AdamWScalars, in_loop: bool = False):
  """The new parameters from the new moments, as optax.adamw then apply_updates.

  With `in_loop`, the same bits from inside a loop body. XLA's CPU backend turns
  optax's `mu / bias1` into `mu * (1 / bias1)` when it compiles the whole update,
  but keeps the division inside a loop, and there rewrites `(mu / bias1) / d` as
  `mu / (bias1 * d)`; the loop form states the first rewrite itself.

  Args:
    h: the hyperparameters.
    params: the parameters.
    mu: the new first moment.
    nu: the new second moment.
    s: the step's scalars, from `adamw_scalars`.
    in_loop: whether this runs inside a loop body.

  Returns:
    The new parameters, in the dtype of `params`.
  """
  if in_loop:
    mu_hat, nu_hat = mu * (1 / s.bias1), nu * (1 / s.bias2)
  else:
    mu_hat, nu_hat = mu / s.bias1, nu / s.bias2
  u = mu_hat / (jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  if h.weight_decay != 0.0:  # optax skips a zero constant decay
    u = u + h.weight_decay * params
  u = u * s.step_size
  return jnp.asarray(params + u).astype(jnp.asarray(params).dtype)


class ClipThen(NamedTuple):
  """`optax.chain(optax.clip_by_global_norm(max_norm), inner)`, naming its parts."""
  init: Callable
  update: Callable
  max_norm: float
  inner: Any


def clip_by_global_norm(max_norm: float, inner) -> ClipThen:
  """Global-norm clipping, then `inner`: the same transform as the optax chain.

  The streaming engine splits it: the norm comes from per-unit sums of squares
  after the sweep, then each unit is clipped and updated on its own, dispatched
  without waiting, so the next step's forward can start as soon as the first
  units are done. (Summing per unit changes the norm's rounding, not its value.)

  Args:
    max_norm: the global norm the gradients are clipped to.
    inner: the transform applied to the clipped gradients.

  Returns:
    The chain's init and update, with `max_norm` and `inner`.
  """
  tx = optax.chain(optax.clip_by_global_norm(max_norm), inner)
  return ClipThen(tx.init, tx.update, float(max_norm), inner)


def clip_with_norm(g, g_norm, max_norm: float):
  """optax.clip_by_global_norm's per-leaf step, given the global norm.

  Args:
    g: one gradient leaf.
    g_norm: the global norm of the whole gradient.
    max_norm: the norm to clip to.

  Returns:
    `g` when `g_norm < max_norm`, else `g` scaled by `max_norm / g_norm`.
  """
  return jax.lax.select(g_norm < max_norm, g, (g / g_norm.astype(g.dtype)) * max_norm)
