"""Load the Gemma4 text decoder from a checkpoint folder (safetensors) without the towers, and, for image prompts,
the vision tower with its projection (`load_vision_parts`) without the text decoder; the audio tower never.

`Gemma4ForCausalLM.from_pretrained` on a multimodal checkpoint (keys ``model.language_model.*``) silently leaves
every weight random, and `Gemma4ForConditionalGeneration` materialises the towers. This loader builds the text
model on the meta device, maps the keys itself, reads tensor by tensor from the safetensors files (the towers'
tensors are never read), and fails loudly on any missing or unexpected text weight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4 import modeling_gemma4 as hf

from optimum_qnn.errors import OptimumQnnError, UnsupportedModelError
from optimum_qnn.models.gemma4.families import check_dense, check_model_type

logger = logging.getLogger(__name__)

# Multimodal checkpoints keep these beside the text decoder; the exporter never reads them.
NON_TEXT_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_SHARED_KV_KEY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class CheckpointError(OptimumQnnError):
    """A checkpoint folder that cannot be loaded as a Gemma4 text model."""


@dataclass
class LoadReport:
    """Which checkpoint tensors were read and which were skipped without being read."""

    read: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def _corrupt(path: Path, reason: object) -> "CheckpointError":
    return CheckpointError(
        f"{path} cannot be read ({reason}): the file is corrupt or an incomplete download. Download the model again "
        "(for a Hub model: delete its folder under ~/.cache/huggingface/hub, or pass force_download)"
    )


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, e) from None
    if not isinstance(raw, dict):
        raise _corrupt(path, f"expected a JSON object, got {type(raw).__name__}")
    return raw


def read_text_config(folder: Path) -> Gemma4TextConfig:
    """The Gemma4 text config of a checkpoint folder (the ``text_config`` of a multimodal one)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"No config.json in {folder}: is this a Hugging Face model folder?")
    raw = _read_json(config_path)
    check_model_type(raw, config_path)
    model_type = raw["model_type"]
    try:
        if model_type == "gemma4":
            config = Gemma4Config.from_pretrained(folder).get_text_config()
        else:
            config = Gemma4TextConfig.from_pretrained(folder)
        config.kv_sharing_modes  # noqa: B018  (derived from the layer counts: a bad value fails here, not mid-load)
    except Exception as e:  # transformers/huggingface_hub validators raise their own types (StrictDataclass...Error)
        raise CheckpointError(
            f"{config_path} is not a valid Gemma4 config ({type(e).__name__}: {e}); fix the value it names or download "
            "the model again"
        ) from None
    _check_config_values(config, config_path)
    check_dense(config, config_path)
    return config


def _check_config_values(config: Gemma4TextConfig, path: Path) -> None:
    """Sizes that transformers accepts but no model can have (a hand-edited or truncated config)."""
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                 "max_position_embeddings"):
        value = getattr(config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{path}: {name} must be a positive integer; got {value!r}. Fix the config or download it again")


def _safetensors_files(folder: Path, allow_pickle: bool) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise _corrupt(index, "no 'weight_map' of tensor name -> file name")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index.name} in {folder} lists weight files that are missing: {', '.join(missing)}. The download is "
                "incomplete: download the model again"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(folder.glob("*.bin"))
    if pickles and allow_pickle:
        return pickles
    if pickles:
        raise CheckpointError(
            f"{folder} has only pickle (.bin) weights. They are refused by default because pickle can run code; "
            "convert them to safetensors, or pass --allow-pickle (allow_pickle=True) to load them with "
            "torch.load(weights_only=True)."
        )
    raise CheckpointError(f"No *.safetensors weights in {folder}")


def check_checkpoint(folder: str | Path, *, allow_pickle: bool = False) -> Gemma4TextConfig:
    """Everything about a checkpoint folder that can be checked without reading its tensors: the config parses and
    is Gemma4, the weight files exist and their safetensors headers are whole. Costs milliseconds; run it before
    any long work. Returns the text config."""
    folder = Path(folder)
    config = read_text_config(folder)
    for file in _safetensors_files(folder, allow_pickle):
        if file.suffix == ".safetensors":
            with _open_tensors(file):
                pass
    return config


