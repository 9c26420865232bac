"""Which GPU source the agent samples: the simulated one when asked, else NVML, else none with the reason.

The choice sits here, outside both sources, so that neither source module imports the other.
"""

from __future__ import annotations

from engine.host.gpus import GpuSource, NoGpus, NvmlGpus
from engine.host.simulate import SimulatedGpus


def open_gpu_source(simulate_gpus: int = 0) -> GpuSource:
    """The agent's GPU source: simulated when asked, else NVML, else none with the reason."""
    if simulate_gpus > 0:
        return SimulatedGpus(simulate_gpus)
    nv = NvmlGpus()
    if nv.ok:
        return nv
    return NoGpus(nv.error or "NVML unavailable")
