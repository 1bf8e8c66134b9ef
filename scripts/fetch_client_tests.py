"""Put the clients' own transfer tests (benchmarks/client_tests.json) in .client-tests/ and say what is there.

    python scripts/fetch_client_tests.py [--dir DIR] [--check]

Each file with a known repository path and commit is downloaded from raw.githubusercontent.com unless it
is already there (--check: download nothing). The files are other projects' code: .client-tests/ is
ignored by git and nothing here is committed. A file that cannot be downloaded (no network, as on the GPU
machine and in CI, or no known path) is reported with where it comes from; a session with the search
tool can write it from the stored copy named in the manifest. Prints one line per file (its SHA-256 when
present, so a run's log records what ran) and exits 1 when any is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "benchmarks" / "client_tests.json"


def url(entry: dict) -> str | None:
    if not entry.get("path") or not entry.get("commit"):
        return None
    return f"https://raw.githubusercontent.com/{entry['repo']}/{entry['commit']}/{entry['path']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: the manifest's dir)")
    ap.add_argument("--check", action="store_true", help="download nothing; report what is there")
    args = ap.parse_args(argv)
    manifest = json.loads(MANIFEST.read_text())
    out = args.dir or ROOT / manifest["dir"]
    out.mkdir(parents=True, exist_ok=True)
    missing = 0
    for entry in manifest["files"]:
        target = out / entry["name"]
        source = url(entry)
        if not target.exists() and source and not args.check:
            try:
                with urllib.request.urlopen(source, timeout=30) as r:
                    target.write_bytes(r.read())
            except OSError as e:
                print(f"{entry['name']}: could not download {source}: {e}", file=sys.stderr)
        if target.exists():
            digest = hashlib.sha256(target.read_bytes()).hexdigest()
            origin = f"{entry['project']}, {entry['repo']} {entry.get('path') or '(path unknown)'}"
            print(f"{entry['name']}: present, sha256 {digest} ({origin})")
        else:
            missing += 1
            where = source or f"the search tool's stored copy, read_file id {entry.get('search_tool_id')}"
            print(f"{entry['name']}: MISSING from {out} (from {where})")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
