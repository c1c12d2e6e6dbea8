"""The runner manifest: a versioned, typed description of one exported variant.

Everything a runner needs and nothing it must guess: where the model came from, what built it, what it targets,
how it was quantized, the exact IO of every method (the runner contract), the tokenizer facts, and the size and
sha256 of every file the variant depends on: its own folder's files (``files``) and, since schema 1.1, the shared
files of the artifact root it reads (``root_files``: config, generation config, tokenizer, chat template).
It is plain JSON (``manifest.json`` beside ``model.pte``); ``manifest.schema.json`` in this package is its
JSON Schema, generated from these dataclasses (`json_schema()`).

Reading is strict: an unknown major version, a missing, extra or wrong-typed field, or a file name that leaves
the variant folder raises `ManifestError`, and nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Union

from optimum_qnn.errors import OptimumQnnError

# 1.1 added `root_files`; a 1.0 manifest still reads (its root files are then not verified). 1.2 added
# `quantization.weight_rounding` (absent: "nearest"). 1.3 added `mixed_precision.sensitivity_probes` (absent: not
# recorded). 1.4 added `contract.lookahead` (absent: no lookahead decoding). 1.5 added `contract.assistant` (absent:
# no drafter) and `contract.block_len` (absent: no blocks layout).
SCHEMA_VERSION = "1.6"
MANIFEST_NAME = "manifest.json"
PROGRAM_NAME = "model.pte"


class ManifestError(OptimumQnnError):
    """A manifest that cannot be trusted: unreadable, of an unknown version, malformed, or pointing outside."""


@dataclass(frozen=True)
class FileEntry:
    """A file of the variant folder (a relative POSIX path inside it), with its size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Source:
    model_id: str
    revision: str | None
    weight_files: list[FileEntry]


@dataclass(frozen=True)
class Versions:
    optimum_qnn: str
    executorch: str
    torch: str
    transformers: str
    qairt_build_id: str


@dataclass(frozen=True)
class Target:
    soc: str
    htp_arch: int


@dataclass(frozen=True)
class QuantRecipeRow:
    module: str
    op: str
    activation: str
    weight: str
    count: int


@dataclass(frozen=True)
class LinearPlanRow:
    module: str
    params: int
    sqnr_db: float  # logits SQNR with only this linear at 4 bits, on the calibration text (random-probe estimate)
    kept: bool  # kept at the plan's higher precision


@dataclass(frozen=True)
class MixedPrecision:
    """The `--size-budget` plan: which linears a 4-bit export kept at 8 bits, and each linear's measured sensitivity."""

    size_budget: str
    kept_scheme: str
    kept_share: float  # of the linear weights' parameters
    linears: list[LinearPlanRow]
    sensitivity_probes: int | None = None  # random probes the sensitivities were estimated from (absent before 1.3)


@dataclass(frozen=True)
class Quantization:
    scheme: str
    block_size: int | None
    embedding: str
    kv_io_bits: int
    recipe: list[QuantRecipeRow]
    named_recipe: str | None = None  # e.g. "16a4w_e2b" (optimum_qnn.config.RECIPES)
    weight_ranges: str = "minmax"
    weight_rounding: str = "nearest"
    mixed_precision: MixedPrecision | None = None


@dataclass(frozen=True)
class TensorIO:
    name: str
    shape: list[int]
    dtype: str
    # Integer IO of quantized exports: real = (q - zero_point) * scale.
    scale: float | None = None
    zero_point: int | None = None


@dataclass(frozen=True)
class Method:
    name: str
    ar_len: int
    inputs: list[TensorIO]
    outputs: list[TensorIO]


@dataclass(frozen=True)
class Layer:
    index: int
    attention: str
    head_dim: int
    kv_heads: int
    kv_source: int
    cache_index: int | None


@dataclass(frozen=True)
class LookaheadInfo:
    """A ``--mode lookahead`` export: N, W, G (`optimum_qnn.lookahead.Lookahead`), the AR its ``kv_forward`` takes,
    and the flags ExecuTorch's ``qnn_llama_runner`` runs it with (it reads no lookahead metadata from the .pte)."""

    ngram: int
    window: int
    gcap: int
    ar_len: int
    runner_args: list[str]


@dataclass(frozen=True)
class DraftSources:
    """The target layers whose K/V cache buffers the drafter reads, by attention kind (`LayerSpec.index`)."""
    full_attention: int
    sliding_attention: int


@dataclass(frozen=True)
class AssistantInfo:
    """``--assistant`` (docs/assistant.md): the drafter is method ``method`` (IO in ``methods``); ``kv_forward``
    verifies ``draft_len`` drafts in one call of ``verify_ar`` tokens; ``sliding_window``: the drafter's own."""

    model_id: str
    draft_len: int
    method: str
    verify_ar: int
    hidden_size: int
    sliding_window: int
    source_layers: DraftSources


