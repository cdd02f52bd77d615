"""Dense against blockwise attention: where `attention_block="auto"` switches kernels.

One training step (forward and backward, jitted) of a one-layer model with each
kernel, side by side, at growing sequence lengths: the ratio blockwise / dense is
what `models.layers.AUTO_BLOCKWISE_FROM` is read from (the first length from which
the blockwise kernel is no slower), at two widths: the acceptance model (d_model 64)
and the benchmark model's (d_model 512). Runs when named (`--parts=attention`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.models import layers
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.llama import Llama
from megatrain_jax.models.loss import model_loss

LENGTHS = (256, 512, 1024, 2048, 4096)
WIDTHS = {"d64": LlamaConfig(vocab_size=260, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                             d_ff=128, max_seq_len=max(LENGTHS)),
          "d512": LlamaConfig(vocab_size=260, d_model=512, n_layers=1, n_heads=8,
                              n_kv_heads=4, d_ff=1536, max_seq_len=max(LENGTHS))}


def attention_crossover(s: Suite, lengths: tuple[int, ...] = LENGTHS) -> dict[str, Any]:
  """Step time of each kernel at each length, and their ratio.

  Args:
    s: the suite (its warm-up and repetitions).
    lengths: sequence lengths (one sequence a step).

  Returns:
    {"attention_crossover": {width: {length: {"dense_s", "blockwise_s", "ratio"}}},
     "attention_auto_block": the blockwise kernel's block}.
  """
  out: dict[str, Any] = {}
  for name, base in WIDTHS.items():
    rows = {}
    for t in lengths:
      fns = {}
      for kernel, block in (("dense", None), ("blockwise", layers.AUTO_BLOCK)):
        cfg = base.replace(attention_block=block)
        params = Llama(cfg, rngs=nnx.Rngs(0)).param_tree()
        batch = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, 1, t).items()}
        step = jax.jit(jax.value_and_grad(lambda p, b, cfg=cfg: model_loss(cfg, p, b)))
        fns[kernel] = lambda step=step, params=params, batch=batch: step(params, batch)
      times = median_times(fns, s.warmup, s.reps)
      rows[t] = {"dense_s": times["dense"], "blockwise_s": times["blockwise"],
                 "ratio": times["blockwise"] / times["dense"]}
    out[name] = rows
  return {"attention_crossover": out, "attention_auto_block": layers.AUTO_BLOCK}
