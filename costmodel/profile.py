"""Hardware profiles: the constants the cost model is evaluated with.

The skeleton's collective model is alpha-beta per link class (within a node /
across nodes); calibration (``autoshard calibrate``) will replace the constants
with fitted curves per mesh axis and flattened group.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE_VERSION = 1


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of one class of links, in nccl-tests bus-bandwidth terms."""

    latency_us: float
    """Fixed cost per collective, microseconds."""
    busbw_gbps: float
    """Bus bandwidth, GB/s (1e9 bytes/s), as nccl-tests reports it."""

    def __post_init__(self):
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, found {self.latency_us}")
        if not self.busbw_gbps > 0:
            raise ValueError(f"busbw_gbps must be > 0, found {self.busbw_gbps}")


@dataclass(frozen=True)
class Profile:
    """Per-device compute and per-link communication constants."""

    name: str
    """Short name, e.g. ``h100-sxm``."""
    device: str
    """Device type the figures describe."""
    peak_tflops: float
    """Dense peak for the planning dtype (bf16 on GPUs, fp32 on CPUs), TFLOP/s."""
    mem_bandwidth_gbps: float
    """Device memory bandwidth, GB/s."""
    memory_bytes: int
    """Device memory, bytes: the default per-device memory budget."""
    devices_per_node: int
    """Ranks that share the fast intra-node links."""
    intra_node: LinkModel
    """Links between ranks of one node."""
    inter_node: LinkModel
    """Links between nodes."""
    compute_efficiency: float = 0.6
    """Fraction of peak a well-shaped kernel reaches."""
    kernel_launch_us: float = 5.0
    """Floor on the time of any kernel, microseconds."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self):
        for f in ("peak_tflops", "mem_bandwidth_gbps", "memory_bytes", "devices_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"profile {self.name!r}: {f} must be > 0, found {getattr(self, f)}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency must be in (0, 1], found {self.compute_efficiency}")
        if isinstance(self.intra_node, dict):
            object.__setattr__(self, "intra_node", LinkModel(**self.intra_node))
        if isinstance(self.inter_node, dict):
            object.__setattr__(self, "inter_node", LinkModel(**self.inter_node))

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @staticmethod
    def from_json(data: dict) -> "Profile":
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version: expected {PROFILE_VERSION}, found {version!r}")
        fields = {k: v for k, v in data.items() if k != "version"}
        try:
            return Profile(**fields)
        except TypeError as exc:
            raise ValueError(f"profile: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


_DIR = Path(__file__).parent / "profiles"


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (see ``builtin_profiles()``) or a profile file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = _DIR / f"{name_or_path}.json"
        if not path.exists():
            raise FileNotFoundError(
                f"profile {str(name_or_path)!r}: no such file and no shipped profile of that name; "
                f"shipped: {builtin_profiles()}"
            )
    return Profile.from_json(json.loads(path.read_text()))
