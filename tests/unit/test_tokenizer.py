"""The byte-level tokenizer, and Hugging Face tokenizers loaded from a local directory."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

from recipes.schema import TokenizerConfig
from recipes.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

SENTENCES = ["the red fox eats apples.", "the black cat eats fish.", "one plus two is three."] * 20


def save_trained_tokenizer(directory, *, eos_token="<eos>"):
    """Train a tiny byte-level BPE on a few sentences and save it as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(SENTENCES, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_trained_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_byte_tokenizer_round_trips_utf8_and_ignores_eos():
    tokenizer = ByteTokenizer()
    text = "héllo, wörld! 数据\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.eos_id == 256 and tokenizer.vocab_size == 257
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == text
    assert tokenizer.decode([0xFF]) == "\ufffd"


def test_build_tokenizer_defaults_to_bytes():
    assert isinstance(build_tokenizer(TokenizerConfig()), ByteTokenizer)


def test_missing_tokenizer_directory_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.path"):
        build_tokenizer(TokenizerConfig(path=str(tmp_path / "nope")))


def test_hf_tokenizer_from_local_directory(hf_dir):
    tokenizer = build_tokenizer(TokenizerConfig(path=str(hf_dir)))
    assert isinstance(tokenizer, HFTokenizer)
    text = "the red fox eats fish.\nnew words: héllo"
    ids = tokenizer.encode(text)
    assert tokenizer.eos_id not in ids
    assert tokenizer.decode(ids + [tokenizer.eos_id]) == text
    assert tokenizer.eos_id == tokenizer._tokenizer.convert_tokens_to_ids("<eos>")
    assert tokenizer.vocab_size == len(tokenizer._tokenizer) > max(ids)
    # Learned merges: the training sentences take fewer tokens than their bytes.
    assert len(tokenizer.encode(SENTENCES[0])) < len(SENTENCES[0])


def test_hf_tokenizer_identity_follows_its_files(tmp_path):
    first = save_trained_tokenizer(tmp_path / "a")
    assert HFTokenizer(first).identity == HFTokenizer(save_trained_tokenizer(tmp_path / "b")).identity
    before = HFTokenizer(first).identity
    config_file = first / "tokenizer_config.json"
    config_file.write_text(config_file.read_text() + "\n")
    assert HFTokenizer(first).identity != before


def test_hf_tokenizer_without_eos_is_refused(tmp_path):
    directory = save_trained_tokenizer(tmp_path, eos_token=None)
    with pytest.raises(ValueError, match="no eos token"):
        HFTokenizer(directory)
