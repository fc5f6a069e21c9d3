#!/usr/bin/env python3
"""Ship a world's base, built here, with the code (prorag_app/bases/<name>/), so that `make run` (or the profile
whose model it is) installs it instead of warming one up (prorag_app.embedded.SHIPPED_BASES says why).

    PRORAG_HOME=<a home whose world was built by the current code> python scripts/ship_base.py --world default \
        --command "make run" --commit ce85ce1 --machine "dev-2c-epyc512 (2-core AMD EPYC)" --date 2026-11-29

The world's built base (``--variant``: the one a profile's base_variant names) is taken as it is: its embedded.json
must equal what the current code builds for ``--preset`` (default: the world's default preset) with the world's
default warm-up (prorag_app.embedded.base_spec), since only then is it installed. Its files are copied and
provenance.json records that spec, the world's fingerprint, each file's sha256 and how the base was built.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from prorag.io import atomic_dir, sha256_file, write_json
from prorag_app.embedded import (PROVENANCE, SHIPPED_BASES, SHIPPED_MARKER, base_spec, ensure_world,
                                 policy_base_dir, shipped_bases, world_fingerprint)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="default")
    ap.add_argument("--variant", default="", help="the built base of this base_variant (default: the world's own)")
    ap.add_argument("--preset", default=None, help="the model preset it was built with (default: the world's)")
    ap.add_argument("--name", default="", help="its directory under prorag_app/bases (default: the world's name)")
    ap.add_argument("--command", required=True, help="what built the base (e.g. 'make run')")
    ap.add_argument("--commit", required=True, help="the commit whose code built it")
    ap.add_argument("--machine", required=True, help="where it was built (the warm-up's outcome depends on the CPU)")
    ap.add_argument("--date", required=True)
    ap.add_argument("--note", default="", help="what the base is known to give (e.g. the agent's F1)")
    args = ap.parse_args(argv)

    src = policy_base_dir(args.world, args.variant)
    spec = json.loads((src / "embedded.json").read_text())
    want = base_spec(args.world, ensure_world(args.world)["size"], args.preset)
    if spec != want:
        print(f"{src} was not built with the current code's settings for its preset (its embedded.json differs from "
              "base_spec): build it with this code first", file=sys.stderr)
        return 2
    if (src / SHIPPED_MARKER).exists():
        print(f"{src} is an installed shipped base, not one built here", file=sys.stderr)
        return 2
    names = sorted(p.name for p in src.iterdir() if p.is_file() and p.name != "embedded.json")
    dest = SHIPPED_BASES / (args.name or args.world)
    twins = [other for other, prov in shipped_bases(args.world).items() if other != dest and prov["spec"] == spec]
    if twins:
        print(f"{twins[0]} already ships a base of these settings: one base per spec", file=sys.stderr)
        return 2
    with atomic_dir(dest) as tmp:  # a killed run leaves the shipped base as it was, never half replaced
        for name in names:
            shutil.copyfile(src / name, tmp / name)
        write_json(tmp / PROVENANCE, {
            "spec": spec, "world_fingerprint": world_fingerprint(args.world),
            "files": {name: sha256_file(tmp / name) for name in names},
            "built": {"command": args.command, "commit": args.commit, "machine": args.machine, "date": args.date,
                      "note": args.note}})
    print(f"shipped {src} -> {dest}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
