"""Will it fit, and how fast? Hardware profiles (`hardware`), what a step costs
(`cost`) and the plan (`plan`)."""

from megatrain_jax.planner.hardware import GB, PROFILES, Hardware, hardware
from megatrain_jax.planner.cost import step_bytes, step_flops
from megatrain_jax.hf_config import config_from_hf_json
from megatrain_jax.planner.plan import (LONG_CONTEXT, TB, Plan, device_peak, device_total,
                                        fastest, fit_compute, largest_batch, plan, resolve,
                                        workspace_bytes)
