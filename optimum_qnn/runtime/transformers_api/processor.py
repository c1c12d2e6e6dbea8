"""`QNNProcessor`: Gemma 4's processor for an image variant, as ``pipeline("image-text-to-text")`` and user code call it.

Hugging Face's ``Gemma4Processor`` needs its video processor, which needs torchvision (and the registry's torchvision
is a CUDA build), and it reads the image tokens from a tokenizer that names them. This one takes the variant itself:
its image budget (soft tokens an image, patch and pooling sizes) and its placeholder ids come from the manifest, the
images are processed in numpy as ``Gemma4ImageProcessorPil`` processes them (`optimum_qnn.images`), and each image
token of the text becomes that image's block (BOI, its soft tokens' placeholders, EOI), as ``Gemma4Processor`` expands
it. Its output is what `QNNModelForImageTextToText.generate` takes: ``input_ids``, ``attention_mask``,
``pixel_values``, ``image_position_ids``.

Example:

```python
>>> model = QNNModelForImageTextToText.from_pretrained("out/", soc="SM8650", quant="fp16")
>>> processor = QNNProcessor(model)
>>> pipe = pipeline("image-text-to-text", model=model, processor=processor)
>>> pipe(text=[{"role": "user", "content": [{"type": "image", "url": "cat.png"},
...                                         {"type": "text", "text": "What is this?"}]}], max_new_tokens=32)
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.runtime.image_prompts import IMAGE_MARK, check_unmarked, encode_marked

__all__ = ["QNNProcessor"]

# Gemma 4's image token, as its tokenizer names it (``tokenizer.image_token``): where an image goes in a text.
GEMMA4_IMAGE_TOKEN = "<|image|>"
# The keys a chat message's image part may carry its image under (transformers' chat format).
_IMAGE_KEYS = ("image", "url", "path", "base64")


class QNNProcessor:
    """Text and images to the inputs of an image variant: ``processor(images=, text=)``, ``apply_chat_template``, and
    the decoding ``pipeline()`` calls.

    Args:
        model: a loaded `QNNModelForImageTextToText` (its image budget and placeholder ids).
        tokenizer: the artifact's tokenizer; by default transformers' ``AutoTokenizer`` of the artifact's folder
            (``model.tokenizer()`` without transformers).
        image_token: the text that stands for an image in ``text``; by default the tokenizer's ``image_token``, else
            Gemma 4's ``<|image|>``.
    """

    model_input_names = ("input_ids", "attention_mask", "pixel_values", "image_position_ids")

    def __init__(self, model: Any, tokenizer: Any = None, image_token: str | None = None):
        if getattr(model.manifest.contract, "images", None) is None:
            raise InvalidInputError(f"Variant {model.variant.name} takes no images: a QNNProcessor serves an image "
                                    "variant (export with --task image-text-to-text)")
        self.model, self.tokenizer = model, tokenizer if tokenizer is not None else _tokenizer_of(model)
        self.image_token = image_token or getattr(self.tokenizer, "image_token", None) or GEMMA4_IMAGE_TOKEN

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def __call__(self, images: Any = None, text: str | Sequence[str] | None = None, return_tensors: str | None = None,
                 padding: bool | str = False, add_special_tokens: bool = True, **_: Any) -> Any:
        """``text`` (one string or a list) with one image token where each image goes, and ``images`` in the order
        the tokens take them (one list, or one list per text), as ``Gemma4Processor`` is called."""
        if text is None:
            raise InvalidInputError("QNNProcessor needs text: put one image token "
                                    f"({self.image_token}) in it where each image goes")
        texts = [text] if isinstance(text, str) else list(text)
        flat = _flatten(images)
        wanted = sum(t.count(self.image_token) for t in texts)
        if wanted != len(flat):
            raise InvalidInputError(f"The text holds {wanted} image tokens ({self.image_token}) and {len(flat)} images "
                                    "were given: put one image token where each image goes")
        for t in texts:
            check_unmarked(t, "The text")
        return self._encode([t.replace(self.image_token, IMAGE_MARK) for t in texts], flat, return_tensors,
                            padding, add_special_tokens)

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *, tokenize: bool = False,
                            return_dict: bool = False, return_tensors: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            **_: Any) -> Any:
        """The conversation rendered by the artifact's chat template, each image part in its place (``{"type":
        "image", "url" | "path" | "image": ...}``): its text (image tokens where the images go), or with
        ``tokenize`` the model's inputs (``return_dict``) or the ids alone."""
        messages, images = [], []
        for message in conversation:
            content = message.get("content")
            if isinstance(content, str):
                check_unmarked(content, "A message")
            elif isinstance(content, Sequence):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        images.append(_image_of(part))
                        parts.append(IMAGE_MARK)
                    elif part.get("type") == "text":
                        check_unmarked(part.get("text", ""), "A message")
                        parts.append(part.get("text", ""))
                    else:
                        raise InvalidInputError(f"A message part of type {part.get('type')!r}: this variant reads "
                                                "text and image parts")
                content = "".join(parts)
            messages.append({**message, "content": content})
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message)
        if not tokenize:
            return rendered.replace(IMAGE_MARK, self.image_token)
        # The template's text holds its special tokens; none are added (as transformers' tokenize=True).
        inputs = self._encode([rendered], images, return_tensors, False, add_special_tokens=False)
        return inputs if return_dict else inputs["input_ids"]

    def post_process_image_text_to_text(self, generated_outputs: Any, skip_special_tokens: bool = True,
                                        **kwargs: Any) -> list[str]:
        return self.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def _encode(self, texts: list[str], images: list[Any], return_tensors: str | None, padding: bool | str,
                add_special_tokens: bool) -> Any:
        """Each text's ids (its markers replaced by its images' blocks, in order), padded on the tokenizer's side,
        with the images' pixels and positions."""
        info = self.model.manifest.contract.images
        pixels = self.model.image_inputs(images) if images else None
        counts = [] if pixels is None else [int(n) for n in pixels["num_soft_tokens_per_image"]]
        rows, taken = [], 0
        for text in texts:
            n = text.count(IMAGE_MARK)
            rows.append(self._ids(text, counts[taken: taken + n], info, add_special_tokens))
            taken += n
        if len(rows) > 1 and not padding and len({len(r) for r in rows}) > 1:
            raise InvalidInputError("The texts have different lengths: pass padding=True")
        width = max(len(r) for r in rows)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        ids = np.full((len(rows), width), pad, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for r, row in enumerate(rows):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[r, span], mask[r, span] = row, 1
        data: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if pixels is not None:
            data["pixel_values"] = pixels["pixel_values"]
            data["image_position_ids"] = pixels["image_position_ids"]
        return _batch(data, return_tensors)

    def _ids(self, text: str, soft_tokens: list[int], info: Any, add_special_tokens: bool) -> list[int]:
        """One text's ids: the tokenizer's own special tokens (Gemma 4's BOS) around the text, as it adds them."""
        if not add_special_tokens:
            return encode_marked(self.tokenizer, text, soft_tokens, info)
        # The first piece with the tokenizer's special tokens (BOS before it), the rest as the text continues.
        head = text.split(IMAGE_MARK, 1)[0]
        first = [int(t) for t in self.tokenizer(head, add_special_tokens=True)["input_ids"]]
        return first + encode_marked(self.tokenizer, text[len(head):], soft_tokens, info)


def _tokenizer_of(model: Any) -> Any:
    """The artifact folder's tokenizer: transformers' where it is importable, else the runtime's own."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return model.tokenizer()
    return AutoTokenizer.from_pretrained(model.root)


def _flatten(images: Any) -> list[Any]:
    """One list of images from none, one, a list, or one list per text."""
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        return [images]
    return [i for item in images for i in (item if isinstance(item, (list, tuple)) else [item])]


def _image_of(part: Mapping[str, Any]) -> Any:
    """A chat image part's image: a PIL image as it is, or what transformers' ``load_image`` reads (a path, an URL,
    base64)."""
    for key in _IMAGE_KEYS:
        if part.get(key) is not None:
            source = part[key]
            break
    else:
        raise InvalidInputError(f"An image part carries its image under one of {', '.join(_IMAGE_KEYS)}")
    if isinstance(source, (str, bytes)) or not hasattr(source, "convert"):
        from transformers.image_utils import load_image

        return load_image(source)
    return source


def _batch(data: dict[str, np.ndarray], return_tensors: str | None) -> Any:
    """transformers' ``BatchFeature`` where transformers is importable (``.to()``, ``return_tensors``), else the
    dict of arrays."""
    try:
        from transformers import BatchFeature
    except ImportError:
        return data
    return BatchFeature(data=data, tensor_type=return_tensors)
