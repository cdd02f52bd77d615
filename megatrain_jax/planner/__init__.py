"""Will it fit, and how fast? Hardware profiles (`hardware`), what a step costs
(`cost`), the plan (`plan`) and the compute settings a long sequence needs (`fit`)."""

from megatrain_jax.planner.hardware import GB, PROFILES, Hardware, hardware
from megatrain_jax.planner.cost import step_bytes, step_flops
from megatrain_jax.hf_config import config_from_hf_json
from megatrain_jax.planner.plan import (TB, Plan, device_peak, device_total, fastest,
                                        largest_batch, plan, resolve, workspace_bytes)
from megatrain_jax.planner.fit import LONG_CONTEXT, fit_compute
