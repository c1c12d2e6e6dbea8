"""The vision encoder of an image variant (``--task image-text-to-text``): Gemma 4's vision tower and ``embed_vision``
read strictly from the checkpoint (`loading.load_vision_parts`), swapped into their static twin
(`models.gemma4.vision.StaticImageEncoder`, one static patch count per budget of soft tokens), exported as the
program's method `VISION_METHOD` beside the decoder, whose prefill method takes the soft tokens (`IMAGE_INPUTS`).

What depends on the image's size (resize, patches, positions, padding, the pooling matrix) is the host's, in numpy
(`optimum_qnn.images`); the manifest's `ImagesInfo` says what the host needs to build those inputs and the prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optimum_qnn.artifacts.manifest import ImagesInfo
from optimum_qnn.contract import MethodSpec, RunnerContract, TensorSpec
from optimum_qnn.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

# The vision encoder's method in the program (its IO: `models.gemma4.vision.ENCODER_INPUTS`, then `ENCODER_OUTPUT`).
VISION_METHOD = "vision_encoder"


@dataclass
class VisionExport:
    """The static encoder of one image budget, its method's IO, and the manifest's record of it."""

    encoder: torch.nn.Module
    method: MethodSpec
    info: ImagesInfo
    geometry: Any  # `images.ImageGeometry`: the budget and the patch and pooling sizes

    @classmethod
    def load(cls, folder: Path, soft_tokens: int, pad_token_id: int | None) -> "VisionExport":
        """The encoder of the checkpoint in ``folder`` at ``soft_tokens`` per image.

        Raises:
            UnsupportedModelError: no vision tower, or no placeholder ids in the checkpoint's config.
            CheckpointError: missing, unexpected or misshapen vision tensors.
        """
        from optimum_qnn.models.gemma4.loading import load_vision_parts
        from optimum_qnn.models.gemma4.vision import ENCODER_INPUTS, ENCODER_OUTPUT, StaticImageEncoder, geometry_of

        parts, report = load_vision_parts(folder)
        config = parts.config
        ids = {name: getattr(config, name, None) for name in ("image_token_id", "boi_token_id", "eoi_token_id")}
        missing = [name for name, value in ids.items() if value is None]
        if missing or pad_token_id is None:
            raise UnsupportedModelError(
                f"{folder}'s config.json has no {', '.join(missing or ['text_config.pad_token_id'])}: an image prompt "
                "needs Gemma 4's image placeholder ids"
            )
        geometry = geometry_of(config.vision_config, soft_tokens)
        encoder, _ = StaticImageEncoder.from_hf(parts, geometry)
        examples = encoder.example_inputs()
        with torch.no_grad():
            out = encoder(*examples)
        method = MethodSpec(
            VISION_METHOD, soft_tokens,
            tuple(TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in zip(ENCODER_INPUTS, examples)),
            (TensorSpec(ENCODER_OUTPUT, tuple(out.shape), "float32"),),
        )
        info = ImagesInfo(method=VISION_METHOD, soft_tokens=soft_tokens, patch_size=geometry.patch_size,
                          pooling_kernel_size=geometry.pooling_kernel_size, pad_token_id=int(pad_token_id),
                          **{name: int(value) for name, value in ids.items()})
        logger.info("Vision encoder: %d soft tokens an image (%d patches), %d tensors read", soft_tokens,
                    geometry.max_patches, len(report.read))
        return cls(encoder, method, info, geometry)

    def export(self) -> tuple[tuple[torch.Tensor, ...], torch.export.ExportedProgram]:
        """The example inputs and the exported graph of the encoder (static shapes)."""
        examples = self.encoder.example_inputs()
        return examples, torch.export.export(self.encoder, examples, strict=False)


def with_vision(contract: RunnerContract, vision: VisionExport | None) -> RunnerContract:
    """``contract`` with the encoder's method after the decoder's (unchanged without ``vision``)."""
    if vision is None:
        return contract
    return dataclasses.replace(contract, methods=(*contract.methods, vision.method))
