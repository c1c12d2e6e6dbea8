"""Calibration samples with images, for a quantized image variant (``--task image-text-to-text --quant 16a8w``).

The decoder's prefill reads an image's soft tokens in place of the placeholders' embeddings, so its activation ranges
must be observed on prompts that hold images: each sample here is a calibration text with one image's block (BOI, its
soft tokens' placeholders, EOI) after BOS, the soft tokens computed by the float vision encoder of the export
(`VisionExport.encoder`) from images processed as the host processes them (`optimum_qnn.images`). The encoder itself
stays in float and is compiled at HTP fp16.

The images are photographs, never noise: `calibration_photos`, the ones scikit-image's wheel ships in
``skimage/data`` (a registry package of the export install; read as files, scikit-image is not imported).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.session import SoftTokens

# The calibration photographs, of scikit-image's ``skimage/data``: a portrait, a still life, a vehicle, a launch.
# Others there (chelsea.png, the cat; hubble_deep_field.jpg; grass.png; retina.jpg) stay held out for the checks.
CALIBRATION_PHOTOS = ("astronaut.png", "coffee.png", "motorcycle_left.png", "rocket.jpg")


def photos_folder() -> Path:
    """scikit-image's ``skimage/data`` folder, found without importing scikit-image.

    Raises:
        OptimumQnnError: scikit-image is not installed (it comes with ``optimum-qnn[export]``).
    """
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise OptimumQnnError("A quantized image variant is calibrated on scikit-image's photographs, and "
                              "scikit-image is not installed: pip install 'optimum-qnn[export]' (or scikit-image)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def calibration_photos() -> list[Path]:
    """The paths of `CALIBRATION_PHOTOS`."""
    folder = photos_folder()
    missing = [name for name in CALIBRATION_PHOTOS if not (folder / name).is_file()]
    if missing:
        raise OptimumQnnError(f"scikit-image's data folder {folder} lacks {', '.join(missing)}: reinstall "
                              "scikit-image (its wheel ships them)")
    return [folder / name for name in CALIBRATION_PHOTOS]


def image_samples(vision: Any, seqs: Sequence[Sequence[int]], images: Sequence[Any], bos_id: int | None,
                  context_len: int) -> list[tuple[list[int], SoftTokens]]:
    """One prefill sample per image: BOS, the image's block, then the text of a calibration sequence (in turn),
    cut to ``context_len``; with the image's soft tokens from the float encoder at the placeholders.

    Args:
        vision: the export's `VisionExport` (its float encoder, geometry and placeholder ids).
        seqs: the text calibration samples' ids (BOS first where the model has one).
        images: the calibration images (paths, bytes or PIL images).
        bos_id: the model's BOS id, or None.
        context_len: the variant's context.
    """
    import torch

    from optimum_qnn.images import encoder_inputs, preprocess

    info, geometry = vision.info, vision.geometry
    batch = preprocess(list(images), geometry)
    samples = []
    for i, (pixels, positions) in enumerate(zip(batch.pixel_values, batch.image_position_ids)):
        inputs = encoder_inputs(pixels, positions, geometry)
        with torch.no_grad():
            out = vision.encoder(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs.as_tuple()))
        soft = out[0, : inputs.num_soft_tokens].float().numpy()
        text = list(seqs[i % len(seqs)]) if seqs else []
        if text and bos_id is not None and text[0] == bos_id:
            text = text[1:]
        head = [] if bos_id is None else [bos_id]
        block = [info.boi_token_id, *[info.pad_token_id] * len(soft), info.eoi_token_id]
        ids = (head + block + text)[:context_len]
        embeds = np.zeros((len(ids), soft.shape[1]), dtype=np.float32)
        mask = np.zeros(len(ids), dtype=bool)
        start = len(head) + 1
        mask[start: start + len(soft)] = True
        embeds[start: start + len(soft)] = soft
        samples.append((ids, SoftTokens(embeds, mask)))
    return samples
