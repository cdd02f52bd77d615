"""Hardware profiles for the planner: published peaks, or a calibration of this machine.

Profiles hold published peak figures (sources beside each). The host side of a
machine (optimizer bandwidth, RAM) is not on any datasheet: those values are stated
assumptions, marked as such. A calibration of the machine it runs on
(`megatrain_jax.bench.calibrate.measure_hardware`) fills the same record.
"""

from __future__ import annotations

import dataclasses
import math


GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What the planner needs to know about a machine.

  layer_flops: FLOP/s the device reaches on a decoder layer's own mix of work
    (matmuls, attention, norms; forward, recompute and backward), as (d_model,
    FLOP/s) points interpolated in log-space by the model's width. Published
    profiles give one point: peak x `mfu`.
  shared: device compute and host work run on the same cores (CPU backend), so
    their times add instead of overlapping.
  call_overhead_s: host time per template call of a step (dispatch and the
    engine's per-unit bookkeeping); 0 in the measured profile, whose rate holds it.
  interconnect_bytes_per_s: between two devices of one host, one direction (the
    gradient all-reduce of data parallelism).
  network_bytes_per_s: between hosts, per device, one direction.
  disk_drives, disk_read_bytes_per_s, disk_write_bytes_per_s, disk_bytes: the NVMe
    drives the disk tier's state files stripe over (0: none stated), and each
    drive's sequential direct-I/O rates and capacity.
  memory_bytes_per_s: the device memory's bandwidth (what bounds decoding a token:
    every weight is read once); 0: not stated.
  """

  name: str
  layer_flops: tuple[tuple[int, float], ...]
  h2d_bytes_per_s: float
  d2h_bytes_per_s: float
  host_opt_bytes_per_s: float
  device_bytes: int
  host_bytes: int
  peak_flops: float
  shared: bool = False
  call_overhead_s: float = 20e-6
  # cuDNN's fused attention (an NVIDIA GPU); False: the blockwise kernel elsewhere.
  # Neither forms the [T, T] probabilities in device memory.
  flash_attention: bool = True
  interconnect_bytes_per_s: float = 0.8 * 64 * GB
  network_bytes_per_s: float = 0.8 * 50 * GB
  disk_drives: int = 0
  disk_read_bytes_per_s: float = 0.0
  disk_write_bytes_per_s: float = 0.0
  disk_bytes: int = 0
  memory_bytes_per_s: float = 0.0
  source: str = ""

  def flops_at(self, d_model: int) -> float:
    """The layer FLOP/s at a width, from `layer_flops`.

    Args:
      d_model: the model's width.

    Returns:
      The rate interpolated in log-space between the two points around `d_model`;
      outside their range, the nearest end's rate (a single point's everywhere).
    """
    pts = sorted(self.layer_flops)
    if len(pts) == 1 or d_model <= pts[0][0]:
      return pts[0][1]
    if d_model >= pts[-1][0]:
      return pts[-1][1]
    for (d0, f0), (d1, f1) in zip(pts, pts[1:]):
      if d0 <= d_model <= d1:
        w = (math.log(d_model) - math.log(d0)) / (math.log(d1) - math.log(d0))
        return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
    return pts[-1][1]


def _published(name, peak_flops, link, device_bytes, host_bytes, host_opt, source,
               mfu=0.6, d2h=None, interconnect=None, network=None, cudnn=True,
               disk=(0, 0.0, 0.0, 0), memory=0.0):
  drives, read, write, capacity = disk
  return Hardware(name=name, layer_flops=((1, peak_flops * mfu),), h2d_bytes_per_s=link,
                  disk_drives=drives, disk_read_bytes_per_s=read,
                  disk_write_bytes_per_s=write, disk_bytes=capacity,
                  d2h_bytes_per_s=d2h or link, host_opt_bytes_per_s=host_opt,
                  device_bytes=device_bytes, host_bytes=host_bytes, peak_flops=peak_flops,
                  flash_attention=cudnn, interconnect_bytes_per_s=interconnect or link,
                  network_bytes_per_s=network or Hardware.network_bytes_per_s,
                  memory_bytes_per_s=0.8 * memory, source=source)


# Dense BF16 tensor-core peaks and host links from the vendors' datasheets. The
# compute time assumes 60% of peak on a streamed layer (`mfu`), PCIe links 80% of
# their x16 rate, device memory 80% of its datasheet bandwidth. Host RAM and
# host-optimizer bandwidth are assumptions (marked).
# Between devices of a host: NVLink where the part has it (900 GB/s total on
# H100/H200 SXM, 450 GB/s each way; on TPUs the inter-chip interconnect, ICI; on the
# MI300X Infinity Fabric), else the PCIe link; between hosts, an assumed 400 Gb/s
# InfiniBand NDR adapter per device at 80%, unless a published figure is given.
# The engine's fused attention kernel is cuDNN's (`models.layers.attention_kernel`):
# on TPUs and AMD GPUs (`cudnn=False`) the planner counts the blockwise kernel's
# scratch instead (and, as on the CPU backend, pooled buffers for recompute "dots"
# and "none", a little more than an accelerator's allocator holds).
PROFILES: dict[str, Hardware] = {
    # NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity), 141 GB
    # HBM3e at 4.8 TB/s; PCIe Gen5 x16 64 GB/s per direction. Host: the paper's 1.5 TB server;
    # optimizer bandwidth assumed 200 GB/s (dual-socket DDR5, about half of peak).
    "h200": _published("H200 + 1.5 TB host", 989e12, 0.8 * 64 * GB, 141 * GB, 1500 * GB,
                       200 * GB, "NVIDIA H200 datasheet; PCIe Gen5 x16; host assumed",
                       interconnect=450 * GB, memory=4800 * GB),
    # NVIDIA GH200 datasheet: H100-class GPU, 989 TFLOPS BF16 dense, 96 GB HBM3 at
    # 4 TB/s;
    # NVLink-C2C 900 GB/s total (450 GB/s each way); 480 GB LPDDR5X at up to 512 GB/s,
    # optimizer bandwidth assumed 250 GB/s.
    "gh200": _published("GH200 (NVLink-C2C)", 989e12, 450 * GB, 96 * GB, 480 * GB,
                        250 * GB, "NVIDIA GH200 datasheet; host optimizer assumed",
                        interconnect=450 * GB, memory=4000 * GB),
    # NVIDIA H100 PCIe datasheet: 756 TFLOPS BF16 dense, 80 GB at 2 TB/s; PCIe Gen5 x16.
    "h100_pcie": _published("H100 PCIe Gen5", 756e12, 0.8 * 64 * GB, 80 * GB, 512 * GB,
                            150 * GB, "NVIDIA H100 PCIe datasheet; host assumed",
                            memory=2000 * GB),
    # NVIDIA A100 80GB datasheet: 312 TFLOPS BF16 dense, 1,935 GB/s (PCIe); PCIe Gen4
    # x16 32 GB/s.
    "a100": _published("A100 80GB", 312e12, 0.8 * 32 * GB, 80 * GB, 512 * GB, 150 * GB,
                       "NVIDIA A100 datasheet; host assumed", memory=1935 * GB),
    # NVIDIA GA102 whitepaper: RTX 3090 71 TFLOPS BF16 with FP32 accumulate, 24 GB;
    # PCIe Gen4 x16.
    # A workstation for the disk tier: NVIDIA Ada whitepaper, RTX 4090: 165.2 TFLOPS
    # FP16/BF16 tensor with FP32 accumulate (dense), 24 GB; PCIe Gen4 x16. Host
    # assumed: 256 GB RAM, optimizer bandwidth 80 GB/s, and 4 PCIe 4.0 NVMe drives of
    # a data-center class (Samsung PM9A3 datasheet: 6.9 GB/s sequential read,
    # 4.1 GB/s write, 3.84 TB), each at 80% of those rates with direct I/O.
    "workstation": _published("RTX 4090 + 256 GB + 4 NVMe", 165.2e12, 0.8 * 32 * GB,
                              24 * GB, 256 * GB, 80 * GB, "NVIDIA Ada whitepaper; "
                              "Samsung PM9A3 datasheet; host and drives assumed",
                              disk=(4, 0.8 * 6.9 * GB, 0.8 * 4.1 * GB, 3840 * GB)),
    "rtx3090": _published("RTX 3090", 71e12, 0.8 * 32 * GB, 24 * GB, 128 * GB, 40 * GB,
                          "NVIDIA GA102 whitepaper; host assumed"),
    # NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor with sparsity (154.8 dense),
    # 48 GB; PCIe Gen4 x16.
    "rtx_a6000": _published("RTX A6000", 154.8e12, 0.8 * 32 * GB, 48 * GB, 256 * GB,
                            60 * GB, "NVIDIA RTX A6000 datasheet; host assumed"),
    # Google Cloud TPU v5p docs: 459 TFLOPS BF16 per chip, 95 GB HBM2e; a 4-chip VM
    # (ct5p-hightpu-4t) has 448 GB RAM and 208 vCPUs; ICI 1,200 GB/s per chip both
    # ways (600 GB/s each way); data center network 50 Gb/s per chip. The host link
    # is not published: PCIe Gen4 x16 assumed; optimizer bandwidth assumed 150 GB/s.
    "tpu_v5p": _published("TPU v5p + 448 GB VM", 459e12, 0.8 * 32 * GB, 95 * GB, 448 * GB,
                          150 * GB, "Google Cloud TPU v5p docs; host link and optimizer "
                          "assumed", interconnect=600 * GB, network=0.8 * 50 / 8 * GB,
                          cudnn=False),
    # Google Cloud TPU v6e (Trillium) docs: 918 TFLOPS BF16 per chip, 32 GB HBM; each
    # chip on a PCIe Gen5 link (its width not stated: x16 assumed); 1,536 GiB DRAM per
    # 8-chip host; ICI 800 GB/s per chip both ways (400 GB/s each way). Optimizer
    # bandwidth assumed 200 GB/s; between hosts, the assumed default.
    "tpu_v6e": _published("TPU v6e (Trillium) + 1,536 GiB host", 918e12, 0.8 * 64 * GB,
                          32 * GB, 1536 * 2**30, 200 * GB, "Google Cloud TPU v6e docs; "
                          "link width, optimizer and network assumed", interconnect=400 * GB,
                          cudnn=False),
    # AMD Instinct MI300X datasheet: 1,307.4 TFLOPS BF16 dense (2,614.9 with
    # sparsity), 192 GB HBM3; PCIe Gen5 x16; 7 Infinity Fabric links, 896 GB/s in all
    # (448 GB/s each way). Host: 1.5 TB assumed (as for h200; MLPerf's 8 x MI300X
    # servers list 1.5 TiB); optimizer bandwidth assumed 200 GB/s.
    "mi300x": _published("MI300X + 1.5 TB host", 1307.4e12, 0.8 * 64 * GB, 192 * GB,
                         1500 * GB, 200 * GB, "AMD Instinct MI300X datasheet; PCIe Gen5 "
                         "x16; host assumed", interconnect=448 * GB, cudnn=False),
}


def hardware(name: str) -> Hardware:
  """A published profile by name (a calibration of this machine is
  `megatrain_jax.bench.calibrate.measure_hardware`).

  Args:
    name: a key of PROFILES.

  Returns:
    The profile.

  Raises:
    ValueError: an unknown name.
  """
  if name not in PROFILES:
    raise ValueError(f"Unknown hardware {name!r}; choose one of {sorted(PROFILES)} "
                     "(or calibrate this machine: --hardware=measured).")
  return PROFILES[name]
