"""Calibration samples with images, for a quantized image variant (``--task image-text-to-text --quant 16a8w``).

The decoder's prefill reads an image's soft tokens in place of the placeholders' embeddings, so its activation ranges
must be observed on prompts that hold images: each sample here is a calibration text with one image's block (BOI, its
soft tokens' placeholders, EOI) after BOS, the soft tokens computed by the float vision encoder of the export
(`VisionExport.encoder`) from images processed as the host processes them (`optimum_qnn.images`). The encoder itself
stays in float and is compiled at HTP fp16.

Without images from the user the samples use `synthetic_images`: smooth colour fields with soft shapes and fine
noise at several sizes and aspect ratios, deterministic, so an export repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from optimum_qnn.session import SoftTokens

# Built-in calibration images when none are given (each one image sample).
DEFAULT_IMAGE_SAMPLES = 4
_SIZES = ((640, 480), (480, 640), (800, 300), (256, 256), (1024, 768), (300, 900))


def synthetic_images(count: int = DEFAULT_IMAGE_SAMPLES, seed: int = 0) -> list[Any]:
    """``count`` photo-like RGB images: a low-frequency colour field (bilinearly upsampled noise), a few soft-edged
    discs and rectangles in other colours, and pixel noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        width, height = _SIZES[i % len(_SIZES)]
        coarse = Image.fromarray(rng.integers(0, 256, size=(4 + i % 3, 5 + i % 4, 3), dtype=np.uint8), "RGB")
        field = np.asarray(coarse.resize((width, height), Image.BILINEAR), dtype=np.float32)
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        for _ in range(3 + i % 3):
            cx, cy = rng.uniform(0, width), rng.uniform(0, height)
            radius = rng.uniform(0.05, 0.3) * min(width, height)
            inside = np.clip(radius - np.hypot(x - cx, y - cy), 0, 4)[..., None] / 4  # a soft edge of 4 pixels
            field = field * (1 - inside) + rng.uniform(0, 255, size=3) * inside
        noisy = field + rng.normal(0, 6, size=field.shape)
        images.append(Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB"))
    return images


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
