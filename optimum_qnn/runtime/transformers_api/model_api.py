"""What code written for a transformers model reads from one: ``config``, ``generation_config``, ``device``,
``dtype``, ``can_generate()``, ``to()`` / ``eval()`` / ``cpu()``, ``save_pretrained`` and ``push_to_hub``.

Optimum's runtime classes for other runtimes (optimum-onnx's ``ORTModelForCausalLM``, optimum-intel's
``OVModelForCausalLM``) carry the same, which is what ``pipeline()`` and most user code need. A model class mixes this
in and has ``root`` (the artifact folder), ``variant`` (the loaded variant's folder) and ``manifest``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.runtime.transformers_api.choosing import torch_available

logger = logging.getLogger(__name__)


class ArtifactConfig(SimpleNamespace):
    """The checkpoint's ``config.json`` on the runtime install (no transformers): its fields as attributes, a nested
    config as another `ArtifactConfig`, ``to_dict()`` and ``get_text_config()`` as transformers' configs have."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArtifactConfig":
        return cls(**{k: cls.from_dict(v) if isinstance(v, dict) else v for k, v in data.items()})

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, ArtifactConfig) else v for k, v in vars(self).items()}

    def get_text_config(self, *args: Any, **kwargs: Any) -> "ArtifactConfig":
        return getattr(self, "text_config", None) or self


class TransformersModelMixin:
    """The attributes and no-op methods of a transformers ``PreTrainedModel`` that runtime code and ``pipeline()``
    read (see the module docstring)."""

    main_input_name = "input_ids"
    # transformers' tables of the classes each pipeline task expects (`_known_to_pipelines`).
    pipeline_tables: tuple[str, ...] = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)
    input_modalities = ("text",)
    output_modalities = ("text",)
    _config: Any = None
    _generation_config: Any = None

    @property
    def config(self) -> Any:
        """The checkpoint's config (``config.json`` the artifact keeps): a transformers config where transformers is
        importable, else an `ArtifactConfig` with the same fields."""
        if self._config is None:
            path = Path(self.root) / "config.json"
            if not path.is_file():
                raise InvalidInputError(f"{self.root} has no config.json: export it again (the exporter copies it)")
            if torch_available():
                from transformers import AutoConfig

                self._config = AutoConfig.from_pretrained(str(self.root))
                _known_to_pipelines(type(self).__name__, self.pipeline_tables)
            else:
                self._config = ArtifactConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
        return self._config

    @property
    def generation_config(self) -> Any:
        """The checkpoint's generation config (its ``generation_config.json``, else the manifest's token ids) that
        `generate` starts from: a transformers ``GenerationConfig`` where transformers is importable, else a dict.
        Set fields on it to change every later call, as with a transformers model."""
        if self._generation_config is None:
            fields = self._generation_file()
            if torch_available():
                from transformers import GenerationConfig

                self._generation_config = GenerationConfig(**fields)
            else:
                self._generation_config = dict(fields)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self._generation_config = value

    def generation_defaults(self) -> dict[str, Any]:
        """``generation_config`` as a dict of the fields it sets (`options.resolve` merges the call over it)."""
        from optimum_qnn.runtime.transformers_api.options import config_dict

        return config_dict(self.generation_config, "model.generation_config")

    def _generation_file(self) -> dict[str, Any]:
        path = Path(self.root) / "generation_config.json"
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        info = self.manifest.tokenizer
        return {"bos_token_id": info.bos_id, "eos_token_id": list(info.eos_ids), "pad_token_id": info.pad_id}

    @property
    def device(self) -> Any:
        """``torch.device("cpu")`` (``"cpu"`` without torch): where the inputs and outputs live. The tokens are
        computed where `device_name` says."""
        try:
            import torch
        except ImportError:
            return "cpu"
        return torch.device("cpu")

    @property
    def dtype(self) -> Any:
        """``torch.float32`` (``"float32"`` without torch): the logits' type on the host (the NPU computes at the
        scheme's precision)."""
        try:
            import torch
        except ImportError:
            return "float32"
        return torch.float32

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def to(self, *args: Any, **kwargs: Any) -> "TransformersModelMixin":
        """Accepted and does nothing: the program runs where it was loaded (``device=`` of `from_pretrained`)."""
        return self

    def eval(self) -> "TransformersModelMixin":
        """Accepted and does nothing: the program has no training mode."""
        return self

    def cpu(self) -> "TransformersModelMixin":
        """Accepted and does nothing (see `to`)."""
        return self

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Write the loaded variant, the checkpoint's shared files and an index listing that variant only into
        ``save_directory`` (created; it must not already hold an artifact), so that `from_pretrained` loads it again.

        Returns:
            The folder written.
        """
        from optimum_qnn.artifacts.manifest import MANIFEST_NAME
        from optimum_qnn.artifacts.writer import INDEX_NAME, ROOT_FILES, read_index

        out = Path(save_directory).expanduser()
        if (out / INDEX_NAME).exists():
            raise InvalidInputError(f"{out} already holds an artifact ({INDEX_NAME}); save into a new or empty folder")
        root, variant = Path(self.root), Path(self.variant)
        rel = variant.resolve().relative_to(root.resolve()).as_posix()
        entries = [e for e in read_index(root)["variants"] if e["path"] == rel]
        if not entries:
            raise InvalidInputError(f"{root}'s index does not list the loaded variant {rel}")
        (out / rel).mkdir(parents=True, exist_ok=True)
        listed = self.manifest.root_files  # None in a 1.0 manifest: then the files an export writes at the root
        for name in [f.path for f in listed] if listed is not None else [n for n in ROOT_FILES if (root / n).is_file()]:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, out / name)
        for name in {MANIFEST_NAME, *(f.path for f in self.manifest.files)}:
            (out / rel / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(variant / name, out / rel / name)  # a Hub snapshot's links are followed
        index = dict(read_index(root), variants=entries)
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        logger.info("Saved variant %s to %s", rel, out)
        return out

    def push_to_hub(self, repo_id: str, *, token: str | None = None, private: bool = False,
                    revision: str | None = None, commit_message: str | None = None, dry_run: bool = False) -> Any:
        """Upload the loaded variant to the Hub repo ``repo_id`` as the export's ``--push-to-hub`` does (one commit for
        the shared files, one for the variant; `artifacts.hub.push_to_hub`) from a `save_pretrained` copy.

        Returns:
            The push plan, with ``commit_urls`` (``dry_run``: the plan only, nothing uploaded).
        """
        import tempfile

        from optimum_qnn.artifacts.hub import push_to_hub

        with tempfile.TemporaryDirectory(prefix="optimum-qnn-push-") as tmp:
            folder = self.save_pretrained(Path(tmp) / "artifact")
            return push_to_hub(folder, repo_id, token=token, private=private, revision=revision,
                               commit_message=commit_message, dry_run=dry_run)


def _known_to_pipelines(name: str, tables: tuple[str, ...]) -> None:
    """Name the class in transformers' tables of the models each pipeline task supports.

    transformers 5.23.0's ``Pipeline.check_model_type`` logs an error ("The model 'QNNModelForCausalLM' is not
    supported for text-generation") for a class whose name its table lacks, then runs anyway. The tables map a
    model type to a class name; an entry under a model type no config has (``optimum_qnn:<class>``) only tells the
    check the name: the auto classes look models up from a config's type, so they never reach it. Read when
    ``pipeline()`` first reads ``model.config``, before the check."""
    from transformers.models.auto import modeling_auto

    for table in tables:
        getattr(modeling_auto, table).setdefault(f"optimum_qnn:{name}", name)
