r"""Trains a Llama-family model, as an experiment's config file says.

  python experiments/train.py            # the main job: experiments/configs/default.py
  python experiments/train.py --config=experiments/configs/chat.py
  python experiments/train.py --config.steps=1000 --config.model=small \
      --config.workdir=runs/small         # any field overridden
  python experiments/train.py --config=experiments/configs/lora.py \
      --config.hf_model_dir=path/to/llama  # LoRA on a local HF checkpoint
  python experiments/train.py --describe  # every field, its value and its help

Each file in experiments/configs/ is one experiment; its docstring gives the
command, the runtime and the expected result. Writes <workdir>/metrics.jsonl (one
JSON object per logged step and evaluation), <workdir>/loss.png and checkpoints in
<workdir>/checkpoints (every save_every steps and at the end); TensorBoard events
with --config.tensorboard_dir. Running the same command again resumes from the
latest complete checkpoint.

Several processes (one per host; docs/scale_out.md): the same command in each, with
  --coordinator_address=host0:1234 --num_processes=2 --process_id=0   (1 on the other)
or none of these under SLURM or Open MPI, whose environment JAX reads.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

# pylint: disable=wrong-import-position
import os  # noqa: E402
import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from megatrain_jax import configs  # noqa: E402
from megatrain_jax import distributed  # noqa: E402
from megatrain_jax import train as train_lib  # noqa: E402

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")


def _no_such_field(e: AttributeError):
  """ml_collections' error for an override of a field the config does not have."""
  text = str(e.args[0]).encode().decode("unicode_escape").replace("'", "")
  sys.exit(f"train.py: error: no such config field: {text.replace(chr(10), '. ')}")


try:  # without --config=, the overrides in argv are checked against the default here
  _CONFIG = config_flags.DEFINE_config_file(
      "config", DEFAULT, "An experiment's config file (experiments/configs/); any field "
      "is overridden by --config.<field>=<value>, e.g. --config.engine.prefetch_depth=3.")
except AttributeError as _e:
  _no_such_field(_e)
_DESCRIBE = flags.DEFINE_bool("describe", False, "List every field of the config, its "
                              "value and its help, and exit.")
for _name in distributed.define_flags():
  flags.declare_key_flag(_name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments {argv[1:]}: every setting is a "
                         "--config.<field>=<value> (see --describe).")
  logging.set_verbosity(logging.INFO)
  try:
    tc = configs.train_config(_CONFIG.value)
    if _DESCRIBE.value:
      print("\n".join(configs.describe(tc)))  # pylint: disable=print-function
      return
    logging.info("%s", launch.describe())
    train_lib.run(tc, distributed.from_flags())
  except (ValueError, OSError) as e:
    # Bad input: the message alone.
    sys.exit(f"train.py: error: {e}")


def _parse(argv):
  try:
    return app.parse_flags_with_usage(argv)
  except AttributeError as e:  # with --config=, the overrides are checked here
    _no_such_field(e)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)