@dataclass(frozen=True)
class ImagesInfo:
    """An image variant (``--task image-text-to-text``, since 1.6): the vision encoder is method ``method`` of the
    program (pixels in, ``soft_tokens`` rows of soft tokens out), the prefill method takes them (`IMAGE_INPUTS`), and
    the prompt marks an image with ``boi_token_id``, ``soft_tokens`` times ``image_token_id`` (at most: fewer for a
    small image), then ``eoi_token_id``; at a soft token's place the decoder reads ``pad_token_id``."""

    method: str
    soft_tokens: int
    patch_size: int
    pooling_kernel_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    pad_token_id: int


@dataclass(frozen=True)
class Contract:
    """The runner contract (see docs/runner_contract.md)."""

    context_len: int
    vocab_size: int
    sliding_window: int | None
    mask_attend: float
    mask_masked: float
    rope: str
    kv_update: str
    weight_sharing: bool
    layers: list[Layer]
    methods: list[Method]
    # QNN delegates per method (context binaries in the .pte); above 1 they hand over through `llama::fallback`.
    shards: int = 1
    # "full": every cache C - ar slots (ExecuTorch's C++ runner's layout); "ring": sliding layers keep
    # sliding_window slots, position p in slot p % sliding_window; "blocks": see block_len (optimum_qnn.contract.CacheLayout).
    cache_layout: str = "full"
    lookahead: LookaheadInfo | None = None  # set by `--mode lookahead` (since 1.4)
    assistant: AssistantInfo | None = None  # set by `--assistant` (since 1.5)
    # "blocks" (since 1.5): slots per cache block; every cache that is no ring is inputs `{k,v}_cache_{i}_block{b}`.
    block_len: int | None = None
    images: ImagesInfo | None = None  # set by `--task image-text-to-text` (since 1.6)


@dataclass(frozen=True)
class TokenizerInfo:
    files: list[str]
    bos_id: int | None
    eos_ids: list[int]
    pad_id: int | None
    chat_template: str | None


@dataclass(frozen=True)
class Evaluation:
    text_file: str
    tokens: int
    perplexity_reference: float
    perplexity_exported: float
    sqnr_db: float
    top1_agreement: float | None = None  # share of next-token argmaxes equal to fp32's


@dataclass(frozen=True)
class QnnTensor:
    """A graph input or output as the context binary records it (`encoding`: a summary, None when float)."""

    name: str
    dtype: str
    shape: list[int]
    encoding: str | None


@dataclass(frozen=True)
class QnnGraph:
    name: str
    inputs: list[QnnTensor]
    outputs: list[QnnTensor]


@dataclass(frozen=True)
class QnnContext:
    """One QNN context binary of the .pte, read back with the QNN System library (`python -m optimum_qnn inspect`)."""

    delegates: list[str]
    size: int
    soc: str
    htp_arch: int | None
    build_id: str
    weight_sharing: bool | None
    shared_weights_bytes: int
    const_bytes: int
    graphs: list[QnnGraph]


@dataclass(frozen=True)
class SharingCheck:
    """The weight-shared build compared with a non-shared lowering of the same graphs (`inspection.compare_builds`).

    Args:
        same_graphs: same contexts, graph names, and each graph's IO names, dtypes, shapes and encodings.
        differences: what differs, one line each (empty when `same_graphs`).
        shared_size, unshared_size: total context binary bytes of each build.
        saved_bytes: `unshared_size - shared_size`.
        shared_weights_bytes: the shared build's weight pool (one copy of the HTP weights).
        weights_stored_once: the shared build has a pool, the other none, and it is smaller by at least half the
            pool per graph that would otherwise hold its own copy.
    """

    same_graphs: bool
    differences: list[str]
    shared_size: int
    unshared_size: int
    saved_bytes: int
    shared_weights_bytes: int
    weights_stored_once: bool


@dataclass(frozen=True)
class Inspection:
    contexts: list[QnnContext]
    sharing_check: SharingCheck | None = None


@dataclass(frozen=True)
class Manifest:
    schema_version: str
    source: Source
    versions: Versions
    target: Target
    quantization: Quantization
    contract: Contract
    tokenizer: TokenizerInfo
    program: FileEntry
    files: list[FileEntry]
    evaluation: Evaluation | None = None
    inspection: Inspection | None = None  # absent in manifests written before optimum-qnn recorded it
    # The artifact root's files this variant needs, paths relative to the root (``out/config.json`` is
    # ``config.json``); None in a 1.0 manifest, which did not list them.
    root_files: list[FileEntry] | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False) + "\n"

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    def runner_contract(self):
        """The `RunnerContract` of this variant."""
        from optimum_qnn.contract import RunnerContract

        return RunnerContract.from_dict(dataclasses.asdict(self.contract))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(folder: Path, relative: str) -> FileEntry:
    path = Path(folder) / relative
    return FileEntry(relative, path.stat().st_size, sha256_file(path))


