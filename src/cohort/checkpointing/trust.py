"""`python -m cohort.checkpointing.trust CHECKPOINT...`: record the manifest of a checkpoint saved before cohort
wrote manifests, so that it loads again (see `cohort.checkpointing.manifest`).

Run it only on a folder you trust (your own, unchanged since it was saved): the manifest records its files as
they are now, and from then on any change to them stops a load.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cohort.checkpointing.manifest import record_manifest
from cohort.errors import CohortError


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths or any(p.startswith("-") for p in paths):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        try:
            manifest = record_manifest(path)
        except CohortError as exc:
            print(f"cohort: error: {exc}", file=sys.stderr)
            return 2
        print(f"{path}: recorded {len(manifest.files)} files "
              f"({'with' if manifest.optimizer_state else 'without'} optimizer state) in its manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
