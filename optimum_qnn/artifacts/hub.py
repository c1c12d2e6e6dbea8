"""The Hugging Face Hub side: resolving source models, and publishing / fetching exported artifacts.

Only `huggingface_hub` is used (no torch import), so the runtime can fetch an artifact cheaply.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from optimum_qnn.artifacts.model_card import CARD_NAME, artifact_index, write_model_card
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
    check_folder_or_repo_id(model, "model")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

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


# A Hub repo id: "name" or "owner/name" of letters, digits, '-', '_', '.' (huggingface_hub's own rule, which it
# reports as a syntax error rather than "no such folder").
_HUB_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


def check_folder_or_repo_id(name: str, what: str) -> None:
    """Refuse, with what to do, a ``name`` that is neither an existing folder nor a possible Hub repo id (a
    mistyped path, a file)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise HubError(f"{name} is a file; pass the {what} folder that holds it (or a Hub repo id)")
    if name.startswith((".", "/", "~")) or "\\" in name or not _HUB_ID.match(name):
        raise HubError(
            f"No such folder: {name}. It is not a Hub repo id either ('owner/name'); check the path of the {what}"
        )


def download_variant(
    repo_id: str, *, soc: str | None, quant: str | None, context_len: int | None, revision: str | None,
    cache_layout: str | None = None, prefer_layout: str = "full", max_memory: float | None = None,
    speculative: str | None = None, images: bool = False,
) -> tuple[Path, dict]:
    """Download the variant index of ``repo_id``, pick one variant, and fetch only its files plus the shared root
    files (config, tokenizer). Works offline from the Hugging Face cache (``HF_HUB_OFFLINE=1``).

    The choice is `variants.select_variant`'s; when it weighs contexts by memory, it reads the candidates'
    manifests (small files) before downloading any program.

    Returns:
        The local snapshot folder and the chosen index entry.
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from optimum_qnn.artifacts.writer import INDEX_NAME, ROOT_FILES
    from optimum_qnn.artifacts.manifest import MANIFEST_NAME, read_manifest
    from optimum_qnn.artifacts.variants import MemoryFit, memory_need_bytes, select_variant

    def need_bytes(entry: dict) -> int:
        path = hf_hub_download(repo_id, f"{entry['path']}/{MANIFEST_NAME}", revision=revision)
        return memory_need_bytes(read_manifest(Path(path).parent))

    check_folder_or_repo_id(repo_id, "artifact")
    what = f"{repo_id!r}"
    try:
        index_path = hf_hub_download(repo_id, INDEX_NAME, revision=revision)
        entry = select_variant(json.loads(Path(index_path).read_text()), soc, quant, context_len, cache_layout,
                               prefer_layout=prefer_layout, fit=MemoryFit(need_bytes, max_memory),
                               speculative=speculative, images=images)
        what = f"Variant {entry['path']} of {repo_id!r}"
        folder = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=[f"{entry['path']}/*", INDEX_NAME, *ROOT_FILES])
        )
    except RevisionNotFoundError:
        raise HubError(f"Revision {revision!r} of {repo_id!r} was not found") from None
    except RepositoryNotFoundError:
        # Some servers answer an unknown revision of a visible repo like an unknown repo: name both.
        raise HubError(
            f"Repository {repo_id!r} at revision {revision or 'main'!r} was not found on the Hub "
            "(a wrong repo id or revision, or a private repo: log in with `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError:  # before EntryNotFoundError, its base class
        raise HubError(
            f"{what} is not in the local Hugging Face cache and the Hub cannot be reached (offline?); "
            "download it once while online"
        ) from None
    except EntryNotFoundError:
        raise HubError(f"{repo_id!r} has no {INDEX_NAME}: it is not an optimum-qnn export") from None
    except HfHubHTTPError as e:
        raise HubError(f"The Hub refused {repo_id!r}: {e}") from None
    if not (folder / entry["path"] / MANIFEST_NAME).is_file():
        # Offline, a snapshot holding other variants is returned as it is.
        raise HubError(
            f"{what} is not in the local Hugging Face cache (only other variants are) and the Hub cannot be "
            "reached (offline?); download it once while online"
        )
    return folder, entry


# --- Publishing ------------------------------------------------------------------------------------------------



@dataclass(frozen=True)
class PlannedCommit:
    """One commit of a push: its message and the repository paths it adds (sorted)."""

    message: str
    files: tuple[str, ...]
    variant: str | None = None  # the variant folder this commit uploads; None for the root commit


@dataclass
class PushPlan:
    """What `push_to_hub` uploads (``dry_run=True``) or uploaded: one root commit, then one commit per variant.

    ``commit_urls`` is filled in after a real push, one URL per commit of ``commits``.
    """

    repo_id: str
    revision: str | None
    private: bool
    output_dir: Path
    commits: list[PlannedCommit]
    commit_urls: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """Every repository path the push writes, once each, sorted."""
        return sorted({f for c in self.commits for f in c.files})


def _variant_files(output_dir: Path, entry: dict[str, Any]) -> list[str]:
    """The repository paths of one variant (manifest + every file it lists), each checked against its sha256."""
    from optimum_qnn.artifacts.manifest import MANIFEST_NAME, read_manifest, resolve_inside
    from optimum_qnn.artifacts.variants import verify_files

    folder = resolve_inside(output_dir, entry["path"])
    manifest = read_manifest(folder)
    verify_files(folder, manifest)  # the same size and sha256 check as loading does
    names = [MANIFEST_NAME, *(f.path for f in manifest.files)]
    return [f"{entry['path']}/{name}" for name in sorted(set(names))]


def _read_index_for_push(output_dir: Path) -> dict[str, Any]:
    from optimum_qnn.artifacts.writer import ArtifactError

    try:
        return artifact_index(output_dir)
    except ArtifactError as e:
        raise HubError(f"{e}: nothing to push") from None


def plan_push(output_dir: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None) -> PushPlan:
    """The commits `push_to_hub` makes, without writing or uploading anything.

    The root commit adds the shared root files and ``README.md``. Commit *k* then adds variant *k* and a
    ``qnn_index.json`` listing variants 1..k, so the remote index only ever lists variants that are complete
    (an interrupted push leaves a consistent repo); the last commit uploads the local index as it is.
    """
    from optimum_qnn.artifacts.writer import INDEX_NAME, ROOT_FILES

    output_dir = Path(output_dir)
    index = _read_index_for_push(output_dir)
    root = sorted([name for name in ROOT_FILES if (output_dir / name).is_file()] + [CARD_NAME])
    commits = [PlannedCommit(f"Add shared files and model card ({len(root)} files)", tuple(root))]
    for entry in index["variants"]:
        files = sorted([*_variant_files(output_dir, entry), INDEX_NAME])
        commits.append(PlannedCommit(f"Add variant {entry['path']}", tuple(files), variant=entry["path"]))
    return PushPlan(repo_id, revision, private, output_dir, commits)


def _index_bytes(index: dict[str, Any], pushed: list[str]) -> bytes:
    partial = dict(index, variants=[v for v in index["variants"] if v["path"] in pushed])
    return (json.dumps(partial, indent=2) + "\n").encode("utf-8")


def push_to_hub(
    output_dir: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
) -> PushPlan:
    """Publish an artifact folder to a Hub model repo, one commit per variant (see `plan_push`).

    The repo (and the ``revision`` branch, if given) is created when missing. ``README.md`` is (re)generated
    into ``output_dir`` first unless it was written by hand. Every variant file is checked against its
    manifest sha256 before anything is sent.

    Args:
        output_dir: the artifact folder written by `optimum_qnn.exporter.pipeline.export`.
        repo_id: ``"org/name"`` of the model repo.
        token: a Hub token (default: the logged-in one).
        private: create the repo private (an existing repo keeps its visibility).
        revision: the branch to commit to (default: ``main``).
        commit_message: a prefix for every commit message.
        dry_run: only return the plan: no card written, no network.

    Returns:
        The plan; after a real push, ``commit_urls`` holds the URL of each commit.
    """
    output_dir = Path(output_dir)
    if not dry_run:
        write_model_card(output_dir)
    plan = plan_push(output_dir, repo_id, private=private, revision=revision)
    if commit_message:
        plan.commits = [replace(c, message=f"{commit_message}: {c.message}") for c in plan.commits]
    if dry_run:
        return plan

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from optimum_qnn.artifacts.writer import INDEX_NAME, read_index

    api = HfApi(token=token)
    index = read_index(output_dir)
    last = plan.commits[-1].variant
    pushed: list[str] = []  # variants whose commit is being or has been made
    completed: list[str] = []
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        for commit in plan.commits:
            if commit.variant is not None:
                pushed.append(commit.variant)
            operations = []
            for name in commit.files:
                if name == INDEX_NAME and commit.variant != last:
                    source: str | bytes = _index_bytes(index, pushed)
                else:
                    source = str(output_dir / name)
                operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=source))
            info = api.create_commit(repo_id, operations, commit_message=commit.message, revision=revision)
            plan.commit_urls.append(str(info.commit_url))
            if commit.variant is not None:
                completed.append(commit.variant)
            logger.info("Pushed %s (%d files): %s", commit.variant or "root files", len(operations), info.commit_url)
    except HfHubHTTPError as e:
        done = ", ".join(completed) or "none"
        raise HubError(f"Pushing to {repo_id!r} failed ({e}); variants already pushed: {done}") from None
    return plan
