"""The GPUs the planner knows, from their spec sheets (nothing here was measured: this project
has no GPU). Peaks are dense (no 2:4 sparsity) bf16 tensor-core figures; link bandwidths are
per GPU and per direction, which is what one step of a ring moves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # FLOP/s, dense
    hbm_bytes_per_s: float
    # the spec sheet's GB (decimal): below what the device reports, so a plan errs low
    memory_bytes: float
    nvlink_bytes_per_s: float  # within a node, per direction
    network_bytes_per_s: float  # between nodes, the GPU's own NIC, per direction
    gpus_per_node: int
    source: str


GB = 1e9
GPUS = {
    "h100": GPU(
        name="H100 SXM 80GB",
        bf16_flops=989e12,
        hbm_bytes_per_s=3.35e12,
        memory_bytes=80 * GB,
        nvlink_bytes_per_s=450 * GB,
        network_bytes_per_s=50 * GB,
        gpus_per_node=8,
        source="H100 SXM datasheet: bf16 1,979 TFLOP/s sparse = 989 dense, HBM3 3.35 TB/s, 80 GB; "
        "NVLink 4 900 GB/s bidirectional; DGX H100: one ConnectX-7 400 Gb/s NDR InfiniBand per GPU",
    ),
    "h200": GPU(
        name="H200 SXM 141GB",
        bf16_flops=989e12,
        hbm_bytes_per_s=4.8e12,
        memory_bytes=141 * GB,
        nvlink_bytes_per_s=450 * GB,
        network_bytes_per_s=50 * GB,
        gpus_per_node=8,
        source="H200 SXM datasheet: bf16 1,979 TFLOP/s sparse = 989 dense, HBM3e 4.8 TB/s, 141 GB; "
        "NVLink 4 900 GB/s bidirectional; HGX H200: one 400 Gb/s NDR NIC per GPU",
    ),
    "a100": GPU(
        name="A100 SXM 80GB",
        bf16_flops=312e12,
        hbm_bytes_per_s=2.039e12,
        memory_bytes=80 * GB,
        nvlink_bytes_per_s=300 * GB,
        network_bytes_per_s=25 * GB,
        gpus_per_node=8,
        source="A100 80GB SXM datasheet: bf16 312 TFLOP/s dense, HBM2e 2,039 GB/s, 80 GB; "
        "NVLink 3 600 GB/s bidirectional; DGX A100: one ConnectX-6 200 Gb/s HDR InfiniBand per GPU",
    ),
}


def gpu(kind: str) -> GPU:
    """The spec of ``kind`` (h100, h200, a100); ValueError naming the known ones otherwise."""
    if kind not in GPUS:
        raise ValueError(f"unknown GPU {kind!r}; the planner knows {sorted(GPUS)}")
    return GPUS[kind]


def ring_bytes_per_s(spec: GPU, ranks: int) -> float:
    """The slowest link of a ring over ``ranks`` GPUs: NVLink within one node, the NIC across nodes."""
    return spec.nvlink_bytes_per_s if ranks <= spec.gpus_per_node else spec.network_bytes_per_s


# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, which print the sparse
# figure (2x) first. Matched against torch.cuda.get_device_name() in this order ("H100 NVL"
# before "H100"; the SXM part is named "H100 80GB HBM3"). Not measured: this project has no GPU.
SPEC_BF16_DENSE = (
    ("H100 PCIe", 756e12, "H100 PCIe datasheet: bf16 1,513 TFLOP/s sparse, 756 dense"),
    ("H100 NVL", 835e12, "H100 NVL datasheet: bf16 1,671 TFLOP/s sparse, 835 dense"),
    ("H100", 989e12, "H100 SXM datasheet: bf16 1,979 TFLOP/s sparse, 989 dense"),
    ("H200 NVL", 835e12, "H200 NVL datasheet: bf16 1,671 TFLOP/s sparse, 835 dense"),
    ("H200", 989e12, "H200 SXM datasheet: bf16 1,979 TFLOP/s sparse, 989 dense"),
    ("A100", 312e12, "A100 datasheet: bf16 312 TFLOP/s dense"),
)


def spec_peak(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 FLOP/s, its source) of the GPU called ``device_name``; (None, why) if unknown."""
    for key, flops, source in SPEC_BF16_DENSE:
        if key in device_name:
            return flops, source
    return (
        None,
        f"no datasheet peak for {device_name!r} in mpp.tools.planner.hardware.SPEC_BF16_DENSE: no MFU",
    )
