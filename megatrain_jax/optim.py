"""AdamW with a fused host path.

`adamw(...)` behaves as `optax.adamw(...)` everywhere (same init, same update, same
state). It also carries its hyperparameters, so the streaming engine's host
optimizer can apply it as one fused element-wise expression over a unit's flat
buffer, reading and writing each of p, m, v once. That expression is optax's own
sequence of operations, so the result is the same as `optax.adamw`'s, bit for bit
(a test checks this). Any other transform goes through optax as it is.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


class AdamWHyper(NamedTuple):
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
  """`optax.adamw` (no mask, no Nesterov) that the engine can run fused on the host."""
  tx = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                   weight_decay=weight_decay)
  return AdamW(tx.init, tx.update,
               AdamWHyper(learning_rate, b1, b2, eps, eps_root, weight_decay))


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0) -> AdamW:
  """`optax.adam` as the fused-capable AdamW with zero weight decay.

  Note: with weight_decay=0 optax.adamw's update equals optax.adam's except for the
  `u + 0 * p` term, which changes no finite value.
  """
  return adamw(learning_rate, b1, b2, eps, eps_root, weight_decay=0.0)


def fused_adamw_update(h: AdamWHyper, params, grads, state):
  """optax.adamw's update and apply_updates on one flat buffer, as one expression.

  `state` is what `optax.adamw(...).init(params)` returns for a flat `params`.
  Returns (new_params, new_state).
  """
  adam_state, decay_state, lr_state = state
  count_inc = optax.safe_increment(adam_state.count)
  mu = (1 - h.b1) * (grads ** 1) + h.b1 * adam_state.mu
  nu = (1 - h.b2) * (grads ** 2) + h.b2 * adam_state.nu
  mu_hat = mu / (1 - h.b1 ** count_inc).astype(mu.dtype)
  nu_hat = nu / (1 - h.b2 ** count_inc).astype(nu.dtype)
  u = mu_hat / (jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  if h.weight_decay != 0.0:  # optax skips a zero constant decay
    u = u + h.weight_decay * params
  if callable(h.learning_rate):
    step_size = -h.learning_rate(lr_state.count)
    u = u * jnp.array(step_size, dtype=u.dtype)
    lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
  else:
    u = u * (-h.learning_rate)
  new_params = jnp.asarray(params + u).astype(jnp.asarray(params).dtype)
  new_state = (adam_state._replace(count=count_inc, mu=mu, nu=nu), decay_state, lr_state)
  return new_params, new_state


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
  """
  tx = optax.chain(optax.clip_by_global_norm(max_norm), inner)
  return ClipThen(tx.init, tx.update, float(max_norm), inner)


def clip_with_norm(g, g_norm, max_norm: float):
  """optax.clip_by_global_norm's per-leaf step, given the global norm."""
  return jax.lax.select(g_norm < max_norm, g, (g / g_norm.astype(g.dtype)) * max_norm)
