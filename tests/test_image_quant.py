"""A quantized image variant (``--task image-text-to-text --quant 16a8w``): the decoder quantized with its prefill
calibrated on image prompts too (photographs, soft tokens from the float encoder, `quantization.image_calibration`),
the vision encoder kept float and compiled at HTP fp16, on the x86 HTP emulator against Hugging Face's fp32
`Gemma4ForConditionalGeneration` (the multimodal checkpoint of tests/test_image_export.py).

Quantized logits are not fp32's, so the check is their signal-to-quantization-noise ratio at the last prompt position,
on photographs the calibration did not see: an image prompt's must be about a text prompt's on the same variant (the
soft tokens' path is calibrated like the text's), and the greedy ids of both must start as Hugging Face's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from optimum_qnn.quantization.image_calibration import CALIBRATION_PHOTOS, photos_folder
from tests.conftest import built_once
from tests.test_image_export import BOI_ID, EOI_ID, IMAGE_ID, hf_model, multimodal_dir  # noqa: F401  (fixtures)

CTX, AR, SOFT = 128, 16, 70
TEXTS = ["The for statement", "Assignment statements are used to", "A list of numbers", "if x:"]
# Held-out photographs of scikit-image's data folder (the export calibrates on CALIBRATION_PHOTOS): the cat too.
HELD_OUT = ("chelsea.png", "hubble_deep_field.jpg", "grass.png", "retina.jpg")


@pytest.fixture(scope="module")
def quant_image_export(multimodal_dir, tmp_path_factory, qnn_sdk) -> Path:  # noqa: F811
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.HYBRID,
                          shapes=ShapeConfig(CTX, AR), embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
                          image_tokens=SOFT)
    return built_once(tmp_path_factory, "image-16a8w",
                      lambda folder: export(multimodal_dir, folder / "out", config).output)


def test_the_decoder_is_quantized_and_the_encoder_and_soft_tokens_stay_float(quant_image_export):
    from optimum_qnn.artifacts.manifest import read_manifest

    (variant,) = [p.parent for p in quant_image_export.glob("qnn/*/*/manifest.json")]
    assert variant.name == f"16a8w-ctx{CTX}-img{SOFT}"
    contract = read_manifest(variant).runner_contract()
    for method in ("prefill_forward", "kv_forward"):
        spec = contract.method(method)
        dtypes = {t.name: t.dtype for t in spec.inputs}
        assert dtypes["image_embeds"] == dtypes["image_mask"] == "float32"  # the encoder's float output, as it is
        assert {d for n, d in dtypes.items() if n.startswith(("k_cache", "v_cache"))} == {"uint16"}
    (encoder_out,) = contract.method("vision_encoder").outputs
    assert encoder_out.dtype == "float32"


def test_the_checks_photographs_are_held_out():
    assert not set(HELD_OUT) & set(CALIBRATION_PHOTOS)
    assert all((photos_folder() / name).is_file() for name in HELD_OUT + CALIBRATION_PHOTOS)


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10((ref ** 2).sum() / ((ref - got) ** 2).sum()))


def test_image_prompts_are_as_close_to_hugging_face_as_text_prompts(quant_image_export, hf_model):  # noqa: F811
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(quant_image_export, device="host:onnxruntime")
    tok = model.tokenizer()
    sqnr: dict[str, list[float]] = {"image": [], "text": []}
    first_ids: dict[str, list[bool]] = {"image": [], "text": []}
    for i, text in enumerate(TEXTS):
        inputs = model.image_inputs([photos_folder() / HELD_OUT[i]])
        n = int(inputs["num_soft_tokens_per_image"][0])
        words = tok(text, add_special_tokens=False)["input_ids"]
        for kind in ("image", "text"):
            ids = np.array([[2, *([BOI_ID, *[IMAGE_ID] * n, EOI_ID] if kind == "image" else []), *words]])
            pixels = {k: inputs[k] for k in ("pixel_values", "image_position_ids")} if kind == "image" else {}
            out = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, eos_token_id=[],
                                 output_scores=True, return_dict_in_generate=True, **pixels)
            ours = np.asarray(out.scores[0])[0]
            with torch.no_grad():
                ref = hf_model(input_ids=torch.from_numpy(ids),
                               **{k: torch.from_numpy(v) for k, v in pixels.items()}).logits[0, -1].numpy()
            sqnr[kind].append(_sqnr(ref, ours))
            first_ids[kind].append(int(ours.argmax()) == int(ref.argmax()))
    means = {kind: float(np.mean(v)) for kind, v in sqnr.items()}
    print(f"16a8w SQNR at the last prompt position (dB): {sqnr}; means {means}; greedy first ids equal {first_ids}")
    assert means["image"] >= means["text"] - IMAGE_MARGIN_DB, means
    assert all(first_ids["image"]) and all(first_ids["text"]), first_ids


# How far below the text prompts' mean SQNR the image prompts' may be: measured on this variant (see the test's print).
IMAGE_MARGIN_DB = 3.0
