"""Accelerators' published HBM per device, from the vendors' own pages, to check a plan's figure against.

A plan types `hardware.memory_per_device_gb` (and says where it comes from). The capacity report
compares it with the figure below; when they differ it warns and reports the plan at both figures.
Decimal GB (10^9 bytes), as the vendors state them. Add a part only with a vendor page to cite.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VendorMemory:
    """One accelerator's HBM per device as its vendor publishes it: decimal GB, and the page saying so."""

    accelerator: str
    memory_per_device_gb: float
    source: str
    note: str = ""


ACCELERATORS: dict[str, VendorMemory] = {
    "b300": VendorMemory(
        "B300", 288,
        "NVIDIA: B300 (NVIDIA-B300-SXM6-AC) with 288GB HBM3e memory per GPU "
        "(https://docs.nvidia.com/nim/bionemo/boltz2/release-notes/2026/5/18)",
    ),
    "b200": VendorMemory(
        "B200", 180,
        "NVIDIA DGX B200 user guide: 8 x NVIDIA B200 GPUs that provide 1,440 GB total GPU memory "
        "(https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html)",
        note="the DGX/HGX B200 part; some B200 SKUs carry 192 GB",
    ),
    "gb200": VendorMemory(
        "GB200", 186,
        "NVIDIA GB200 NVL72: 13.4 TB HBM3e per rack of 72 GPUs; MLPerf Inference v6.1 system "
        "description GB200-NVL72_GB200-186GB (accelerator_memory_capacity 186 GB, "
        "https://raw.githubusercontent.com/mlcommons/inference_results_v6.1/main/closed/Crusoe/systems/"
        "GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json)",
    ),
}


def vendor_memory(accelerator: str) -> VendorMemory | None:
    """The vendor's published HBM for `accelerator` (case-insensitive name, e.g. "B300"), or None if unlisted."""
    return ACCELERATORS.get(accelerator.strip().lower())
