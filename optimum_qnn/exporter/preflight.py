"""Checks that run before an export does any long work: the arguments, the checkpoint folder (config, file headers,
tokenizer), the calibration and evaluation text, and the user's patterns against the swapped model.

A mistake found here costs the user a second; found by the pipeline it would cost the load, the calibration or the
lowering first. Every refusal is an `OptimumQnnError` that says what to do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from optimum_qnn.quantization.calibration import CalibrationSource, check_text_file
from optimum_qnn.config import DEFAULT_CONTEXT, EmbeddingQuant, ExportConfig, ExportMode
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.memory import MemoryPlan, choose_memory_plan
from optimum_qnn.exporter.parameters import ParameterCounts
from optimum_qnn.models.gemma4.loading import CheckpointError, check_checkpoint, read_text_config

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)
stage_logger = logging.getLogger("optimum_qnn.stages")  # shown without -v


def check_arguments(model, output, config, revision, calibration, evaluate, evaluate_tokens, assistant=None) -> None:
    """The Python API's arguments, checked with the CLI's messages (wrong types included)."""
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise InvalidInputError(f"model must be a Hub id or a folder path; got {model!r}")
    if not isinstance(output, (str, os.PathLike)) or not str(output).strip():
        raise InvalidInputError(f"output must be a folder path; got {output!r}")
    if not isinstance(config, ExportConfig):
        raise InvalidInputError(f"config must be an ExportConfig; got {type(config).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise InvalidInputError(f"revision must be a string (branch, tag or commit); got {revision!r}")
    if calibration is not None and not isinstance(calibration, CalibrationSource):
        raise InvalidInputError(f"calibration must be a CalibrationSource; got {type(calibration).__name__}")
    if evaluate is not None and not isinstance(evaluate, (str, os.PathLike)):
        raise InvalidInputError(f"evaluate must be a text file path; got {evaluate!r}")
    if assistant is not None and (not isinstance(assistant, (str, os.PathLike)) or not str(assistant).strip()):
        raise InvalidInputError(f"assistant must be a Hub id or a folder path; got {assistant!r}")
    if assistant is None and getattr(config, "draft_len", None) is not None:
        raise InvalidInputError(f"--draft-len {config.draft_len} sets how many tokens Gemma 4's assistant drafts a "
                                "round; it needs --assistant REPO_OR_DIR (add it, or drop --draft-len)")
    check_draft_len(config)
    if isinstance(evaluate_tokens, bool) or not isinstance(evaluate_tokens, int) or evaluate_tokens < 1:
        raise InvalidInputError(f"--evaluate-tokens must be a positive integer; got {evaluate_tokens!r}")


def check_draft_len(config: ExportConfig) -> None:
    """An assistant's K: a positive integer, in hybrid mode, its verify call of K + 1 tokens below the context and
    not the prefill call's length (that graph keeps its in-graph window band; the verify graph's mask has none)."""
    k, shapes = config.draft_len, config.shapes
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidInputError(f"--draft-len must be an integer >= 1; got {k!r}")
    if config.mode is not ExportMode.HYBRID:
        raise InvalidInputError(f"--assistant builds on the hybrid mode (prefill + a verify call of K + 1 tokens); "
                                f"not --mode {config.mode.value}: drop --mode")
    if k + 1 >= shapes.prefill_ar_len or (shapes.max_seq_len is not None and k + 1 >= shapes.max_seq_len):
        raise InvalidInputError(
            f"--draft-len {k} verifies {k + 1} tokens a call, which must be fewer than --prefill-ar-len "
            f"({shapes.prefill_ar_len}) and --max-seq-len ({shapes.max_seq_len}): lower --draft-len")


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (what creating ``path`` would add), or None."""
    path = Path(os.path.abspath(path))
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def source_model_id(model: str, folder: Path) -> str:
    """What the manifest records as the source model: the Hub id, never a local absolute path (it leaks the
    user's directory layout and means nothing elsewhere). A local folder is recorded by its name, or as the Hub
    id of the Hugging Face cache entry it is a snapshot of (``models--org--name/snapshots/<sha>``)."""
    if not Path(model).expanduser().is_dir():
        return model
    resolved = Path(os.path.abspath(Path(model).expanduser()))
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name[len("models--"):].replace("--", "/")
    return resolved.name