def safe_relative_path(name: str) -> PurePosixPath:
    """Check that a manifest file name stays inside its folder (no absolute path, no ``..``, no backslash)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or name.startswith("~"):
        raise ManifestError(f"File name {name!r} in the manifest points outside the variant folder")
    return p


def resolve_inside(folder: Path, name: str, *, allowed_root: Path | None = None) -> Path:
    """The path of manifest file ``name`` inside ``folder``; symlinks that lead outside are refused.

    ``allowed_root`` is one more folder symlinks may lead into: a Hugging Face cache snapshot stores its files as
    symlinks into the repo's ``blobs`` folder.
    """
    rel = safe_relative_path(name)
    root = Path(folder).resolve()
    path = (root / rel).resolve()
    roots = [root] + ([Path(allowed_root).resolve()] if allowed_root is not None else [])
    if not any(r == path or r in path.parents for r in roots):
        raise ManifestError(f"File {name!r} resolves to {path}, outside the variant folder {root}")
    return path


def read_manifest(folder_or_file: Path | str) -> Manifest:
    """Read and validate a manifest (a variant folder or the manifest file itself)."""
    path = Path(folder_or_file)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"No manifest at {path}: is this an optimum-qnn variant folder?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"Cannot read manifest {path}: {e}") from None
    return manifest_from_dict(data, str(path))


def manifest_from_dict(data: Any, where: str = "manifest") -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if not isinstance(version, str) or not version.split(".")[0].isdigit():
        raise ManifestError(f"{where}: missing or malformed schema_version {version!r}")
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ManifestError(
            f"{where}: schema version {version} is not readable by this optimum-qnn (reads {SCHEMA_VERSION.split('.')[0]}.x); "
            "upgrade optimum-qnn or re-export the model"
        )
    manifest = _build(Manifest, data, "manifest")
    for entry in [manifest.program, *manifest.files, *(manifest.root_files or [])]:
        safe_relative_path(entry.path)
    for name in manifest.tokenizer.files:
        safe_relative_path(name)
    return manifest


def _build(tp: Any, value: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and build dataclasses; raise ManifestError naming the field."""
    origin = typing.get_origin(tp)
    if origin is Union or type(tp).__name__ == "UnionType":
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _build(inner[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ManifestError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        extra = sorted(set(value) - set(fields))
        if extra:
            raise ManifestError(f"{where}: unexpected field(s) {extra}")
        kwargs = {}
        for name, f in fields.items():
            if name not in value:
                if f.default is not dataclasses.MISSING:
                    continue
                raise ManifestError(f"{where}: missing field {name!r}")
            kwargs[name] = _build(hints[name], value[name], f"{where}.{name}")
        return tp(**kwargs)
    if origin is list:
        if not isinstance(value, list):
            raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ManifestError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ManifestError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ManifestError(f"{where}: expected a string, got {value!r}")
        return value
    raise ManifestError(f"{where}: unsupported schema type {tp!r}")  # pragma: no cover


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the manifest, derived from the dataclasses above."""
    defs: dict[str, Any] = {}

    def schema_of(tp: Any) -> dict[str, Any]:
        origin = typing.get_origin(tp)
        if origin is Union or type(tp).__name__ == "UnionType":
            args = typing.get_args(tp)
            inner = [schema_of(a) for a in args if a is not type(None)]
            return {"anyOf": inner + [{"type": "null"}]} if type(None) in args else inner[0]
        if dataclasses.is_dataclass(tp):
            name = tp.__name__
            if name not in defs:
                defs[name] = {}
                hints = typing.get_type_hints(tp)
                fs = dataclasses.fields(tp)
                defs[name] = {
                    "type": "object",
                    "additionalProperties": False,
                    "required": [f.name for f in fs if f.default is dataclasses.MISSING],
                    "properties": {f.name: schema_of(hints[f.name]) for f in fs},
                }
            return {"$ref": f"#/$defs/{name}"}
        if origin is list:
            return {"type": "array", "items": schema_of(typing.get_args(tp)[0])}
        return {bool: {"type": "boolean"}, int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"}}[tp]

    root = schema_of(Manifest)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "optimum-qnn runner manifest",
        "description": f"Schema version {SCHEMA_VERSION}",
        **root,
        "$defs": defs,
    }
