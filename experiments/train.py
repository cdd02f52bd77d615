"""Trains a Llama-family model.

  python experiments/train.py                      # tiny model on stdlib text, ~2 min on 2 CPU cores
  python experiments/train.py --model=small --steps=1000 --workdir=runs/small
  python experiments/train.py --hf_model_dir=path/to/llama --data=chat.jsonl \
      --data_format=sharegpt --export_dir=runs/sft/hf   # fine-tune a local HF checkpoint
  python experiments/train.py --hf_model_dir=path/to/llama --data=chat.jsonl \
      --data_format=sharegpt --lora_rank=16 --export_adapter_dir=runs/lora/adapter  # LoRA

Writes <workdir>/metrics.jsonl (one JSON object per logged step), <workdir>/loss.png
and checkpoints in <workdir>/checkpoints (every --save_every steps and at the end).
Running the same command again resumes from the latest complete checkpoint. Every
field of `TrainConfig`, `EngineConfig` and `DistributedConfig` is a flag (`--help`
lists them).

Several processes (one per host; docs/scale_out.md): the same command in each, with
  --coordinator_address=host0:1234 --num_processes=2 --process_id=0   (1 on the other)
or none of these under SLURM or Open MPI, whose environment JAX reads.
"""

import sys

from absl import app, flags, logging

from megatrain_jax import config_flags
from megatrain_jax import distributed
from megatrain_jax import train as train_lib
from megatrain_jax.engine import EngineConfig
from megatrain_jax import launch

for _name in (config_flags.define_flags(train_lib.TrainConfig)
              + config_flags.define_flags(EngineConfig)
              + config_flags.define_flags(distributed.DistributedConfig)):
  flags.declare_key_flag(_name)
FLAGS = flags.FLAGS


def _batch_size(text: str):
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise app.UsageError(f"--batch_size must be an integer or 'auto', got {text!r}.") from None


def main(argv):
  del argv
  launch.use_huge_pages()  # first: may restart the process once, see its docstring
  logging.set_verbosity(logging.INFO)
  try:
    ec = EngineConfig(**config_flags.from_flags(EngineConfig))
    tc = train_lib.TrainConfig(**config_flags.from_flags(
        train_lib.TrainConfig, batch_size=_batch_size(str(FLAGS.batch_size)),
        engine_config=ec))
    dc = distributed.DistributedConfig(**config_flags.from_flags(distributed.DistributedConfig))
    train_lib.run(tc, dc)
  except (ValueError, OSError) as e:
    # Bad input: the message alone (a misused flag still gets absl's flag listing).
    sys.exit(f"train.py: error: {e}")


if __name__ == "__main__":
  app.run(main)
