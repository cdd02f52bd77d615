"""Will it fit, and how fast? Prints the planner's prediction as a table.

  python experiments/plan.py --model=7b --hardware=h200 --batch_size=8 --seq_len=4096
  python experiments/plan.py --hf_config=path/to/config.json --hardware=gh200 --batch_size=auto
  python experiments/plan.py --model=small --hardware=measured   # calibrates this machine (~15 s)
  python experiments/plan.py --model=70b --hosts=4 --data_parallel=8 --batch_size=64  # 32 devices

  python experiments/plan.py --model=70b --hardware=workstation --state_tier=disk --batch_size=8
  python experiments/plan.py --model=123b --hardware=workstation --state_tier=disk \
      --stream_copy=disk --batch_size=1   # the copies on the drives too
  python experiments/plan.py --model=7b --hardware=h200 --grpo=32x8:256+768   # one GRPO iteration

Hardware: h200, gh200, h100_pcie, a100, workstation (an RTX 4090 with 256 GB of RAM and
4 NVMe drives, for --state_tier=disk), rtx3090, rtx_a6000, tpu_v5p, tpu_v6e, mi300x
(published peaks, sources in megatrain_jax/planner/hardware.py), or measured.
"""

from absl import app, flags

from megatrain_jax import planner
from megatrain_jax.planner import rl as rl_planner
from megatrain_jax.bench import calibrate
from megatrain_jax.engine import EngineConfig
from megatrain_jax.engine.config import ACTIVATIONS, DTYPES, RECOMPUTE, STATE_TIERS, \
    STREAM_COPIES
from megatrain_jax.models.config import PRESETS, preset
from megatrain_jax.optim import adamw

flags.DEFINE_string("model", "7b", f"A preset: {sorted(PRESETS)}.")
flags.DEFINE_string("hf_config", None, "A Hugging Face config.json (overrides --model).")
flags.DEFINE_string("hardware", "h200", "A hardware profile, or 'measured'.")
flags.DEFINE_string("batch_size", "auto", "Sequences per step, or 'auto' (the largest that fits).")
flags.DEFINE_integer("seq_len", 4096, "Tokens per sequence.")
flags.DEFINE_enum("compute_dtype", "bfloat16", list(DTYPES), "Compute dtype.")
flags.DEFINE_integer("prefetch_depth", 2, "Units fetched ahead.")
flags.DEFINE_integer("checkpoint_every", 1, "Activation checkpoint every N layers.")
flags.DEFINE_integer("grad_accum", 1, "Micro-batches per step.")
flags.DEFINE_integer("data_parallel", 1, "Devices per host (the batch is split over all).",
                     lower_bound=1)
flags.DEFINE_integer("hosts", 1, "Hosts, each with the whole host state.", lower_bound=1)
flags.DEFINE_enum("activations", "auto", list(ACTIVATIONS),
                  "Where activation checkpoints wait (auto: host when the device is short).")
flags.DEFINE_enum("recompute", "full", list(RECOMPUTE),
                  "What a layer's backward recomputes (the table compares all three).")
flags.DEFINE_integer("attention_block", None, "Attention in blocks of this many tokens "
                     "(default: the model's, or 1024 when the model does not fit without).")
flags.DEFINE_integer("mlp_chunk", None, "Feed-forward in chunks of this many tokens "
                     "(default: the model's, or 8192 when it does not fit without).")
flags.DEFINE_enum("state_tier", "host", list(STATE_TIERS), "Where the fp32 masters and "
                  "optimizer state live: host RAM, or files on the profile's NVMe drives.")
flags.DEFINE_enum("stream_copy", "auto", list(STREAM_COPIES), "Where the compute-dtype "
                  "copies live: auto/keep (host RAM, on an accelerator), or disk (files "
                  "beside the state, with --state_tier=disk: read at each fetch).")
flags.DEFINE_integer("state_in_flight", 2, "With --state_tier=disk: units whose state "
                     "is read ahead, and written behind, at most (pieces, with AdamW: "
                     "at least one per host thread).", lower_bound=1)