def preflight(model: str, folder: Path, config: ExportConfig, revision: str | None, calibration: CalibrationSource,
              allow_pickle: bool, evaluate: Path | None, *, assistant: str | None = None,
              ) -> tuple[object, ExportConfig, MemoryPlan]:
    """Every check that needs the checkpoint folder but not its tensors. Returns the tokenizer (or None), the
    config with its embedding quantization and shard count resolved, and the memory plan (estimates) behind them."""
    if revision is not None and Path(model).expanduser().is_dir():
        raise InvalidInputError(f"--revision {revision!r} selects a Hub revision, but {model} is a local folder; drop --revision")
    text_config = read_text_config(folder)
    if config.image_tokens is not None:  # a checkpoint without a vision tower is refused by name, before any weight
        from optimum_qnn.models.gemma4.loading import read_vision_config

        read_vision_config(folder)
    max_pos = text_config.max_position_embeddings
    if config.shapes.max_seq_len is None:
        config = choose_context(text_config, config)
    elif config.shapes.max_seq_len > max_pos:
        raise InvalidInputError(
            f"--max-seq-len {config.shapes.max_seq_len} exceeds the model's max_position_embeddings ({max_pos}); "
            f"choose at most {max_pos}"
        )
    config.check_shards(text_config.num_hidden_layers)  # a bad --shards fails here
    config = check_cache_layout(text_config, config)
    if assistant is not None:
        check_assistant(assistant, model, text_config)
    widths = (text_config.hidden_size,)
    if text_config.hidden_size_per_layer_input:
        widths += (text_config.num_hidden_layers * text_config.hidden_size_per_layer_input,)
    if config.embedding_quant is None:
        config = dataclasses.replace(config, embedding_quant=EmbeddingQuant.default_for(config.quant, widths))
        logger.info("Embedding tables: %s (tables %s wide)", config.embedding_quant, " and ".join(map(str, widths)))
    else:
        config.embedding_quant.check_widths(widths)
    # From the config alone, before the weight files are even opened: an export that cannot fit stops here.
    plan = choose_memory_plan(ParameterCounts.from_config(text_config), config, evaluate=evaluate is not None)
    config = dataclasses.replace(config, shards=plan.estimate.shards)
    check_checkpoint(folder, allow_pickle=allow_pickle)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None and config.quant.is_quantized and calibration.file is not None:
        raise InvalidInputError(
            f"{folder} has no tokenizer, so the calibration text cannot be tokenized; add the model's tokenizer "
            "files to the folder, or drop --calib-file to calibrate on random token ids"
        )
    if tokenizer is None and evaluate is not None:
        raise InvalidInputError("--evaluate needs the model's tokenizer, and the model folder has none")
    return tokenizer, config, plan


def choose_context(text_config, config: ExportConfig) -> ExportConfig:
    """The config with its context chosen (no --max-seq-len): `DEFAULT_CONTEXT`, or the model's
    max_position_embeddings, or the largest context every target SoC compiles with this cache layout and IO
    (`htp_limits.largest_context`), whichever is smallest; one line says which and why."""
    from optimum_qnn.exporter.htp_limits import largest_compiling_context

    choices = {DEFAULT_CONTEXT: "the default (pass --max-seq-len for another)",
               text_config.max_position_embeddings: "the model's max_position_embeddings"}
    compiles = largest_compiling_context(*_cache_layers(text_config), config)
    if compiles is not None:
        choices.setdefault(compiles, "the largest context the target's HTP compiles with uint16 caches "
                                     "(--float-io or --cache-layout ring allow more)")
    context = min(choices)
    ar = config.shapes.prefill_ar_len
    if config.mode.has_prefill and ar >= context:
        raise InvalidInputError(
            f"--prefill-ar-len {ar} needs a longer context than this model allows ({context}: {choices[context]}); "
            f"pass a smaller --prefill-ar-len"
        )
    stage_logger.info("Context: %d tokens (%s)", context, choices[context])
    return dataclasses.replace(config, shapes=dataclasses.replace(config.shapes, max_seq_len=context))


def _cache_layers(text_config) -> tuple:
    """The model's layers as the cache rules see them, and its sliding window (None without sliding layers)."""
    from optimum_qnn.models.gemma4.modules import gemma4_layer_specs

    window = text_config.sliding_window if "sliding_attention" in text_config.layer_types else None
    return gemma4_layer_specs(text_config), window


