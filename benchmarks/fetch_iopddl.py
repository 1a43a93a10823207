"""Download the public IOPDDL auto-sharding instances that ``benchmarks/iopddl.py`` runs.

    python benchmarks/fetch_iopddl.py [--to benchmarks/data/iopddl] [--only A,G]

The instances are the ASPLOS/EuroSys 2025 contest's (github.com/google/iopddl, Apache-2.0):
gzipped JSON, one real auto-sharding ILP of XLA's each. A file already there is kept. Each
download is checked to be gzipped JSON with a ``problem`` before it is kept.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import urllib.request
from pathlib import Path

SOURCE = "https://raw.githubusercontent.com/google/iopddl/main/benchmarks/asplos-2025-iopddl-{}.json.gz"
#: The instances ``benchmarks/iopddl.py`` has the strongest known costs of (not yet E, F, H, I, J,
#: O, W, X and Y: the largest, 114 MB to 1.3 GB unpacked, never run here).
INSTANCES = ("A", "B", "C", "D", "G", "K", "L", "M", "N", "P", "Q", "R", "S", "T", "U", "V")
DEFAULT_FOLDER = Path(__file__).resolve().parent / "data" / "iopddl"


def fetch(letter: str, folder: Path) -> Path:
    target = folder / f"asplos-2025-iopddl-{letter}.json.gz"
    if target.exists():
        print(f"{target.name}: already there", flush=True)
        return target
    url = SOURCE.format(letter)
    print(f"{target.name}: downloading {url}", flush=True)
    with urllib.request.urlopen(url, timeout=120) as response:
        data = response.read()
    try:
        if "problem" not in json.loads(gzip.decompress(data)):
            raise ValueError("no 'problem' key")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{url}: expected gzipped IOPDDL JSON, found {len(data)} bytes that are not ({exc})") from None
    tmp = target.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(target)
    print(f"{target.name}: {len(data) / 2**20:.1f} MiB", flush=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", type=Path, default=DEFAULT_FOLDER, help="folder to write the instances to")
    ap.add_argument("--only", default="", help=f"comma-separated instance letters (default: {','.join(INSTANCES)})")
    args = ap.parse_args()
    letters = [x for x in args.only.split(",") if x] or list(INSTANCES)
    args.to.mkdir(parents=True, exist_ok=True)
    failed = []
    for letter in letters:
        try:
            fetch(letter, args.to)
        except OSError as exc:
            failed.append(f"{letter}: {exc}")
    if failed:
        sys.exit("could not download: " + "; ".join(failed))


if __name__ == "__main__":
    main()
