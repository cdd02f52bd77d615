"""A mixture-of-experts model (the `tiny_moe` preset: 8 experts, 2 per token) on the
default data, with a held-out loss.

  python experiments/train.py --config=experiments/configs/moe.py

200 steps of 16 x 128 tokens, 5% of the documents held out and evaluated every 50
steps. On 2 CPU cores: 173 s; the training loss falls from 5.63 to 2.37 and the
held-out loss from 2.96 (step 50) to 2.38 (step 200).
"""

from megatrain_jax import configs
from megatrain_jax.train_config import TrainConfig


def get_config():
  return configs.config_dict(TrainConfig(workdir="runs/moe", model="tiny_moe",
                                         eval_every=50))
