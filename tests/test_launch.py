"""The launchers' restart with transparent huge pages (`megatrain_jax.launch`)."""

import os
import re
import subprocess
import sys

import pytest

from megatrain_jax import launch


@pytest.mark.parametrize("environ, mode, want", [
    ({}, "madvise", "glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise",
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", None),  # the user's choice
    ({"MEGATRAIN_HUGE_PAGES": "0"}, "madvise", None),
    ({}, "always", None),
    ({}, "never", None),
    ({}, None, None),
])
def test_huge_page_environ(environ, mode, want):
  env = launch.huge_page_environ(environ, mode)
  assert (env and env["GLIBC_TUNABLES"]) == want
  if env is not None:
    assert env is not environ and {k: env[k] for k in environ if k != "GLIBC_TUNABLES"} == \
        {k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
  f = tmp_path / "enabled"
  f.write_text("always [madvise] never\n")
  assert launch.thp_mode(str(f)) == "madvise"
  assert launch.thp_mode(str(tmp_path / "missing")) is None


def test_use_huge_pages_restarts_once_with_the_tunable():
  code = ("import os; from megatrain_jax import launch as h; "
          "h.use_huge_pages(); print('TUNABLES', os.environ.get('GLIBC_TUNABLES'))")
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", launch.OPT_OUT)}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=120, check=True).stdout
  lines = [l for l in out.splitlines() if l.startswith("TUNABLES")]
  assert len(lines) == 1  # the restarted process printed once, and did not restart again
  offered = (launch.thp_mode() == "madvise" and launch.glibc_has_hugetlb())
  assert lines[0] == ("TUNABLES glibc.malloc.hugetlb=1" if offered else "TUNABLES None")


@pytest.mark.parametrize("script", ["train.py", "bench.py", "figures/depth.py"])
def test_a_launcher_restarts_before_it_imports_jax(script):
  # -X importtime survives the restart (sys.orig_argv): JAX shows once in all.
  env = {k: v for k, v in os.environ.items()
         if k not in ("GLIBC_TUNABLES", launch.OPT_OUT)}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-X", "importtime",
                      os.path.join(repo, "experiments", script), "--helpshort"],
                     env=env, capture_output=True, text=True, timeout=300, cwd=repo)
  assert "Traceback" not in r.stderr, r.stderr[-2000:]  # absl's --helpshort exits 1
  jax_imports = [l for l in r.stderr.splitlines() if re.search(r"\|\s+jax$", l)]
  assert len(jax_imports) == 1, jax_imports
  starts = [l for l in r.stderr.splitlines() if re.search(r"\|\s+megatrain_jax$", l)]
  offered = launch.thp_mode() == "madvise" and launch.glibc_has_hugetlb()
  assert len(starts) == (2 if offered else 1)  # the restart happened, before JAX


def test_describe_says_what_malloc_does():
  assert "asks for transparent huge pages" in launch.describe(
      {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
  assert "default pages" in launch.describe({})
