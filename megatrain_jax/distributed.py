"""Several processes, one run: `jax.distributed` from flags or a cluster's environment.

A run on N processes (one per host, or several on one machine) starts the same
command in each, with `--coordinator_address`, `--num_processes` and
`--process_id` (or under SLURM / Open MPI, none of them: JAX reads the launcher's
environment). `initialize` connects them before any JAX backend starts; on the
CPU backend it selects gloo collectives. From then on:

- the engine's mesh spans every process's devices (`engine/device/mesh.py`): each process
  feeds its own devices and its own rows of every batch, and holds a full copy of
  the host state, to which every process applies the same update;
- the data reader gives each process its share of every global batch
  (`data.PackedDataset`);
- process 0 writes the checkpoints (the state is the same in every process), and
  every process reads them back on resume (`checkpoint.py`);
- a process that dies is noticed by JAX's coordination service, which stops the
  others within `heartbeat_timeout_s` with an error that names the lost process
  ("The following tasks are unhealthy (stopped sending heartbeats): <id>"), or at
  once, naming the leader, when process 0 was the one lost.

`docs/scale_out.md` gives the launch commands.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import jax
from absl import flags, logging
from jax.experimental import multihost_utils

from megatrain_jax.engine.config import config_field as _field


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a run of several (all None: alone, or as the cluster's
  launcher says). Every field is a flag of `experiments/train.py` (`define_flags`)."""

  coordinator_address: str | None = _field(
      None, "host:port of process 0, where the processes meet (the same in every process).")
  num_processes: int | None = _field(None, "Processes in the run.", low=1)
  process_id: int | None = _field(None, "This process's index, 0 .. num_processes - 1.",
                                  low=0)
  heartbeat_timeout_s: int = _field(
      30, "A process that stops sending heartbeats for this long is declared lost, and "
      "the others exit with an error naming it.", low=1)
  initialization_timeout_s: int = _field(
      300, "How long the processes wait for each other at start.", low=1)
  shutdown_timeout_s: int = _field(
      3600, "How long a finished process waits at exit for the others (process 0 may "
      "still be writing the last checkpoint).", low=1)

  def explicit(self) -> bool:
    """Whether any of the three connection flags is given.

    Returns:
      True when the run is described by flags rather than by the environment.
    """
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                       self.process_id))

  def validate(self) -> None:
    """Checks the connection flags together.

    Raises:
      ValueError: some but not all of them, or a process id out of range.
    """
    if not self.explicit():
      return
    missing = [k for k in ("coordinator_address", "num_processes", "process_id")
               if getattr(self, k) is None]
    if missing and self.num_processes != 1:
      raise ValueError(f"A run of several processes needs --coordinator_address, "
                       f"--num_processes and --process_id in every process; missing: "
                       f"{', '.join('--' + m for m in missing)}.")
    if self.num_processes and self.process_id is not None and not (
        0 <= self.process_id < self.num_processes):
      raise ValueError(f"--process_id={self.process_id} is not in 0 .. "
                       f"{self.num_processes - 1} (--num_processes={self.num_processes}).")


# Environments in which `jax.distributed.initialize()` finds the run by itself, with
# the variable that holds the number of processes.
CLUSTER_ENVS = {"SLURM": "SLURM_NTASKS", "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """Defines one absl flag per `DistributedConfig` field (`--coordinator_address`,
  `--num_processes`, `--process_id`, the timeouts).

  Args:
    flag_values: where to define them.

  Returns:
    Their names (a launcher passes them to `flags.declare_key_flag`, so that its
    `--help` lists them).
  """
  names = []
  for f in dataclasses.fields(DistributedConfig):
    define = flags.DEFINE_string if f.name == "coordinator_address" else flags.DEFINE_integer
    kw = {} if f.name == "coordinator_address" else {"lower_bound": f.metadata.get("low")}
    define(f.name, f.default, f.metadata["help"], flag_values=flag_values, **kw)
    names.append(f.name)
  return names


def from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> DistributedConfig:
  """The `DistributedConfig` the flags of `define_flags` hold.

  Args:
    flag_values: the parsed flags.

  Returns:
    The config.
  """
  return DistributedConfig(**{f.name: flag_values[f.name].value
                              for f in dataclasses.fields(DistributedConfig)})


def cluster_from_env(environ=os.environ) -> str | None:
  """The cluster launcher that started this process as one of several, if any.

  Args:
    environ: the environment.

  Returns:
    Its name (a key of `CLUSTER_ENVS`), or None.
  """
  for name, var in CLUSTER_ENVS.items():
    if int(environ.get(var, "1") or 1) > 1:
      return name
  return None


def _timeouts(dc: DistributedConfig) -> dict[str, int]:
  """The timeout arguments this JAX's `jax.distributed.initialize` accepts."""
  known = inspect.signature(jax.distributed.initialize).parameters
  wanted = {"heartbeat_timeout_seconds": dc.heartbeat_timeout_s,
            "initialization_timeout": dc.initialization_timeout_s,
            "shutdown_timeout_seconds": dc.shutdown_timeout_s}
  return {k: v for k, v in wanted.items() if k in known}


def initialize(dc: DistributedConfig = DistributedConfig()) -> None:
  """Joins this process to its run; call it before anything starts a JAX backend.

  Nothing happens for a process alone, or when `jax.distributed` is initialized
  already (by the caller, in a notebook).

  Args:
    dc: the flags (all None: alone, unless a cluster launcher started several).

  Raises:
    ValueError: inconsistent flags.
  """
  dc.validate()
  cluster = None if dc.explicit() else cluster_from_env()
  if (not cluster and (dc.num_processes or 1) == 1) or jax.distributed.is_initialized():
    return
  if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives
  where = dict(coordinator_address=dc.coordinator_address, num_processes=dc.num_processes,
               process_id=dc.process_id) if dc.explicit() else {}
  jax.distributed.initialize(**where, **_timeouts(dc))
  logging.info("Joined a run of several processes (%s). A process lost for %d s stops "
               "the others with an error naming it.", cluster or dc.coordinator_address,
               dc.heartbeat_timeout_s)


def is_primary() -> bool:
  """Whether this process writes the run's files (metrics, checkpoints, exports).

  Returns:
    True in process 0.
  """
  return jax.process_index() == 0


def check_same(value, what: str) -> None:
  """Checks that every process holds the same value (a collective: all call it).

  Args:
    value: a number or array.
    what: what it is, for the error.

  Raises:
    RuntimeError: the processes disagree.
  """
  if jax.process_count() > 1:
    try:
      multihost_utils.assert_equal(value, f"The processes disagree on {what}")
    except AssertionError as e:
      raise RuntimeError(str(e)) from None
