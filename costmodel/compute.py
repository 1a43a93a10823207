"""Compute time: a roofline with an efficiency factor and a launch floor."""

from __future__ import annotations

from costmodel.profile import Profile


def compute_time_us(flops: float, nbytes: float, profile: Profile, dtype: str | None = None,
                    pattern: str | None = None, side: float | None = None, kernel: str | None = None) -> float:
    """max(FLOPs / (peak(dtype) * efficiency * share(side)), bytes / bandwidth(pattern)), at
    least one kernel launch.

    ``dtype``: the torch dtype name the op computes in (``Profile.tflops``); None prices it at
    the planning dtype's peak. ``pattern``: a memory-bound op's access pattern
    (``Profile.bandwidth_gbps``); None a copy's bandwidth. ``side``: a matmul's size, the side
    of the cube of its M x N x K (``Profile.matmul_share``); None: at the calibrated rate.
    ``kernel``: a fused kernel's name (``Profile.kernel_share``: fused attention). Zero
    work costs nothing: views and metadata ops launch no kernel.
    """
    if flops <= 0 and nbytes <= 0:
        return 0.0
    t_flops = flops / (profile.tflops(dtype) * 1e6 * profile.compute_efficiency * profile.matmul_share(side)
                          * profile.kernel_share(kernel))
    t_mem = nbytes / (profile.bandwidth_gbps(pattern) * 1e3)
    return max(t_flops, t_mem, profile.kernel_launch_us)
