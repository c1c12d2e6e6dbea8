"""runtime.tokenizer.ArtifactTokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer on
the same files: the ids, the decoded text and the chat template's rendering must be the same."""

from __future__ import annotations

import pytest

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.runtime.tokenizer import ArtifactTokenizer

TEXTS = ["The for statement is used to", "  spaces, tabs\tand\nnewlines  ", "naïve café ☕ 日本語", "", "<bos>literal"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "ok ☕"}],
]


def _pair(folder):
    from transformers import AutoTokenizer

    return ArtifactTokenizer(folder), AutoTokenizer.from_pretrained(folder)


def _check_same(ours, theirs):
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == theirs(text, add_special_tokens=special)["input_ids"]
        ids = theirs(text, add_special_tokens=True)["input_ids"] + [ours.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        for open_reply in (True, False):
            want = theirs.apply_chat_template(messages, add_generation_prompt=open_reply, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=open_reply, tokenize=False) == want
            want_ids = theirs.apply_chat_template(messages, add_generation_prompt=open_reply, tokenize=True)
            want_ids = want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids
            assert ours.apply_chat_template(messages, add_generation_prompt=open_reply) == list(want_ids)
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id
    assert ours.get_vocab() == theirs.get_vocab()


def test_same_as_transformers_on_the_demo_tokenizer(demo_model_dir):
    _check_same(*_pair(demo_model_dir))


def test_missing_or_broken_files_say_what_to_do(tmp_path):
    with pytest.raises(InvalidInputError, match="no tokenizer files.*--prompt-ids"):
        ArtifactTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="Cannot read the tokenizer files"):
        ArtifactTokenizer(tmp_path)