flags.DEFINE_integer("host_threads", None, "Threads of the host update (default: this "
                     "machine's CPUs); with --state_tier=disk, pieces updated at once.",
                     lower_bound=1)
flags.DEFINE_string("grpo", None, "Predict one GRPO iteration instead of a step: "
                    "PROMPTSxGROUP:PROMPT_LEN+COMPLETION_LEN[:POLICY_STEPS[:GENERATE_ROWS]], "
                    "e.g. 32x8:256+768:1:64 (docs/rl.md).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  try:
    cfg = (planner.config_from_hf_json(FLAGS.hf_config) if FLAGS.hf_config
           else preset(FLAGS.model))
    hw = (calibrate.measure_hardware() if FLAGS.hardware == "measured"
          else planner.hardware(FLAGS.hardware))
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from None
  cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, FLAGS.seq_len))
  cfg = cfg.replace(**{k: FLAGS[k].value for k in ("attention_block", "mlp_chunk")
                       if FLAGS[k].value is not None})
  ec = EngineConfig(prefetch_depth=FLAGS.prefetch_depth, checkpoint_every=FLAGS.checkpoint_every,
                    compute_dtype=FLAGS.compute_dtype, grad_accum=FLAGS.grad_accum,
                    activations=FLAGS.activations, recompute=FLAGS.recompute,
                    data_parallel=FLAGS.data_parallel, state_tier=FLAGS.state_tier,
                    state_in_flight=FLAGS.state_in_flight, host_threads=FLAGS.host_threads,
                    stream_copy=FLAGS.stream_copy,
                    state_dir="the profile's drives" if FLAGS.state_tier == "disk" else None)
  opt = adamw(1e-4)
  if FLAGS.grpo:
    print(_grpo(cfg, opt, ec, hw, FLAGS.grpo).table())  # the tool's output
    return
  devices = FLAGS.data_parallel * FLAGS.hosts
  if FLAGS.batch_size == "auto":
    cfg = planner.fit_compute(cfg, ec, hw, ec.grad_accum, FLAGS.seq_len)
    largest = lambda **kw: planner.largest_batch(cfg, ec, hw.device_bytes, FLAGS.seq_len,
                                                 hw.flash_attention, hosts=FLAGS.hosts, **kw)
    # The largest that fits the device and the host; where the host holds none, the
    # device's largest, so the plan shows what does not fit.
    batch = largest(optimizer=opt, hw=hw) or largest()
    if batch == 0:
      raise app.UsageError(f"Not even one sequence of {FLAGS.seq_len} tokens fits {hw.name}.")
  else:
    batch = int(FLAGS.batch_size)
    if batch % devices:
      raise app.UsageError(f"--batch_size={batch} does not split over {devices} devices.")
    cfg = planner.fit_compute(cfg, ec, hw, batch // devices, FLAGS.seq_len)
  plan = planner.plan(cfg, opt, ec, hw, batch, FLAGS.seq_len, hosts=FLAGS.hosts)
  print(plan.table())  # the tool's output


def _grpo(cfg, opt, ec, hw, spec: str):
  """The GRPO estimate of a --grpo spec."""
  try:
    shape, lengths, *rest = spec.split(":")
    prompts, group = (int(x) for x in shape.split("x"))
    prompt_len, completion_len = (int(x) for x in lengths.split("+"))
    policy_steps, generate_rows = [int(x) for x in rest] + [1, None][len(rest):]
  except ValueError:
    raise app.UsageError(f"--grpo={spec!r}: write PROMPTSxGROUP:PROMPT_LEN+COMPLETION_LEN"
                         "[:POLICY_STEPS[:GENERATE_ROWS]], e.g. 32x8:256+768:1:64.") from None
  cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, prompt_len + completion_len))
  try:
    return rl_planner.grpo_iteration(cfg, opt, ec, hw, prompts, group, prompt_len,
                                     completion_len, policy_steps,
                                     generate_rows=generate_rows)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  app.run(main)
