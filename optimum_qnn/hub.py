"""The Hugging Face Hub side: resolving source models, and publishing / fetching exported artifacts.

Only `huggingface_hub` is used (no torch import), so the runtime can fetch an artifact cheaply.
"""

from __future__ import annotations

import logging
from pathlib import Path

from optimum_qnn.errors import OptimumQnnError

logger = logging.getLogger(__name__)

# What the exporter needs of a source checkpoint: config, text weights (safetensors), tokenizer.
SOURCE_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
]


class HubError(OptimumQnnError):
    """A repository, revision or file that cannot be had from the Hub (or its local cache)."""


def resolve_model_folder(model: str, *, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """A local folder for ``model``: the folder itself, or a snapshot of the Hub repo (only the files the exporter
    reads: never the vision/audio-only extras, never pickle weights unless ``allow_pickle``)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise HubError(f"{model} is not a model folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    patterns = SOURCE_PATTERNS + (["*.bin"] if allow_pickle else [])
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise HubError(f"Model {model!r} was not found on the Hub (or is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise HubError(f"Revision {revision!r} of {model!r} was not found on the Hub") from None
    except LocalEntryNotFoundError:
        raise HubError(
            f"{model!r} is not in the local Hugging Face cache and the Hub cannot be reached (offline?). "
            "Pass a local folder, or download it first when online."
        ) from None
    except HfHubHTTPError as e:
        raise HubError(f"The Hub refused {model!r}: {e}") from None


def download_variant(
    repo_id: str, *, soc: str | None, quant: str | None, context_len: int | None, revision: str | None
) -> tuple[Path, dict]:
    """Download the variant index of ``repo_id``, pick one variant, and fetch only its files plus the shared root
    files (config, tokenizer). Works offline from the Hugging Face cache (``HF_HUB_OFFLINE=1``).

    Returns:
        The local snapshot folder and the chosen index entry.
    """
    import json

    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from optimum_qnn.artifacts import INDEX_NAME, ROOT_FILES
    from optimum_qnn.modeling import select_variant

    try:
        index_path = hf_hub_download(repo_id, INDEX_NAME, revision=revision)
        entry = select_variant(json.loads(Path(index_path).read_text()), soc, quant, context_len)
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=[f"{entry['path']}/*", INDEX_NAME, *ROOT_FILES]
        )
    except RepositoryNotFoundError:
        raise HubError(f"Repository {repo_id!r} was not found on the Hub (or is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise HubError(f"Revision {revision!r} of {repo_id!r} was not found") from None
    except EntryNotFoundError:
        raise HubError(f"{repo_id!r} has no {INDEX_NAME}: it is not an optimum-qnn export") from None
    except LocalEntryNotFoundError:
        raise HubError(
            f"{repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached (offline?); "
            "download it once while online"
        ) from None
    except HfHubHTTPError as e:
        raise HubError(f"The Hub refused {repo_id!r}: {e}") from None
    return Path(folder), entry
