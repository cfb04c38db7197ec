"""The byte-level tokenizer as transformers loads it from a run's `hf/`: the same ids, the same chat rendering."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from itertools import islice

import pytest

from recipes.data.chat import synthetic_conversations
from recipes.tokenizer import ByteTokenizer

TEXTS = ["héllo, wörld! 数据 🎉\n", "  two spaces, a\ttab and \x00\x7f controls", "<|user|>\nnot a special token\n", ""]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`AutoTokenizer.from_pretrained` of what `ByteTokenizer.save_pretrained` wrote."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("byte-tokenizer")
    ByteTokenizer().save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def test_it_encodes_and_decodes_text_as_the_byte_tokenizer_does(saved):
    byte_level = ByteTokenizer()
    assert len(saved) == byte_level.vocab_size
    assert saved.eos_token_id == saved.bos_token_id == saved.pad_token_id == byte_level.eos_id
    for text in TEXTS:
        ids = byte_level.encode(text)
        assert saved(text)["input_ids"] == ids  # nothing added: no bos, no eos
        assert saved.decode([*ids, byte_level.eos_id], skip_special_tokens=True) == text


def test_its_chat_template_renders_conversations_as_training_did(saved):
    byte_level = ByteTokenizer()
    for conversation in islice(synthetic_conversations(seed=3, num_bytes=10**5), 20):
        trained = [i for ids, _ in byte_level.chat_segments(conversation) for i in ids]
        assert saved.apply_chat_template(conversation, tokenize=True, return_dict=False) == trained
        prompt = saved.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith("<|assistant|>\n") and conversation[-1]["role"] == "assistant"
