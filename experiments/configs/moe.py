"""A mixture-of-experts model (the `tiny_moe` preset: 8 experts, 2 per token) on the
default data, with a held-out loss.

  python experiments/train.py --config=experiments/configs/moe.py

200 steps of 16 x 128 tokens on 2 CPU cores: see the runtime and the final losses
in docs/engine.md ("Experiments").
"""

from megatrain_jax import configs
from megatrain_jax.train_config import TrainConfig


def get_config():
  return configs.config_dict(TrainConfig(workdir="runs/moe", model="tiny_moe",
                                         eval_every=50))
