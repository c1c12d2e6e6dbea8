"""An image variant's soft tokens within one prompt: the ids the decoder reads and the `SoftTokens` at the image
placeholders (`QNNModelForImageTextToText`; runtime code, numpy only)."""

from __future__ import annotations

from typing import Any

import numpy as np

from optimum_qnn.contract import PREFILL_METHOD
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.ops.arrays import as_numpy
from optimum_qnn.session import SoftTokens


def soft_tokens_of(model: Any, prompt: np.ndarray, features: Any) -> tuple[np.ndarray, SoftTokens]:
    """The ids the decoder reads (the pad id at each image placeholder) and the soft tokens at those places.

    ``features``: one row's soft tokens, as `QNNModelForImageTextToText.generate` hands them (a list of one array
    when they come through `hf_generate`'s row inputs)."""
    info = model.manifest.contract.images
    if info is None:
        raise InvalidInputError(f"Variant {model.variant.name} takes no images: export with --task image-text-to-text")
    if isinstance(features, (list, tuple)):
        (features,) = features
    features = np.asarray(as_numpy(features), dtype=np.float32)
    mask = prompt == info.image_token_id
    if int(mask.sum()) != len(features):
        raise InvalidInputError(f"The prompt holds {int(mask.sum())} image placeholders and {len(features)} soft tokens "
                                "were given for it")
    width = model.contract.method(PREFILL_METHOD).image_width
    embeds = np.zeros((prompt.size, width), dtype=np.float32)
    if len(features):
        embeds[mask] = features
    return np.where(mask, info.pad_token_id, prompt), SoftTokens(embeds, mask)
