"""The static vision encoder lowered to QNN (fp16, SM8650) and run on the x86 HTP emulator through ExecuTorch's
runtime, against Hugging Face's fp32 `get_image_features` on the tiny multimodal config.

Tolerances: the fp16 bounds of tests/test_lowering.py's small graphs, widened for a whole tower: max abs error
<= 5e-3 and cosine >= 0.9999 (measured at 70 soft tokens on three aspect ratios: max abs 8.2e-4 to 1.2e-3, cosine
0.999998 on every image). At 280 soft tokens (2520 patches, measured once, not tested: the lowering took 1824 s
and one encode 590 s with the host at load average ~15 on 2 cores) the 500x3 strip gave max abs 8.3e-4, cosine
0.999999, in one partition.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from optimum_qnn.config import Soc
from optimum_qnn.images import encoder_inputs
from optimum_qnn.models.gemma4.vision import StaticImageEncoder, geometry_of
from tests.gemma4_vision_tiny import tiny_multimodal_model
from tests.models.gemma4.test_vision import hf_image_features
from tests.test_images import photo_like

MAX_ABS = 5e-3
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def lowered_encoder(qnn_sdk):
    from optimum_qnn.exporter.lowering import lower_to_pte

    model = tiny_multimodal_model()
    encoder, _ = StaticImageEncoder.from_hf(model, geometry_of(model.config.vision_config, 70))
    lowered = lower_to_pte({"forward": (encoder, encoder.example_inputs())}, Soc.SM8650, fp16=True)
    return model, encoder, lowered


def test_the_whole_encoder_is_one_qnn_partition(lowered_encoder):
    _, _, lowered = lowered_encoder
    forward = lowered.delegation["forward"]
    assert forward.partitions == 1 and not forward.on_cpu, forward


def test_fp16_encoder_on_the_emulator_matches_hugging_face(lowered_encoder):
    from executorch.runtime import Runtime

    model, encoder, lowered = lowered_encoder
    image = photo_like(91, 300, seed=2)  # portrait: the pooling's row stride differs from its column count
    batch = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[image], return_tensors="np")
    expected = hf_image_features(model, batch["pixel_values"], batch["image_position_ids"])[0]
    inputs = encoder_inputs(batch["pixel_values"][0], batch["image_position_ids"][0], encoder.geometry)
    program = Runtime.get().load_program(lowered.buffer)
    out = program.load_method("forward").execute([torch.from_numpy(a) for a in inputs.as_tuple()])[0]
    got = out[0, : inputs.num_soft_tokens].float()
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(got.flatten().double(), expected.flatten().double(), dim=0).item()
    assert err <= MAX_ABS and cosine >= MIN_COSINE, (err, cosine)