@contextlib.contextmanager
def _open_tensors(file: Path):
    """Yield ``(keys, get_tensor)`` for a safetensors file (lazy, tensor by tensor) or an opted-in pickle file."""
    if file.suffix == ".safetensors":
        try:
            f = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise _corrupt(file, e) from None
        with f:
            yield list(f.keys()), f.get_tensor
    else:
        # weights_only=True refuses anything but tensors and plain containers; mmap avoids a second copy.
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
            raise _corrupt(file, e) from None
        if not isinstance(sd, dict):
            raise _corrupt(file, f"expected a dict of tensors, got {type(sd).__name__}")
        yield list(sd.keys()), sd.__getitem__


def _text_key(key: str, multimodal: bool) -> str | None:
    """Checkpoint key -> Gemma4ForCausalLM key, or None for tensors outside the text decoder."""
    if key.startswith(NON_TEXT_PREFIXES):
        return None
    if multimodal:
        if key.startswith("model.language_model."):
            return "model." + key[len("model.language_model.") :]
        return key  # lm_head.weight, or an unexpected key reported by the caller
    return key


def _matching_tensors(files: list[Path], target_of, shapes: dict[str, tuple[int, ...]], report: LoadReport,
                      unexpected: list[str], wrong_shape: list[str]):
    """Yield ``(checkpoint key, model key, tensor)`` for each tensor whose model key (``target_of(key)``) the model
    has, with the shape it has there. A key mapped to None is skipped without being read (``report.skipped``); the
    others are collected into ``unexpected`` and ``wrong_shape`` for the caller's one refusal."""
    for file in files:
        with _open_tensors(file) as (keys, get_tensor):
            for key in keys:
                target = target_of(key)
                if target is None:
                    report.skipped.append(key)
                    continue
                if target not in shapes:
                    unexpected.append(key)
                    continue
                tensor = get_tensor(key)
                if tuple(tensor.shape) != shapes[target]:
                    wrong_shape.append(f"{key} {tuple(tensor.shape)} (config wants {shapes[target]})")
                    continue
                yield key, target, tensor


# The token and per-layer embedding tables: 2.75 B of Gemma-4-E2B's 4.63 B parameters.
EMBEDDING_TABLES = ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight")


def load_text_model(
    folder: str | Path,
    *,
    dtype: torch.dtype | None = torch.float32,
    allow_pickle: bool = False,
    tables_in_stored_dtype: bool = False,
    matrices_in_stored_dtype: bool = False,
) -> tuple[Gemma4ForCausalLM, LoadReport]:
    """Build a `Gemma4ForCausalLM` from a local checkpoint folder, reading only text-decoder tensors.

    Args:
        folder: a folder with ``config.json`` and safetensors weights (text-only or multimodal Gemma4).
        dtype: dtype of the loaded parameters; None keeps each tensor's stored dtype.
        allow_pickle: accept a checkpoint with only pickle ``.bin`` weights (loaded with ``weights_only=True``).
        tables_in_stored_dtype: keep the embedding tables (`EMBEDDING_TABLES`) in their stored dtype (bf16 in
            Google's checkpoints: 5.5 GB for E2B instead of 11 GB in fp32). For an exporter that replaces the
            lookups with quantized tables; the Hugging Face model's own forward then mixes dtypes and fails.
        matrices_in_stored_dtype: keep every 2-D tensor (linear weights, tables) in its stored dtype, backed by the
            checkpoint file's pages, for a quantized export that casts them in its graph (`weights.upcast_in_graph`):
            3.7 GB of bf16 for E2B's decoder instead of 7.4 GB of fp32.

    Returns:
        The model in eval mode, and a report of the tensors read and skipped.
    """
    folder = Path(folder)
    config = read_text_config(folder)
    config._attn_implementation = "eager"
    multimodal = _read_json(folder / "config.json")["model_type"] == "gemma4"
    files = _safetensors_files(folder, allow_pickle)
    try:
        with torch.device("meta"):
            model = Gemma4ForCausalLM(config)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as e:
        raise CheckpointError(
            f"The config of {folder} does not describe a buildable Gemma4 model ({type(e).__name__}: {e}); fix the "
            "value it names or download the model again"
        ) from None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = set(shapes)
    shared_layers = {i for i, mode in enumerate(config.kv_sharing_modes) if mode == "reuse"}
    report = LoadReport(files=[f.name for f in files])
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    wrong_shape: list[str] = []

    def target_of(key: str) -> str | None:
        target = _text_key(key, multimodal)
        m = _SHARED_KV_KEY.match(target or "")
        # Towers, and K/V weights that KV-shared layers carry in some checkpoints but never use.
        return None if m and int(m.group(1)) in shared_layers else target

    for key, target, tensor in _matching_tensors(files, target_of, shapes, report, unexpected, wrong_shape):
        keep = (
            dtype is None
            or not tensor.is_floating_point()
            or (tables_in_stored_dtype and target in EMBEDDING_TABLES)
            or (matrices_in_stored_dtype and tensor.dim() == 2)
        )
        state[target] = tensor if keep else tensor.to(dtype)
        report.read.append(key)
    tied = config.tie_word_embeddings
    if wrong_shape:
        raise CheckpointError(
            f"Checkpoint {folder}: {len(wrong_shape)} tensors do not have the shape its config.json gives "
            f"(e.g. {wrong_shape[:3]}); the config and the weights come from different models"
        )
    missing = sorted(expected - state.keys() - ({"lm_head.weight"} if tied else set()))
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {folder} does not match the Gemma4 text model of its config: "
            f"{len(missing)} missing (e.g. {missing[:5]}), {len(unexpected)} unexpected (e.g. {unexpected[:5]})"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _materialize_derived_buffers(model)
    logger.info("Loaded %d text tensors from %s; skipped %d", len(report.read), folder, len(report.skipped))
    return model.eval(), report


