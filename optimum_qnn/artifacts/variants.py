"""Choosing one variant of an artifact folder and checking its files against its manifest (no runtime needed:
the Hub download and `from_pretrained` share these)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from optimum_qnn.artifacts.manifest import Manifest, ManifestError, resolve_inside, sha256_file
from optimum_qnn.errors import OptimumQnnError

logger = logging.getLogger(__name__)


class VariantNotFoundError(OptimumQnnError):
    """No exported variant matches the requested SoC / quant scheme / context."""


def select_variant(index: dict[str, Any], soc: str | None, quant: str | None, context_len: int | None) -> dict[str, Any]:
    """The index entry matching the request (None matches anything); a miss lists what exists."""
    want = {"soc": soc.upper() if soc else None, "quant": quant, "context_len": context_len}
    hits = [
        v for v in index["variants"]
        if all(val is None or v.get(key) == val for key, val in want.items())
    ]
    if len(hits) == 1:
        return hits[0]
    available = ", ".join(f"{v['soc']}/{v['quant']}/ctx{v['context_len']}/{v['mode']}" for v in index["variants"]) or "none"
    if not hits:
        raise VariantNotFoundError(
            f"No variant for soc={soc}, quant={quant}, context_len={context_len}; available: {available}"
        )
    raise VariantNotFoundError(f"Several variants match soc={soc}, quant={quant}; be more specific. Available: {available}")


def verify_files(
    folder: Path, manifest: Manifest, *, root: Path | None = None, allowed_root: Path | None = None
) -> None:
    """Check the size and sha256 of every file the manifest lists; a mismatch names the file.

    ``folder`` is the variant folder; ``root``, when given, is the artifact root whose shared files (config,
    tokenizer...) the manifest's ``root_files`` list: they are checked too, since a tampered tokenizer or config
    changes what the model generates as surely as a tampered program. A 1.0 manifest lists no root files.
    ``allowed_root``: see `resolve_inside` (the blobs folder of a Hugging Face cache snapshot).
    """
    checks = [(folder, entry) for entry in manifest.files]
    if root is not None and manifest.root_files is not None:
        checks += [(root, entry) for entry in manifest.root_files]
    elif root is not None:
        logger.info("%s: a schema %s manifest lists no root files; config and tokenizer are not verified",
                    folder, manifest.schema_version)
    for base, entry in checks:
        path = resolve_inside(base, entry.path, allowed_root=allowed_root)
        if not path.is_file():
            raise ManifestError(f"{entry.path} is listed in the manifest but missing from {base}")
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise ManifestError(
                f"{entry.path} does not match its manifest sha256 (corrupt or tampered file at {path}); "
                "delete it and download or export it again"
            )
