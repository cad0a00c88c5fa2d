"""Hardware specs of the GPUs loom plans for, and the cluster they sit in (issue 3, item 1).

Every number is a vendor datasheet figure unless marked *assumption*; the source is named next
to it. Conventions, so that the numbers compose with `loom.cost.comm`:

- ``peak_bf16_flops``: dense BF16 Tensor Core FLOP/s. Datasheets print the *sparse* figure
  first ("1,979 TFLOPS*", * = with sparsity); the dense figure is half of it.
- ``hbm_bytes``: memory capacity. NVIDIA's "GB" for memory capacity is binary (an A100 80GB
  reports 81920 MiB), so ``N GB`` is stored as ``N * 2**30`` bytes.
- ``hbm_bandwidth``: memory bandwidth, decimal bytes/s as printed.
- ``intra_node_bandwidth``, ``inter_node_bandwidth``: bytes/s one GPU can send in one
  direction. Datasheets print NVLink as the *bidirectional* total ("600 GB/s"), so it is
  halved here; network links are per-direction line rates (a 400 Gb/s NIC is 50 GB/s) divided
  by the GPUs sharing the NIC.
- ``intra_node_latency``, ``inter_node_latency``: the alpha of the alpha-beta model, seconds
  per message step. *Assumption* for every GPU (datasheets do not give it): 2 µs over
  NVLink/NVSwitch and 5 µs over InfiniBand/RoCE, the order of NCCL's small-message step times.
- ``sms``: streaming multiprocessors (the whitepapers' SM counts), for the wave quantization of
  `loom.cost.gemm`; 0 for a device without them (no quantization).
- ``gemm_ceiling``: the fraction of the dense peak the largest BF16 GEMMs reach. *Assumption*
  (vendors publish peaks, not achieved rates): 0.8 on Ampere and 0.75 on Hopper, the order of
  public cuBLAS measurements of large square BF16 GEMMs (about 250 of 312 TFLOP/s on an A100,
  about 740 of 989 on an H100 SXM).
- ``attention_efficiency``: the fraction of the peak attention kernels reach. *Assumption*:
  0.5. FlashAttention-2 reaches "50-73% of the theoretical maximum FLOPs/s on A100" forward
  and less backward (Dao 2023, abstract) and "only 35% utilization on H100" (Shah et al. 2024,
  FlashAttention-3, abstract), whose own kernels reach 75 % forward; torch's SDPA picks among
  such kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30
GB = 1e9
TFLOPS = 1e12
Gbit = 1e9 / 8  # bytes/s in one Gb/s

# Alpha of the alpha-beta model (assumption, see the module docstring).
NVLINK_LATENCY = 2e-6
NETWORK_LATENCY = 5e-6


@dataclass(frozen=True)
class GPUSpec:
    """One GPU product as the cost model sees it (units in the module docstring)."""

    name: str
    peak_bf16_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float = NVLINK_LATENCY
    inter_node_latency: float = NETWORK_LATENCY
    sms: int = 0
    gemm_ceiling: float = 0.75
    attention_efficiency: float = 0.5

    def __post_init__(self) -> None:
        for name in ("gemm_ceiling", "attention_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"GPUSpec {self.name!r}: {name} = {getattr(self, name)} must be a fraction in (0, 1]")


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in [
        GPUSpec(
            name="A40",
            # NVIDIA A40 datasheet: "BF16 Tensor Core 149.7 | 299.4* TFLOPS" (* with sparsity).
            peak_bf16_flops=149.7 * TFLOPS,
            # NVIDIA A40 datasheet: "48 GB GDDR6 with error-correcting code", "696 GB/s".
            hbm_bytes=48 * GiB,
            hbm_bandwidth=696 * GB,
            # NVIDIA A40 datasheet: the NVLink bridge joins 2 GPUs only, so an 8-GPU server's
            # collectives run over "PCI Express Gen 4 x16: 64 GB/s bidirectional" -> 32 GB/s.
            intra_node_bandwidth=32 * GB,
            # Assumption (PCIe servers vary): one 200 Gb/s HDR NIC per 2 GPUs -> 100 Gb/s per GPU.
            inter_node_bandwidth=100 * Gbit,
            intra_node_latency=NETWORK_LATENCY,  # PCIe through the host bridge: not NVLink-fast
            # NVIDIA A40 datasheet: 10,752 CUDA cores, 128 per Ampere SM; gemm_ceiling: the module docstring's assumption.
            sms=84,
            gemm_ceiling=0.8,
        ),
        GPUSpec(
            name="A100-40GB",
            # NVIDIA A100 Tensor Core GPU datasheet (SXM): "BF16 Tensor Core 312 TFLOPS | 624 TFLOPS*".
            peak_bf16_flops=312 * TFLOPS,
            # NVIDIA A100 datasheet, A100 40GB SXM: "40GB HBM2", "1,555 GB/s".
            hbm_bytes=40 * GiB,
            hbm_bandwidth=1555 * GB,
            # NVIDIA A100 datasheet: "NVLink: 600 GB/s" (bidirectional) -> 300 GB/s per direction.
            intra_node_bandwidth=300 * GB,
            # NVIDIA DGX A100 datasheet: "8x Single-Port Mellanox ConnectX-6 VPI 200Gb/s HDR
            # InfiniBand" for 8 GPUs -> 200 Gb/s per GPU.
            inter_node_bandwidth=200 * Gbit,
            # NVIDIA A100 Tensor Core GPU Architecture whitepaper: "108 SMs"; gemm_ceiling: the module docstring's assumption.
            sms=108,
            gemm_ceiling=0.8,
        ),
        GPUSpec(
            name="A100-80GB",
            # NVIDIA A100 Tensor Core GPU datasheet (SXM): "BF16 Tensor Core 312 TFLOPS | 624 TFLOPS*".
            peak_bf16_flops=312 * TFLOPS,
            # NVIDIA A100 datasheet, A100 80GB SXM: "80GB HBM2e", "2,039 GB/s".
            hbm_bytes=80 * GiB,
            hbm_bandwidth=2039 * GB,
            # NVIDIA A100 datasheet: "NVLink: 600 GB/s" (bidirectional).
            intra_node_bandwidth=300 * GB,
            # NVIDIA DGX A100 datasheet: 8x ConnectX-6 HDR 200 Gb/s for 8 GPUs.
            inter_node_bandwidth=200 * Gbit,
            # NVIDIA A100 whitepaper: "108 SMs"; gemm_ceiling: the module docstring's assumption.
            sms=108,
            gemm_ceiling=0.8,
        ),
        GPUSpec(
            name="A800",
            # NVIDIA A800 SXM4 80GB (China-market A100 variant): A100 compute, "BF16 312 TFLOPS".
            peak_bf16_flops=312 * TFLOPS,
            # NVIDIA A800 datasheet: "80GB HBM2e", "2,039 GB/s" (as the A100 80GB).
            hbm_bytes=80 * GiB,
            hbm_bandwidth=2039 * GB,
            # NVIDIA A800 datasheet: NVLink reduced to "400 GB/s" (bidirectional) -> 200 GB/s.
            intra_node_bandwidth=200 * GB,
            # DistTrain's production A800 cluster (disttrain.md §4.1): "4x200 Gbps RDMA, RoCEv2"
            # per 8-GPU node -> 100 Gb/s per GPU.
            inter_node_bandwidth=100 * Gbit,
            # an A100 die: 108 SMs; gemm_ceiling: the module docstring's assumption.
            sms=108,
            gemm_ceiling=0.8,
        ),
        GPUSpec(
            name="H100",
            # NVIDIA H100 Tensor Core GPU datasheet (SXM5): "BF16 Tensor Core 1,979 teraFLOPS*"
            # (* with sparsity) -> 989.4 dense.
            peak_bf16_flops=989.4 * TFLOPS,
            # NVIDIA H100 datasheet (SXM5): "80GB" HBM3, "3.35TB/s".
            hbm_bytes=80 * GiB,
            hbm_bandwidth=3350 * GB,
            # NVIDIA H100 datasheet (SXM5): "NVLink: 900GB/s" (bidirectional) -> 450 GB/s.
            intra_node_bandwidth=450 * GB,
            # NVIDIA DGX H100 datasheet: "8x single-port NVIDIA ConnectX-7 VPI, 400 Gb/s
            # InfiniBand/Ethernet" for 8 GPUs -> 400 Gb/s per GPU.
            inter_node_bandwidth=400 * Gbit,
            # NVIDIA H100 Tensor Core GPU Architecture whitepaper: "132 SMs" (SXM5); gemm_ceiling: the module docstring's assumption.
            sms=132,
            gemm_ceiling=0.75,
        ),
        GPUSpec(
            name="H800",
            # NVIDIA H800 SXM5 (China-market H100 variant): H100 compute, "BF16 1,979 TFLOPS*"
            # with sparsity -> 989.4 dense.
            peak_bf16_flops=989.4 * TFLOPS,
            # NVIDIA H800 datasheet (SXM5): "80GB" HBM3, "3.35TB/s" (as the H100 SXM5).
            hbm_bytes=80 * GiB,
            hbm_bandwidth=3350 * GB,
            # NVIDIA H800 datasheet: NVLink reduced to "400GB/s" (bidirectional) -> 200 GB/s.
            intra_node_bandwidth=200 * GB,
            # DeepSeek-V3 technical report (2024) §3.2.2, an H800 cluster: one 400 Gb/s
            # InfiniBand NIC per GPU ("IB (50 GB/s)").
            inter_node_bandwidth=400 * Gbit,
            # an H100 SXM5 die: 132 SMs; gemm_ceiling: the module docstring's assumption.
            sms=132,
            gemm_ceiling=0.75,
        ),
        GPUSpec(
            name="H200",
            # NVIDIA H200 Tensor Core GPU datasheet (SXM): "BF16 Tensor Core 1,979 TFLOPS*"
            # (* with sparsity) -> 989.4 dense.
            peak_bf16_flops=989.4 * TFLOPS,
            # NVIDIA H200 datasheet (SXM): "141GB" HBM3e, "4.8TB/s".
            hbm_bytes=141 * GiB,
            hbm_bandwidth=4800 * GB,
            # NVIDIA H200 datasheet (SXM): "NVIDIA NVLink: 900GB/s" (bidirectional) -> 450 GB/s.
            intra_node_bandwidth=450 * GB,
            # NVIDIA DGX H200 datasheet: "8x single-port NVIDIA ConnectX-7 VPI, 400Gb/s
            # InfiniBand/Ethernet" for 8 GPUs -> 400 Gb/s per GPU.
            inter_node_bandwidth=400 * Gbit,
            # an H100 SXM5 die with HBM3e: 132 SMs; gemm_ceiling: the module docstring's assumption.
            sms=132,
            gemm_ceiling=0.75,
        ),
    ]
}


def get_gpu(name: str, field: str = "gpu") -> GPUSpec:
    """The spec of GPU ``name`` (case-insensitive); ``field`` names the setting it came from in
    the error message."""
    for known, spec in GPUS.items():
        if name.lower() == known.lower():
            return spec
    raise ValueError(f"{field} = {name!r}: unknown GPU type; known types are {list(GPUS)}")


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs of one type, ``gpus_per_node`` to a node; rank ``r`` sits on node
    ``r // gpus_per_node`` (ranks fill nodes in order, as torchrun places them). ``gpu`` names
    a type of `GPUS`, or is a `GPUSpec` for a device the registry lacks."""

    gpu: str | GPUSpec
    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, (str, GPUSpec)):
            raise TypeError(f"cluster.gpu = {self.gpu!r}: give a GPU type name ({list(GPUS)}) or a GPUSpec")
        if isinstance(self.gpu, str):
            get_gpu(self.gpu, field="cluster.gpu")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"cluster.num_gpus = {self.num_gpus!r}: must be a positive integer")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node = {self.gpus_per_node!r}: must be a positive integer")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"cluster.num_gpus = {self.num_gpus} is not a whole number of nodes of "
                f"cluster.gpus_per_node = {self.gpus_per_node}"
            )

    @property
    def spec(self) -> GPUSpec:
        return self.gpu if isinstance(self.gpu, GPUSpec) else get_gpu(self.gpu, field="cluster.gpu")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def node_of_rank(self, rank: int) -> int:
        if not 0 <= rank < self.num_gpus:
            raise ValueError(f"rank {rank} is outside the cluster's {self.num_gpus} GPUs (cluster.num_gpus)")
        return rank // self.gpus_per_node