def _materialize_derived_buffers(model: Gemma4ForCausalLM) -> None:
    """Rebuild the non-persistent buffers (not in checkpoints) that the meta-device construction left empty."""
    text = model.model
    text.rotary_emb = hf.Gemma4TextRotaryEmbedding(model.config)
    for module in model.modules():
        if isinstance(module, hf.Gemma4TextScaledWordEmbedding):
            module.embed_scale = torch.tensor(module.scalar_embed_scale)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    left += [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"Tensors left uninitialised after loading: {left[:8]}")


ASSISTANT_MODEL_TYPES = ("gemma4_assistant",)


def read_assistant_config(folder: Path):
    """The `Gemma4AssistantConfig` of an assistant (MTP drafter) folder, made buildable by transformers 5.23.0
    (`assistant.buildable_assistant_config`)."""
    from transformers import Gemma4AssistantConfig

    from optimum_qnn.models.gemma4.assistant import buildable_assistant_config

    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"No config.json in {folder}: is this a Hugging Face model folder?")
    model_type = _read_json(config_path).get("model_type")
    if model_type not in ASSISTANT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"--assistant {folder} is not a Gemma 4 assistant (model_type {model_type!r}; expected one of: "
            f"{', '.join(ASSISTANT_MODEL_TYPES)}); pass the target's drafter, e.g. google/gemma-4-e2b-it-assistant"
        )
    try:
        config = Gemma4AssistantConfig.from_pretrained(folder)
    except Exception as e:  # transformers/huggingface_hub validators raise their own types
        raise CheckpointError(
            f"{config_path} is not a valid Gemma 4 assistant config ({type(e).__name__}: {e}); fix the value it names "
            "or download the assistant again"
        ) from None
    return buildable_assistant_config(config)


def load_assistant(folder: str | Path):
    """A `Gemma4AssistantForCausalLM` (fp32, eval) from a local folder; every weight must be there and fit.

    Raises:
        CheckpointError: missing, unexpected or misshapen tensors.
    """
    from transformers import Gemma4AssistantForCausalLM

    folder = Path(folder)
    config = read_assistant_config(folder)
    config.get_text_config()._attn_implementation = "eager"
    _safetensors_files(folder, allow_pickle=False)  # the same refusal of a folder without safetensors
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar: the export prints its own stage lines
    try:
        model, info = Gemma4AssistantForCausalLM.from_pretrained(
            folder, config=config, dtype=torch.float32, output_loading_info=True
        )
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise CheckpointError(
            f"Assistant {folder} does not match the model of its config: "
            + "; ".join(f"{len(v)} {k.replace('_', ' ')} (e.g. {sorted(map(str, v))[:3]})" for k, v in bad.items())
        )
    return model.eval()


