"""Figure 3: depth scaling at fixed width: throughput and device memory.

  python experiments/figures/depth.py --out_dir=figures   # a few minutes

Predicted: a 7B-wide model (d=4096) from 28 to 180 layers on `h200`, batch 8 x 4096,
with the activation checkpoints on the device and in host memory. Measured: a
narrow model on this machine from 2 to 16 layers, both ways: the parameters on the
device stay flat because only a few layers are ever there, and with the checkpoints
in host memory so does the whole peak.
"""

from __future__ import annotations

import dataclasses

from megatrain_jax import planner
from megatrain_jax.engine import EngineConfig
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw


def rows(quick: bool) -> list[dict]:
  """Throughput and memory by layer count, predicted and measured.

  Predicted: the 7B shape from 28 to 180 layers on `h200` at 8 x 4096 tokens, bf16:
  parameters, model TFLOPS, device, in-flight parameter and gradient, and host GB,
  and the device GB with activations="host". Measured: a d_model 128 model at
  8 x 128 tokens: parameters, step time per layer, model TFLOPS and device peak MB,
  and the device peak MB with activations="host".

  Args:
    quick: 2 measured layers instead of 2 to 16, one timed step instead of 3, and
      with the checkpoints in host memory only.

  Returns:
    One row per point, with `source` "predicted" or "measured".
  """
  out = []
  ec = EngineConfig(compute_dtype="bfloat16")
  base = figures.PAPER_MODELS["7B"]
  for layers in (28, 48, 64, 96, 128, 180):
    cfg = base.replace(n_layers=layers)
    p = planner.plan(cfg, adamw(1e-4), ec, planner.PROFILES["h200"], 8, 4096)
    on_host = planner.plan(cfg, adamw(1e-4), dataclasses.replace(ec, activations="host"),
                           planner.PROFILES["h200"], 8, 4096)
    out.append({"source": "predicted", "layers": layers, "params_b": p.params / 1e9,
                "activations": p.activations,
                "device_gb_host_activations": on_host.device["total"] / 1e9,
                "tflops": p.model_tflops_per_s, "device_gb": p.device["total"] / 1e9,
                "device_params_and_grads_gb": (p.device["params_in_flight"]
                                               + p.device["gradients_in_flight"]) / 1e9,
                "host_gb": p.host["total"] / 1e9})
  small = LlamaConfig(vocab_size=260, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=384, max_seq_len=256)
  for layers in ((2,) if quick else (2, 4, 8, 16)):
    cfg = small.replace(n_layers=layers)
    h = figures.measure_streaming(cfg, 8, 128, EngineConfig(activations="host"),
                                  steps=1 if quick else 3)
    m = None if quick else figures.measure_streaming(
        cfg, 8, 128, EngineConfig(activations="device"), steps=3)
    out.append({"source": "measured", "layers": layers, "params_b": h["params"] / 1e9,
                "step_time_per_layer_s": m["step_time_s"] / layers if m else None,
                "tflops": (m or h)["model_tflops_per_s"],
                "device_peak_mb": m["device_peak_bytes"] / 1e6 if m else None,
                "step_time_per_layer_s_host_activations": h["step_time_s"] / layers,
                "device_peak_mb_host_activations": h["device_peak_bytes"] / 1e6})
  return out


def draw(axes, rs) -> None:
  """Left: predicted TFLOPS (with the paper's points) and device GB by layers; right:
  the measured device peak by layers.

  Args:
    axes: the two panels' axes.
    rs: the rows of `rows`.
  """
  ax0, ax1 = axes
  ax0.plot(*figures.points(rs, "layers", "tflops", source="predicted"), "o-",
           label="predicted TFLOPS, h200")
  ax0.plot([28, 180], [284, 227], "r*", markersize=10, label="paper: 284 -> 227 TFLOPS")
  ax0.set_xlabel("layers (d_model 4096)")
  ax0.set_ylabel("model TFLOPS")
  ax0b = ax0.twinx()
  ax0b.plot(*figures.points(rs, "layers", "device_gb", source="predicted"), "s--", color="g",
            label="predicted device GB")
  ax0b.plot(*figures.points(rs, "layers", "device_gb_host_activations", source="predicted"),
            "^:", color="m", label="predicted device GB, activations on host")
  ax0b.set_ylabel("device GB")
  ax0.legend(fontsize=7, loc="lower left")
  ax0b.legend(fontsize=7, loc="lower right")
  ax1.plot(*figures.points(rs, "layers", "device_peak_mb", source="measured"), "o-",
           label="measured device peak (MB)")
  ax1.plot(*figures.points(rs, "layers", "device_peak_mb_host_activations",
                           source="measured"), "^:", label="activations on host")
  ax1.set_xlabel("layers (d_model 128, this machine)")
  ax1.set_ylabel("MB")
  ax1.set_ylim(bottom=0)
  ax1.legend(fontsize=7)


TITLE = "Depth scaling at fixed width"
PANELS = 2


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes depth.csv and depth.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "depth", rows(quick), draw, TITLE, PANELS)
