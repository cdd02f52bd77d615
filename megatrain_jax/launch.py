"""What a launcher does first: ask glibc's malloc for transparent huge pages.

On the CPU backend XLA allocates every call's scratch with malloc (a block's
backward at d_model 512 and 2K tokens: 232 MB), and a buffer over malloc's mmap
threshold (`engine.host.malloc`) is a fresh mapping whose 4 KiB pages fault in on
first touch. So an engine that runs one call per layer faults its scratch again in
every call, where one jitted model step faults it once. With transparent huge pages
a fault maps 2 MiB instead: the launchers (`experiments/*.py`, the figure scripts)
re-execute themselves once with glibc's malloc asking for them (`use_huge_pages`),
when the kernel offers them on request ("madvise" mode). Measured by
`experiments/bench.py` on a 2-core machine (d_model 512, 8 layers, 2K tokens per
step; docs/performance.md): streaming step 6.52 s without, 5.11 s with; resident
step with remat 5.64 s without, 5.40 s with.

A launcher calls `use_huge_pages()` on its first lines, before anything imports
JAX (importing `megatrain_jax` imports nothing heavy: the package loads lazily), so
the restart replaces a process that has done nothing yet; `describe()` gives the
line its `main` logs once. Without a restart, start the process with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (a notebook kernel, a debugger, a profiler).

This lives outside the engine: importing a library never restarts a process.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import Mapping


_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE)
OPT_OUT = "MEGATRAIN_HUGE_PAGES"  # set to 0 to keep the process as started


def thp_mode(path: str = _THP_MODE_FILE) -> str | None:
  """The kernel's transparent-huge-page mode.

  Args:
    path: the sysfs file that holds it.

  Returns:
    "always", "madvise" or "never", or None when it cannot be read.
  """
  try:
    with open(path, encoding="ascii") as f:
      m = re.search(r"\[(\w+)\]", f.read())
  except OSError:
    return None
  return m.group(1) if m else None


def glibc_has_hugetlb() -> bool:
  """Whether this is glibc 2.35 or later, which has the malloc huge-page tunable.

  Returns:
    The answer.
  """
  name, version = platform.libc_ver()
  try:
    major, minor = (int(x) for x in version.split(".")[:2])
  except ValueError:
    return False
  return name == "glibc" and (major, minor) >= (2, 35)


def huge_page_environ(environ: Mapping[str, str], mode: str | None
                      ) -> dict[str, str] | None:
  """The environment to re-execute with so malloc asks for huge pages.

  Args:
    environ: the current environment.
    mode: the kernel's transparent-huge-page mode (`thp_mode()`).

  Returns:
    A new environment, or None when re-executing would change nothing: the kernel
    gives huge pages to every mapping ("always") or to none ("never"), the tunable
    is already set, or the caller opted out with MEGATRAIN_HUGE_PAGES=0.
  """
  tunables = environ.get("GLIBC_TUNABLES", "")
  if (mode != "madvise" or "glibc.malloc.hugetlb" in tunables
      or environ.get(OPT_OUT) == "0"):
    return None
  env = dict(environ)
  env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, HUGE_PAGE_TUNABLE) if t)
  return env


def use_huge_pages() -> None:
  """Re-executes this process (same interpreter and command line) with malloc
  asking for transparent huge pages, when the kernel offers them on request.

  Call it on a launcher's first lines, before anything imports JAX: glibc reads the
  setting only at start, so a running process cannot change it, and a restart
  after heavy imports would do them twice. Returns at once when there is nothing
  to do (not Linux/glibc >= 2.35, mode not "madvise", already set, or
  MEGATRAIN_HUGE_PAGES=0). Logs nothing (logging is not set up yet): the restarted
  process logs `describe()`.
  """
  if platform.system() != "Linux" or not glibc_has_hugetlb():
    return
  env = huge_page_environ(os.environ, thp_mode())
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def describe(environ: Mapping[str, str] = os.environ) -> str:
  """What this process's malloc does about huge pages, for a launcher's log.

  Args:
    environ: the process's environment.

  Returns:
    One line.
  """
  if HUGE_PAGE_TUNABLE in environ.get("GLIBC_TUNABLES", ""):
    return (f"malloc asks for transparent huge pages ({HUGE_PAGE_TUNABLE}; set {OPT_OUT}=0 "
            "to start without).")
  return "malloc uses the kernel's default pages (docs/engine.md: huge pages)."