# A multimodal checkpoint's vision tower and its projection into the text model (`load_vision_parts`).
VISION_PREFIXES = {"model.vision_tower.": "vision_tower.", "model.embed_vision.": "embed_vision."}


class VisionParts(torch.nn.Module):
    """``vision_tower`` (`Gemma4VisionModel`) and ``embed_vision`` (`Gemma4MultimodalEmbedder`), as
    `Gemma4Model` holds them, without the text decoder or the audio tower."""

    def __init__(self, config: Gemma4Config):
        super().__init__()
        self.config = config
        self.vision_tower = hf.Gemma4VisionModel(config.vision_config)
        self.embed_vision = hf.Gemma4MultimodalEmbedder(config.vision_config, config.get_text_config())


def read_vision_config(folder: Path) -> Gemma4Config:
    """The `Gemma4Config` of a checkpoint with a vision tower; any other is refused by name."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"No config.json in {folder}: is this a Hugging Face model folder?")
    raw = _read_json(config_path)
    if raw.get("model_type") != "gemma4" or not raw.get("vision_config"):
        raise UnsupportedModelError(
            f"{folder} has no vision tower (model_type {raw.get('model_type')!r}, vision_config "
            f"{'absent' if not raw.get('vision_config') else 'present'}): images need a multimodal Gemma 4 checkpoint "
            "(model_type 'gemma4' with a vision_config), e.g. google/gemma-4-e2b; export text generation instead"
        )
    read_text_config(Path(folder))  # the same checks of the text config as a text export
    try:
        return Gemma4Config.from_pretrained(folder)
    except Exception as e:  # transformers' validators raise their own types
        raise CheckpointError(f"{config_path} is not a valid Gemma4 config ({type(e).__name__}: {e})") from None


def load_vision_parts(folder: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[VisionParts, LoadReport]:
    """The vision tower and ``embed_vision`` of a multimodal Gemma 4 checkpoint folder, strictly: every tensor of
    the two is read with the shape its config gives, and nothing else under their prefixes is accepted.

    Args:
        folder: a folder with ``config.json`` (model_type ``gemma4`` with a ``vision_config``) and safetensors.
        dtype: dtype of the loaded floating tensors.

    Returns:
        The parts in eval mode, and a report of the tensors read and skipped (the text decoder's, the audio tower's).

    Raises:
        UnsupportedModelError: the checkpoint has no vision tower.
        CheckpointError: missing, unexpected or misshapen vision tensors.
    """
    folder = Path(folder)
    config = read_vision_config(folder)
    with torch.device("meta"):
        parts = VisionParts(config)
    shapes = {name: tuple(t.shape) for name, t in parts.state_dict().items()}
    report = LoadReport(files=[f.name for f in _safetensors_files(folder, allow_pickle=False)])
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    wrong_shape: list[str] = []

    def target_of(key: str) -> str | None:
        prefix = next((p for p in VISION_PREFIXES if key.startswith(p)), None)
        return None if prefix is None else VISION_PREFIXES[prefix] + key[len(prefix):]

    files = _safetensors_files(folder, allow_pickle=False)
    for key, target, tensor in _matching_tensors(files, target_of, shapes, report, unexpected, wrong_shape):
        state[target] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        report.read.append(key)
    missing = sorted(shapes.keys() - state.keys())
    if missing or unexpected or wrong_shape:
        raise CheckpointError(
            f"Checkpoint {folder} does not match the vision tower of its config: {len(missing)} missing (e.g. "
            f"{missing[:5]}), {len(unexpected)} unexpected (e.g. {unexpected[:5]}), {len(wrong_shape)} of another "
            f"shape (e.g. {wrong_shape[:3]}); the config and the weights come from different models"
        )
    parts.load_state_dict(state, strict=True, assign=True)
    # The rotary frequencies are derived, not stored: rebuilt from the config like the text decoder's.
    parts.vision_tower.encoder.rotary_emb = hf.Gemma4VisionRotaryEmbedding(config.vision_config)
    left = [n for n, t in [*parts.named_parameters(), *parts.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"Vision tensors left uninitialised after loading: {left[:8]}")
    logger.info("Loaded %d vision tensors from %s; skipped %d", len(report.read), folder, len(report.skipped))
    return parts.eval(), report
