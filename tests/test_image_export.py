"""An image variant end to end: `export --task image-text-to-text` (fp16, SM8650, 70 soft tokens an image) of a
multimodal Gemma 4 made of the demo model's decoder and a small random vision tower, run on the x86 HTP emulator
through both host backends against Hugging Face's `Gemma4ForConditionalGeneration` in fp32: the same greedy ids for
an image prompt, the text variant's ids for a text prompt, a later turn that reuses the image's K/V, and the
refusals (a text variant, a checkpoint without a tower, the runner, audio)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from optimum_qnn.errors import InvalidInputError, UnsupportedModelError
from tests.conftest import built_once
from tests.test_images import photo_like

# Placeholder ids inside the demo tokenizer's 512: ordinary tokens the test prompts never hold.
IMAGE_ID, BOI_ID, EOI_ID = 511, 510, 509
CTX, AR, SOFT = 128, 16, 70
TEXT = [2, 40, 41, 42, 43]


@pytest.fixture(scope="module")
def multimodal_dir(demo_model_dir, tmp_path_factory) -> Path:
    """The demo decoder with a random vision tower (every trait of the published one on), saved as a checkpoint."""

    def build(folder: Path) -> Path:
        from transformers import AutoModelForCausalLM, Gemma4Config

        from tests.gemma4_vision_tiny import tiny_multimodal_model, tiny_vision_config

        text = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
        config = Gemma4Config(text_config=text.config, vision_config=tiny_vision_config(), audio_config=None,
                              image_token_id=IMAGE_ID, boi_token_id=BOI_ID, eoi_token_id=EOI_ID)
        model = tiny_multimodal_model(config, seed=3)
        model.model.language_model.load_state_dict(text.model.state_dict())
        out = folder / "model"
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (demo_model_dir / name).is_file():
                shutil.copy(demo_model_dir / name, out / name)
        return out

    return built_once(tmp_path_factory, "image-checkpoint", build)


@pytest.fixture(scope="module")
def image_export(multimodal_dir, tmp_path_factory, qnn_sdk) -> Path:
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID,
                          shapes=ShapeConfig(CTX, AR), embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
                          image_tokens=SOFT)
    return built_once(tmp_path_factory, "image-fp16", lambda folder: export(multimodal_dir, folder / "out", config).output)


@pytest.fixture(scope="module")
def hf_model(multimodal_dir):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(multimodal_dir, dtype=torch.float32).eval()


def image_prompt(model, size=(640, 480), seed=0):
    """A prompt of text, an image (BOI, its placeholders, EOI) and text, with the image's inputs from optimum-qnn's
    own processing (equal to transformers' `Gemma4ImageProcessorPil`: tests/test_images.py)."""
    inputs = model.image_inputs([photo_like(*size, seed=seed)])
    n = int(inputs["num_soft_tokens_per_image"][0])
    ids = np.array([[*TEXT, BOI_ID, *[IMAGE_ID] * n, EOI_ID, 50, 51]], dtype=np.int64)
    return ids, inputs["pixel_values"], inputs["image_position_ids"]


def hf_greedy(hf_model, ids, pixel_values, positions, new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                                pixel_values=torch.from_numpy(pixel_values), image_position_ids=torch.from_numpy(positions),
                                max_new_tokens=new, do_sample=False, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def test_the_variant_records_what_the_runtime_needs(image_export):
    from optimum_qnn.artifacts.manifest import read_manifest

    (variant,) = [p.parent for p in image_export.glob("qnn/*/*/manifest.json")]
    assert variant.relative_to(image_export).as_posix() == f"qnn/sm8650/fp16-ctx{CTX}-img{SOFT}"
    manifest = read_manifest(variant)
    images = manifest.contract.images
    assert (images.method, images.soft_tokens, images.image_token_id, images.boi_token_id, images.eoi_token_id) == (
        "vision_encoder", SOFT, IMAGE_ID, BOI_ID, EOI_ID)
    methods = {m.name: m for m in manifest.contract.methods}
    assert [t.name for t in methods["prefill_forward"].inputs[-2:]] == ["image_embeds", "image_mask"]
    assert [t.name for t in methods["kv_forward"].inputs[-1:]] != ["image_mask"]
    assert methods["vision_encoder"].outputs[0].shape[1] == SOFT


@pytest.mark.parametrize("device", ["host:executorch", "host:onnxruntime"])
def test_an_image_prompt_gives_hugging_faces_greedy_ids(image_export, hf_model, device):
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device=device)
    for size, seed in (((640, 480), 0), ((91, 300), 1)):
        ids, pixel_values, positions = image_prompt(model, size, seed)
        want = hf_greedy(hf_model, ids, pixel_values, positions, 12)
        got = model.generate(input_ids=ids, attention_mask=np.ones_like(ids), pixel_values=pixel_values,
                             image_position_ids=positions, max_new_tokens=12, eos_token_id=[])
        print(f"{device} {size}: ours {got[0, ids.shape[1]:].tolist()} theirs {want}")
        assert got[0, : ids.shape[1]].tolist() == ids[0].tolist() and got[0, ids.shape[1]:].tolist() == want
    # A text prompt on the image variant: the text model's tokens.
    text = np.array([TEXT + [44, 45]], dtype=np.int64)
    with torch.no_grad():
        want = hf_model.generate(input_ids=torch.from_numpy(text), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None)[0, text.shape[1]:].tolist()
    assert model.generate(input_ids=text, max_new_tokens=8, eos_token_id=[])[0, text.shape[1]:].tolist() == want


def test_a_later_turn_reuses_the_images_cache(image_export):
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    model = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    ids, pixel_values, positions = image_prompt(model)
    first = model.generate(input_ids=ids, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                           eos_token_id=[], reuse_cache=True)
    follow = np.concatenate([first, [[60, 61]]], axis=1)
    fresh = QNNModelForImageTextToText.from_pretrained(image_export, device="host:onnxruntime")
    want = fresh.generate(input_ids=follow, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                          eos_token_id=[])
    got = model.generate(input_ids=follow, pixel_values=pixel_values, image_position_ids=positions, max_new_tokens=4,
                         eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == first.shape[1] - 1 and got.tolist() == want.tolist()
    # Another image at the same places reuses only the text before it.
    other = model.image_inputs([photo_like(640, 480, seed=7)])
    model.generate(input_ids=follow, pixel_values=other["pixel_values"], image_position_ids=other["image_position_ids"],
                   max_new_tokens=1, eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == len(TEXT) + 1


def test_what_cannot_take_images_is_refused_by_name(image_export, fp16_export, multimodal_dir, demo_model_dir, tmp_path):
    from optimum_qnn.artifacts.manifest import read_manifest
    import argparse

    from optimum_qnn.cli import add_export_arguments, config_from_args
    from optimum_qnn.config import ExportConfig, QuantScheme
    from optimum_qnn.exporter.preflight import preflight
    from optimum_qnn.runtime.backends.runner import check_runner_layout
    from optimum_qnn.runtime.images import QNNModelForImageTextToText

    with pytest.raises(InvalidInputError, match="takes no images.*--task image-text-to-text"):
        QNNModelForImageTextToText.from_pretrained(fp16_export.output, device="host:onnxruntime")
    (variant,) = [p.parent for p in image_export.glob("qnn/*/*/manifest.json")]
    with pytest.raises(InvalidInputError, match="takes images.*qnn_llama_runner feeds token ids only"):
        check_runner_layout(variant, read_manifest(variant).runner_contract())
    with pytest.raises(InvalidInputError, match="audio is not part"):
        parser = argparse.ArgumentParser()
        add_export_arguments(parser)
        config_from_args(parser.parse_args(["-m", "x", "-o", "y", "--task", "audio-text-to-text"]))
    with pytest.raises(InvalidInputError, match="built for --quant fp16 so far"):
        ExportConfig(quant=QuantScheme.A16W8, image_tokens=SOFT)
    with pytest.raises(InvalidInputError, match="--image-tokens must be one of"):
        ExportConfig(quant=QuantScheme.FP16, image_tokens=100)
    with pytest.raises(UnsupportedModelError, match="no vision tower"):
        from optimum_qnn.quantization.calibration import CalibrationSource

        preflight(str(demo_model_dir), demo_model_dir, ExportConfig(quant=QuantScheme.FP16, image_tokens=SOFT), None,
                  CalibrationSource(), False, None)
