"""Gemma 4's image processing in numpy and Pillow: what transformers' `Gemma4ImageProcessorPil` computes, without
transformers or torch, and the static vision encoder's data-dependent inputs derived from it.

Mirrors transformers 5.23.0 ``models/gemma4/image_processing_pil_gemma4.py`` (and the parts of
``image_processing_backends.PilBackend`` and ``image_transforms`` it calls): RGB conversion (transparency composited on
white), an aspect-ratio-preserving bicubic resize to a multiple of ``pooling_kernel_size * patch_size`` within the
budget's patch count, rescaling by 1/255 (float64, then float32), patchify, (x, y) patch positions, and padding to
the budget's static patch count (positions of padding are -1). The arrays are equal to Hugging Face's, not close.

The module is core, not runtime: the runtime preprocesses a user's image with it, and the exporter will calibrate the
encoder on photographs through the same code, which it may not import from the runtime wing.

Example:

```python
>>> from optimum_qnn.images import ImageGeometry, preprocess
>>> batch = preprocess(["cat.jpg"], ImageGeometry(soft_tokens=280))
>>> batch.pixel_values.shape, batch.image_position_ids.shape, batch.num_soft_tokens_per_image
((1, 2520, 768), (1, 2520, 2), [...])
```
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.ops.mask import MASK_MIN

logger = logging.getLogger(__name__)

# Hugging Face's budgets of soft tokens per image (`_SUPPORTED_SOFT_TOKENS` of the processor).
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

ImageSource = Union[str, Path, bytes, Image.Image]


class ImageInputError(InvalidInputError):
    """An image that cannot be read or processed (not an image, truncated, empty, a wrong type)."""


@dataclass(frozen=True)
class ImageGeometry:
    """How images become patches: the processor's ``patch_size``, ``pooling_kernel_size`` and ``max_soft_tokens``.

    One geometry is one static shape of the vision encoder: ``max_patches`` patches in, ``soft_tokens`` out.
    """

    soft_tokens: int = 280
    patch_size: int = 16
    pooling_kernel_size: int = 3

    def __post_init__(self) -> None:
        if self.soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(
                f"Unknown image budget {self.soft_tokens!r} soft tokens; expected one of: "
                f"{', '.join(map(str, SOFT_TOKEN_BUDGETS))}"
            )
        for name in ("patch_size", "pooling_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")

    @property
    def max_patches(self) -> int:
        """Patches per image in the static graph (2520 for 280 soft tokens)."""
        return self.soft_tokens * self.pooling_kernel_size**2

    @property
    def patch_pixels(self) -> int:
        """Values per patch: ``3 * patch_size**2`` (RGB, channels last inside a patch)."""
        return 3 * self.patch_size**2


@dataclass
class ImageBatch:
    """The processor's output, under Hugging Face's names.

    Attributes:
        pixel_values: ``[images, max_patches, 3 * patch_size**2]`` float32 in [0, 1]; padding patches are zeros.
        image_position_ids: ``[images, max_patches, 2]`` int64 (x, y) of each patch; padding is (-1, -1).
        num_soft_tokens_per_image: soft tokens each image yields (its placeholders in the prompt).
    """

    pixel_values: np.ndarray
    image_position_ids: np.ndarray
    num_soft_tokens_per_image: list[int]


def target_size(height: int, width: int, geometry: ImageGeometry) -> tuple[int, int]:
    """The (height, width) an image is resized to: the largest of its aspect ratio with at most
    ``geometry.max_patches`` patches and both sides multiples of ``pooling_kernel_size * patch_size``.

    A side that rounds to zero (a very thin image) becomes one multiple, and the other side the aspect ratio's
    floor in multiples, capped at the budget's longest side (Hugging Face's rule, kept as it is).
    """
    if height <= 0 or width <= 0:
        raise ImageInputError(f"An image of {width}x{height} pixels has no pixels; pass an image at least 1x1")
    patch, max_patches = geometry.patch_size, geometry.max_patches
    target_px = max_patches * patch**2
    factor = math.sqrt(target_px / (height * width))
    side = geometry.pooling_kernel_size * patch
    new_h = int(math.floor(factor * height / side)) * side
    new_w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // geometry.pooling_kernel_size**2) * side
    if new_h == 0:
        new_h, new_w = side, min(int(math.floor(width / height)) * side, longest)
    elif new_w == 0:
        new_w, new_h = side, min(int(math.floor(height / width)) * side, longest)
    if new_h * new_w > target_px:  # cannot happen with the budgets above; a wrong geometry would land here
        raise ImageInputError(f"Resizing {width}x{height} to {new_w}x{new_h} exceeds {max_patches} patches")
    return new_h, new_w


def open_image(source: ImageSource) -> Image.Image:
    """An image from a path, encoded bytes or a PIL image, fully decoded (a truncated file fails here).

    Files are turned upright by their EXIF orientation, as transformers' ``load_image`` does.

    Raises:
        ImageInputError: not an image, a truncated or empty file, or a type that is none of the above.
    """
    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (bytes, bytearray, memoryview)):
            name, stream = "the image bytes", io.BytesIO(bytes(source))
        elif isinstance(source, (str, Path)):
            name, stream = str(source), source
            if not Path(source).is_file():
                raise ImageInputError(f"No image file {source!r}: pass the path of a PNG, JPEG, WebP... file")
        else:
            raise ImageInputError(
                f"An image must be a path, encoded bytes or a PIL.Image.Image; got {type(source).__name__} "
                "(for an array, pass PIL.Image.fromarray(array))"
            )
        try:
            image = Image.open(stream)
            image.load()  # decode now: a truncated file raises here, not at the first pixel read
        except UnidentifiedImageError:
            raise ImageInputError(f"{name} is not an image Pillow can read (PNG, JPEG, WebP, GIF, BMP...)") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageInputError(f"{name} cannot be decoded ({e}): the file is truncated or corrupt") from None
        image = ImageOps.exif_transpose(image)
    if image.width <= 0 or image.height <= 0:
        raise ImageInputError(f"The image is empty ({image.width}x{image.height} pixels); pass an image at least 1x1")
    return image


def to_rgb(image: Image.Image) -> np.ndarray:
    """``[3, H, W]`` uint8: transparency (an alpha band or a palette's transparent colour) composited on white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.moveaxis(np.asarray(image.convert("RGB")), -1, 0)


def resize(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """``chw`` (uint8 ``[3, H, W]``) resized with Pillow's bicubic filter; unchanged when already that size."""
    if chw.shape[1:] == (height, width):
        return chw
    resized = Image.fromarray(np.moveaxis(chw, 0, -1)).resize((width, height), resample=Image.Resampling.BICUBIC)
    return np.moveaxis(np.asarray(resized), -1, 0)


def patchify(chw: np.ndarray, patch_size: int) -> np.ndarray:
    """``[C, H, W]`` -> ``[H/p * W/p, p * p * C]``: patches in row-major order, each patch's pixels row by row with
    their channels last."""
    c, h, w = chw.shape
    patches = chw.reshape(c, h // patch_size, patch_size, w // patch_size, patch_size).transpose(1, 3, 2, 4, 0)
    return patches.reshape((h // patch_size) * (w // patch_size), -1)


def patch_positions(height: int, width: int, patch_size: int) -> np.ndarray:
    """``[patches, 2]`` int64: the (x, y) patch coordinates in the order :func:`patchify` lays patches out."""
    grid_x, grid_y = np.meshgrid(np.arange(width // patch_size), np.arange(height // patch_size), indexing="xy")
    return np.stack([grid_x, grid_y], axis=-1).reshape(-1, 2)


def process_one(source: ImageSource, geometry: ImageGeometry) -> tuple[np.ndarray, np.ndarray, int]:
    """One image's ``(pixel_values [max_patches, patch_pixels], positions [max_patches, 2], soft_tokens)``."""
    chw = to_rgb(open_image(source))
    height, width = target_size(chw.shape[1], chw.shape[2], geometry)
    chw = resize(chw, height, width)
    pixels = (chw.astype(np.float64) * (1 / 255)).astype(np.float32)  # HF's rescale: float64 product, then float32
    patches = patchify(pixels, geometry.patch_size)
    positions = patch_positions(height, width, geometry.patch_size)
    pad = geometry.max_patches - patches.shape[0]
    patches = np.pad(patches, ((0, pad), (0, 0)))
    positions = np.pad(positions, ((0, pad), (0, 0)), constant_values=-1)
    return patches, positions, (height // geometry.patch_size) * (width // geometry.patch_size) // geometry.pooling_kernel_size**2


def preprocess(images: ImageSource | list[ImageSource], geometry: ImageGeometry) -> ImageBatch:
    """Images as the Gemma 4 vision encoder takes them: transformers' ``Gemma4ImageProcessorPil`` output.

    Args:
        images: one image or a list: paths, encoded bytes or PIL images (any mode; transparency goes on white).
        geometry: the budget (soft tokens per image) and the model's patch and pooling sizes.

    Returns:
        An `ImageBatch` with ``pixel_values``, ``image_position_ids`` and ``num_soft_tokens_per_image``.
    """
    items = images if isinstance(images, list) else [images]
    if not items:
        raise ImageInputError("No images given; pass at least one image")
    rows = [process_one(item, geometry) for item in items]
    return ImageBatch(
        pixel_values=np.stack([r[0] for r in rows]),
        image_position_ids=np.stack([r[1] for r in rows]),
        num_soft_tokens_per_image=[r[2] for r in rows],
    )


@dataclass
class EncoderInputs:
    """The static vision encoder's inputs for one image: everything that depends on the image's shape, computed here
    so the graph has none of it.

    Attributes:
        pixel_values: ``[1, max_patches, patch_pixels]`` float32, as the processor gives them.
        position_x: ``[1, max_patches]`` int32 column of each patch (padding: 0; its embedding is zeroed).
        position_y: ``[1, max_patches]`` int32 row of each patch (padding: 0).
        valid: ``[1, max_patches, 1]`` float32, 1 for a patch of the image, 0 for padding.
        attention_mask: ``[1, 1, 1, max_patches]`` float32 additive mask over keys: 0 for patches, ``MASK_MIN``
            for padding (every query, padding's too, reads the image's patches only, as Hugging Face's
            bidirectional mask does).
        pooling: ``[1, soft_tokens, max_patches]`` float32: row t averages the ``k x k`` patches of soft token t
            (weights ``1/k**2``); rows past the image's soft tokens are zero.
        num_soft_tokens: the image's soft tokens: the encoder's first rows; the rest is padding to drop.
    """

    pixel_values: np.ndarray
    position_x: np.ndarray
    position_y: np.ndarray
    valid: np.ndarray
    attention_mask: np.ndarray
    pooling: np.ndarray
    num_soft_tokens: int

    def as_tuple(self) -> tuple[np.ndarray, ...]:
        """The graph's inputs in order (`pixel_values`, `position_x`, `position_y`, `valid`, `attention_mask`,
        `pooling`)."""
        return (self.pixel_values, self.position_x, self.position_y, self.valid, self.attention_mask, self.pooling)


def encoder_inputs(pixel_values: np.ndarray, image_position_ids: np.ndarray, geometry: ImageGeometry) -> EncoderInputs:
    """The static encoder's inputs for one image from the processor's ``pixel_values`` ``[P, patch_pixels]`` and
    ``image_position_ids`` ``[P, 2]`` (one row of an `ImageBatch`, or of Hugging Face's output).

    The pooling matrix reproduces ``Gemma4VisionPooler._avg_pool_by_positions`` (transformers 5.23.0): patch (x, y)
    goes to soft token ``x // k + (width // k) * (y // k)`` where ``width`` is the image's patch columns (the largest
    x plus one), each with weight ``1 / k**2``. Padding patches are zero before pooling in Hugging Face's encoder, so
    their weights here are zero too.
    """
    pixel_values = np.asarray(pixel_values, dtype=np.float32)
    positions = np.asarray(image_position_ids)
    expected = (geometry.max_patches, geometry.patch_pixels)
    if pixel_values.shape != expected or positions.shape != (geometry.max_patches, 2):
        raise ImageInputError(
            f"pixel_values {pixel_values.shape} and image_position_ids {positions.shape} do not fit the encoder's "
            f"budget of {geometry.soft_tokens} soft tokens (expected {expected} and ({geometry.max_patches}, 2)); "
            f"process the image with max_soft_tokens={geometry.soft_tokens}"
        )
    padding = (positions == -1).all(axis=-1)
    real = ~padding
    k = geometry.pooling_kernel_size
    clamped = np.clip(positions, 0, None)
    columns = int(clamped[:, 0].max()) + 1
    token = clamped[:, 0] // k + (columns // k) * (clamped[:, 1] // k)
    pooling = np.zeros((geometry.soft_tokens, geometry.max_patches), dtype=np.float32)
    pooling[token[real], np.flatnonzero(real)] = 1.0 / k**2
    num_soft = int(real.sum()) // k**2
    # Fresh C-ordered copies: a `[None]` view has stride 0 on its new axis, which ExecuTorch refuses in an input
    # ("0 in strides is not supported").
    return EncoderInputs(
        pixel_values=np.array(pixel_values[None], order="C"),
        position_x=np.array(clamped[None, :, 0], dtype=np.int32, order="C"),
        position_y=np.array(clamped[None, :, 1], dtype=np.int32, order="C"),
        valid=np.array(real[None, :, None], dtype=np.float32, order="C"),
        attention_mask=np.array(np.where(real, 0.0, MASK_MIN)[None, None, None, :], dtype=np.float32, order="C"),
        pooling=np.array(pooling[None], order="C"),
        num_soft_tokens=num_soft,
    )