def check_cache_layout(text_config, config: ExportConfig) -> ExportConfig:
    """The caches this export makes, from the config alone: the layout chosen where none was given (full, or blocks
    where the full layout cannot compile), a ring that cannot help, blocks that differ between methods, and a cache
    tensor larger than a target SoC's VTCM (`htp_limits.choose_layout`: QNN would refuse it after the whole load,
    calibration and compile). Returns the config with its layout and block length resolved."""
    from optimum_qnn.contract import DECODE_METHOD, PREFILL_METHOD, check_ring, check_same_blocks
    from optimum_qnn.exporter.htp_limits import call_lengths, choose_layout

    layers, window = _cache_layers(text_config)
    config = choose_layout(layers, window, config)
    shapes = config.shapes
    try:
        check_ring(shapes.cache_layout, layers, shapes.max_seq_len, window)
        calls = dict(zip((DECODE_METHOD, PREFILL_METHOD), call_lengths(config)))  # call_lengths: decode first
        check_same_blocks(shapes.max_seq_len, calls, shapes.cache_block_len)
    except ValueError as e:
        raise InvalidInputError(f"--cache-layout {shapes.cache_layout.value}: {e}") from None
    return config


def read_texts(config: ExportConfig, calibration: CalibrationSource, evaluate: Path | None) -> list[str] | None:
    """Check the text files (and that this host can evaluate) before the model is even looked for; returns the
    calibration texts of a quantized export."""
    if evaluate is not None:
        check_can_evaluate(evaluate, config)
        check_text_file(evaluate, "Evaluation text")
    return calibration.texts() if config.quant.is_quantized else None


def check_overrides_match(module: torch.nn.Module, config: ExportConfig) -> None:
    """A --quant-override that matches no module would silently change nothing: refuse it, naming real paths."""
    if not config.overrides:
        return
    names = [name for name, _ in module.named_modules() if name]
    for pattern, scheme in config.overrides:
        if not any(re.search(pattern, name) for name in names):
            examples = ", ".join(n for n in names if n.endswith(("lm_head", "layers.0.self_attn.q_proj", "layers.0.mlp")))
            raise InvalidInputError(
                f"--quant-override {pattern}={scheme.value} matches no module of this model; module paths look like: "
                f"{examples}"
            )


def check_can_evaluate(text_file: Path, config: ExportConfig) -> None:
    from optimum_qnn.errors import InvalidInputError
    from optimum_qnn.program import host_can_run

    if not text_file.is_file():
        raise InvalidInputError(f"Evaluation text file {text_file} does not exist")
    if not host_can_run(config.weight_sharing and config.mode.has_prefill):
        raise InvalidInputError(
            "--evaluate runs the .pte on the x86 HTP emulator, which cannot load a hybrid .pte with shared weights: "
            "add --no-weight-sharing, or evaluate on a Snapdragon host"
        )


def load_tokenizer(folder: Path):
    """The checkpoint's tokenizer, or None when it has none. A tokenizer that is there but cannot be read is an
    error: it would be copied into the artifact and break every runner."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.warning("No tokenizer in %s; calibration uses random token ids", folder)
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer("a", add_special_tokens=False)
        return tokenizer
    except Exception as e:  # tokenizers raises bare Exception subclasses on a corrupt tokenizer.json
        raise CheckpointError(
            f"The tokenizer in {folder} cannot be read ({type(e).__name__}: {str(e)[:200]}): a tokenizer file is corrupt "
            "or an incomplete download. Download the model again, or remove the tokenizer files to export without one"
        ) from None


def check_assistant(assistant: str, model: str, text_config) -> Path:
    """``--assistant``, from its config alone, before the target's weights are read: a Gemma 4 assistant whose
    vocabulary, width and attention heads fit the target (`assistant.check_assistant_ties`). Returns its folder (a
    Hub assistant is read at its default branch: ``--revision`` is the target's)."""
    from optimum_qnn.artifacts.hub import resolve_model_folder
    from optimum_qnn.models.gemma4.assistant import check_assistant_ties
    from optimum_qnn.models.gemma4.loading import read_assistant_config

    folder = resolve_model_folder(assistant)
    check_assistant_ties(read_assistant_config(folder), text_config, assistant_name=assistant, target_name=model)
    return folder
