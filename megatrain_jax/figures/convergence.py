"""Figure 7: convergence parity, streaming vs resident training on the same data (measured).

  python experiments/figures/convergence.py --out_dir=figures   # about 4 minutes

Both trainers start from the same parameters and see the same batches of stdlib
text; the curves overlay (fp32 on CPU they agree to rounding).
"""

from __future__ import annotations

from megatrain_jax import train as train_lib
from megatrain_jax.figures import common as figures


def train_config(trainer: str, quick: bool = False, out_dir: str = "figures"
                 ) -> train_lib.TrainConfig:
  """One curve's run (`experiments/configs/convergence.py` is the streaming one).

  Args:
    trainer: "streaming" or "resident".
    quick: 3 steps of 4 x 32 tokens on 20 KB of text instead of 200 steps of 16 x 128
      tokens on 4 MB.
    out_dir: where its workdir (`convergence_<trainer>`) goes.

  Returns:
    The `TrainConfig`.
  """
  return train_lib.TrainConfig(workdir=f"{out_dir}/convergence_{trainer}", trainer=trainer,
                               steps=3 if quick else 200, log_every=1, save_every=0,
                               batch_size=4 if quick else 16, seq_len=32 if quick else 128,
                               max_data_bytes=20_000 if quick else 4_000_000, progress=False)


def rows(quick: bool, out_dir: str) -> list[dict]:
  """Trains the streaming and the resident engine on the same data and logs every step.

  Args:
    quick: the small runs of `train_config`.
    out_dir: where each run's workdir goes.

  Returns:
    One row per engine and logged step: source ("measured"), engine, step, loss.
  """
  out = []
  for engine in ("streaming", "resident"):
    records = train_lib.run(train_config(engine, quick, out_dir))
    out += [{"source": "measured", "engine": engine, "step": r["step"], "loss": r["loss"]}
            for r in records if "loss" in r]
  return out


def draw(ax, rs) -> None:
  """Loss against step, resident solid and streaming dashed.

  Args:
    ax: the panel's axes.
    rs: the rows of `rows`.
  """
  for engine, style in (("resident", "-"), ("streaming", "--")):
    ax.plot(*figures.points(rs, "step", "loss", engine=engine), style, label=engine)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.legend()


TITLE = "Convergence: streaming vs resident (tiny, stdlib)"
PANELS = 1


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes convergence.csv and convergence.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "convergence", rows(quick, out_dir), draw, TITLE, PANELS)
