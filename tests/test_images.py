"""optimum_qnn.images against transformers 5.23.0's `Gemma4ImageProcessorPil`: equal arrays (not close) on many sizes,
aspect ratios and modes, for every budget; the static encoder's pooling matrix against Hugging Face's pooler."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionPooler

from optimum_qnn.images import (
    SOFT_TOKEN_BUDGETS,
    ImageGeometry,
    ImageInputError,
    encoder_inputs,
    open_image,
    preprocess,
    target_size,
)

# (width, height): tiny ones, thin ones both ways, odd sizes, already-fitting ones, large ones.
SIZES = [(1, 1), (2, 3), (3, 500), (500, 3), (1, 700), (37, 91), (91, 37), (48, 48), (333, 333), (640, 480),
         (480, 640), (1023, 77), (1920, 1080), (768, 768)]


def photo_like(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A smooth gradient with noise, so the bicubic resize has edges and flats to get right."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255) // max(width, 1), (y * 255) // max(height, 1), ((x + y) * 7) % 256], axis=-1)
    noisy = np.clip(base + rng.integers(-40, 40, size=base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGB")
    if mode == "RGBA":
        alpha = rng.integers(0, 256, size=(height, width), dtype=np.uint8)
        image = Image.fromarray(np.concatenate([noisy, alpha[..., None]], axis=-1), "RGBA")
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def hf_processor(soft_tokens: int) -> Gemma4ImageProcessorPil:
    return Gemma4ImageProcessorPil(max_soft_tokens=soft_tokens)


def assert_equal_to_hf(images: list, soft_tokens: int) -> None:
    ours = preprocess(images, ImageGeometry(soft_tokens=soft_tokens))
    theirs = hf_processor(soft_tokens)(images=images, return_tensors="np")
    assert ours.pixel_values.dtype == theirs["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, theirs["pixel_values"])
    np.testing.assert_array_equal(ours.image_position_ids, theirs["image_position_ids"])
    assert ours.image_position_ids.dtype == theirs["image_position_ids"].dtype
    assert ours.num_soft_tokens_per_image == list(theirs["num_soft_tokens_per_image"])


@pytest.mark.parametrize("soft_tokens", SOFT_TOKEN_BUDGETS)
def test_every_size_equals_hugging_face(soft_tokens):
    assert_equal_to_hf([photo_like(w, h, seed=i) for i, (w, h) in enumerate(SIZES)], soft_tokens)


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA", "P", "I;16", "CMYK", "1"])
def test_every_mode_equals_hugging_face(mode):
    images = [photo_like(w, h, mode, seed=i) for i, (w, h) in enumerate([(1, 1), (3, 500), (61, 45), (300, 200)])]
    assert_equal_to_hf(images, 280)


def test_a_palette_with_a_transparent_colour_goes_on_white_as_in_hugging_face():
    image = photo_like(40, 30).convert("P")
    image.info["transparency"] = 0
    assert_equal_to_hf([image], 70)
    rgb = preprocess(image, ImageGeometry(soft_tokens=70))
    assert rgb.pixel_values.max() == 1.0  # some pixels of colour 0 became white


def test_files_and_bytes_read_as_the_decoded_image(tmp_path):
    image = photo_like(123, 45, "RGBA")
    path = tmp_path / "x.png"
    image.save(path)
    data = path.read_bytes()
    geometry = ImageGeometry(soft_tokens=140)
    expected = preprocess(image, geometry).pixel_values
    np.testing.assert_array_equal(preprocess(str(path), geometry).pixel_values, expected)
    np.testing.assert_array_equal(preprocess(data, geometry).pixel_values, expected)


def test_target_sizes_fit_the_budget_and_the_pooling_grid():
    for soft in SOFT_TOKEN_BUDGETS:
        geometry = ImageGeometry(soft_tokens=soft)
        for w, h in SIZES:
            th, tw = target_size(h, w, geometry)
            assert th % 48 == 0 and tw % 48 == 0 and th * tw <= geometry.max_patches * 256, (soft, w, h, th, tw)


@pytest.mark.parametrize("soft_tokens", [70, 280])
def test_the_pooling_matrix_is_hugging_faces_pooler(soft_tokens):
    """Pooling the identity through Hugging Face's pooler gives its weights (times sqrt(hidden)); ours must be them,
    padding columns zero and rows past the image's soft tokens zero."""
    geometry = ImageGeometry(soft_tokens=soft_tokens)
    images = [photo_like(w, h) for w, h in [(3, 500), (640, 480), (37, 91)]]
    batch = preprocess(images, geometry)
    patches = geometry.max_patches
    pooler = Gemma4VisionPooler(SimpleNamespace(hidden_size=patches))
    for i in range(len(images)):
        ours = encoder_inputs(batch.pixel_values[i], batch.image_position_ids[i], geometry)
        positions = torch.from_numpy(batch.image_position_ids[i][None])
        padding = (positions == -1).all(dim=-1)
        pooled, mask = pooler(torch.eye(patches)[None], positions, padding, output_length=soft_tokens)
        np.testing.assert_allclose(ours.pooling[0], (pooled[0] / patches**0.5).numpy(), rtol=0, atol=1e-7)
        assert int(mask.sum()) == ours.num_soft_tokens == batch.num_soft_tokens_per_image[i]
        assert not ours.pooling[0, ours.num_soft_tokens:].any()
        real = ~padding[0].numpy()
        assert (ours.attention_mask[0, 0, 0] == np.where(real, 0.0, -255.0)).all()
        assert (ours.valid[0, :, 0] == real).all()


def test_bad_images_are_refused_by_name(tmp_path):
    geometry = ImageGeometry(soft_tokens=70)
    with pytest.raises(ImageInputError, match="not an image"):
        preprocess(b"hello, I am text", geometry)
    buffer = io.BytesIO()
    photo_like(200, 200).save(buffer, format="JPEG")
    with pytest.raises(ImageInputError, match="truncated or corrupt"):
        open_image(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(ImageInputError, match="No image file"):
        open_image(tmp_path / "missing.png")
    with pytest.raises(ImageInputError, match="PIL.Image.fromarray"):
        open_image(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ImageInputError, match="no pixels"):
        target_size(0, 5, geometry)
    with pytest.raises(ValueError, match="expected one of: 70, 140, 280, 560, 1120"):
        ImageGeometry(soft_tokens=100)
    batch = preprocess(photo_like(8, 8), geometry)
    with pytest.raises(ImageInputError, match="max_soft_tokens=280"):
        encoder_inputs(batch.pixel_values[0], batch.image_position_ids[0], ImageGeometry(soft_tokens=280))
