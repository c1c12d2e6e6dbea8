"""Image prompts: `QNNModelForImageTextToText`, an image variant (``export --task image-text-to-text``) run as Hugging
Face's ``AutoModelForImageTextToText`` is called.

``generate(input_ids=, attention_mask=, pixel_values=, image_position_ids=)`` takes the processor's output: each
image goes through the program's vision encoder (`ImagesInfo.method`) on the NPU, its first ``num_soft_tokens`` rows
are its soft tokens, and they fill the prompt's image placeholders in order, as `Gemma4Model` fills them
(``masked_scatter``). The decoder's prefill reads them in place of the placeholders' embeddings (with the pad id's
per-layer input), so text and images go through one prompt.

Runtime code: numpy only (Pillow for `optimum_qnn.images`); no torch needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from optimum_qnn.errors import InvalidInputError, UnsupportedParameterError
from optimum_qnn.images import ImageGeometry, encoder_inputs, preprocess
from optimum_qnn.ops.arrays import as_numpy
from optimum_qnn.runtime.image_prompts import check_unmarked, encode_marked, image_block, marked
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from optimum_qnn.runtime.stops import text_stop_ids

__all__ = ["QNNModelForImageTextToText"]


class QNNModelForImageTextToText(QNNModelForCausalLM):
    """An image variant of a Gemma 4 export: text and images in, text out, on the NPU.

    Example:

    ```python
    >>> model = QNNModelForImageTextToText.from_pretrained("out/", soc="SM8650", quant="fp16")
    >>> processor = QNNProcessor(model)
    >>> inputs = processor(text="<|image|>What is this?", images=[image], return_tensors="np")
    >>> out = model.generate(**inputs, max_new_tokens=32)
    ```
    """

    takes_images = True  # `from_pretrained` picks among the variants that take images
    pipeline_tables = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",)
    input_modalities = ("image", "text")

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "QNNModelForImageTextToText":
        model = super().from_pretrained(*args, **kwargs)
        if model.manifest.contract.images is None:
            raise InvalidInputError(
                f"Variant {model.variant.name} takes no images (exported for text generation): export with --task "
                "image-text-to-text, or load it with QNNModelForCausalLM"
            )
        if not getattr(model.backend, "takes_images", False):
            raise UnsupportedParameterError(
                f"The {model.backend.name} backend cannot feed an image's soft tokens to the decoder (ExecuTorch's "
                "qnn_llama_runner takes token ids only): load it with device='host:executorch' or 'host:onnxruntime'",
                param="device", backend=model.backend.name,
            )
        return model

    @property
    def geometry(self) -> ImageGeometry:
        """The variant's image budget: soft tokens an image, patch and pooling sizes."""
        info = self.manifest.contract.images
        return ImageGeometry(soft_tokens=info.soft_tokens, patch_size=info.patch_size,
                             pooling_kernel_size=info.pooling_kernel_size)

    def generate(self, input_ids: Any = None, attention_mask: Any = None, generation_config: Any = None, *,
                 pixel_values: Any = None, image_position_ids: Any = None, **kwargs: Any) -> Any:
        """`QNNModelForCausalLM.generate`, plus the processor's ``pixel_values`` ``[images, patches, pixels]`` and
        ``image_position_ids`` ``[images, patches, 2]``: the images fill the rows' image placeholders in order."""
        if pixel_values is None:
            return super().generate(input_ids, attention_mask, generation_config, **kwargs)
        if image_position_ids is None:
            raise InvalidInputError("pixel_values come with image_position_ids (the processor gives both)")
        from optimum_qnn.runtime.transformers_api.generate import hf_generate

        features = self.encode_images(pixel_values, image_position_ids)
        ids = np.atleast_2d(as_numpy(input_ids))
        counts = (ids == self.manifest.contract.images.image_token_id).sum(axis=1)
        if int(counts.sum()) != len(features):
            raise InvalidInputError(
                f"The prompt holds {int(counts.sum())} image placeholders and the images give {len(features)} soft "
                f"tokens: make the text and the images with one processor call, its max_soft_tokens "
                f"{self.geometry.soft_tokens} (this variant's budget)"
            )
        starts = np.concatenate([[0], np.cumsum(counts)])
        per_row = [features[starts[r]: starts[r + 1]] for r in range(len(ids))]
        return hf_generate(self, input_ids, attention_mask, generation_config, row_inputs=("image_features",),
                           image_features=per_row, **kwargs)

    def encode_images(self, pixel_values: Any, image_position_ids: Any) -> np.ndarray:
        """The soft tokens of each image, in order: ``[sum of their soft tokens, hidden]`` float32, from the
        program's vision encoder."""
        pixels, positions = as_numpy(pixel_values), as_numpy(image_position_ids)
        if pixels.ndim == 2:
            pixels, positions = pixels[None], positions[None]
        method = self.backend.session.methods[self.manifest.contract.images.method]
        rows = []
        for pv, pos in zip(pixels, positions):
            inputs = encoder_inputs(pv, pos, self.geometry)
            with self.backend.lock:  # the program's calls take turns (`backends.host`)
                out = np.asarray(as_numpy(method(list(inputs.as_tuple()))[0]))
            rows.append(out[0, : inputs.num_soft_tokens].astype(np.float32))
        return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)

    def encode_each(self, images: Any) -> list[np.ndarray]:
        """Each image's soft tokens (``[its soft tokens, hidden]`` float32), in order: ``images`` (paths, bytes or PIL
        images) processed here and run through the program's vision encoder."""
        inputs = self.image_inputs(list(images) if isinstance(images, (list, tuple)) else [images])
        rows = self.encode_images(inputs["pixel_values"], inputs["image_position_ids"])
        ends = np.cumsum(inputs["num_soft_tokens_per_image"])
        return [rows[end - n: end] for n, end in zip(inputs["num_soft_tokens_per_image"], ends)]

    def image_inputs(self, images: Any) -> dict[str, np.ndarray]:
        """``pixel_values`` and ``image_position_ids`` of ``images`` (paths, bytes or PIL images), processed here in
        numpy as Hugging Face's processor would at this variant's budget, and each image's soft-token count."""
        batch = preprocess(images, self.geometry)
        return {"pixel_values": batch.pixel_values, "image_position_ids": batch.image_position_ids,
                "num_soft_tokens_per_image": np.asarray(batch.num_soft_tokens_per_image)}

    def image_text_generation(self, tokenizer, prompt: str, images: Sequence[Any], *, chat: bool = False,
                              **kwargs: Any) -> str:
        """`text_generation` with ``images`` (paths, bytes or PIL images) before the text: each image's block (BOI,
        its soft tokens' placeholders, EOI) opens the prompt after BOS, or with ``chat`` the user's turn, as Gemma 4's
        processor and chat template place an image given before the text. ``kwargs`` go to `generate_tokens`."""
        if not isinstance(prompt, str):
            raise InvalidInputError(f"prompt must be a string; got {type(prompt).__name__}")
        if not images:
            raise InvalidInputError("image_text_generation needs at least one image (text alone: text_generation)")
        each = self.encode_each(images)
        ids = self.image_prompt_ids(tokenizer, prompt, [len(rows) for rows in each], chat=chat)
        kwargs.setdefault("eos_token_id", text_stop_ids(self.manifest.tokenizer.eos_ids, tokenizer, chat))
        out = self.generate_tokens(ids, image_features=np.concatenate(each), **kwargs)
        return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)

    def image_prompt_ids(self, tokenizer, prompt: str, soft_tokens: Sequence[int], *, chat: bool = False) -> list[int]:
        """The ids of ``prompt`` with one image block per entry of ``soft_tokens`` (that image's soft-token count)
        before its text: after BOS, or with ``chat`` at the start of the user's turn of the chat template."""
        info = self.manifest.contract.images
        check_unmarked(prompt, "The prompt")
        if not chat:
            ids = [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
            head = 1 if ids and ids[0] == self.manifest.tokenizer.bos_id else 0
            return [*ids[:head], *(t for n in soft_tokens for t in image_block(info, n)), *ids[head:]]
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInputError("chat=True needs a tokenizer with a chat template, and this one has none: pass "
                                    "chat=False (without --chat)")
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marked(prompt, len(soft_tokens))}],
                                                 add_generation_prompt=True, tokenize=False)
        return encode_marked(tokenizer, rendered, soft_tokens, info)
