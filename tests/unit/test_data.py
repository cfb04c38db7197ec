"""Data sources, the synthetic corpus, cached token files and the deterministic sampler."""

import json
import os
import subprocess
import sys
import zlib

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import pytest
import torch

from recipes.data import (
    PackedSampler,
    TokenSampler,
    check_data_config,
    iter_texts,
    open_token_file,
    prepare_token_file,
    rank_sample_indices,
    sources,
    synthetic_text,
)
from recipes.schema import DataConfig
from recipes.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_id


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting its `encode` calls to prove when a corpus is (not) tokenized."""

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def byte_tokens(*documents):
    return [t for doc in documents for t in [*doc.encode("utf-8"), EOS]]


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- synthetic corpus ---------------------------------------------------------------------------------------------


def test_synthetic_text_is_deterministic_exact_and_structured():
    text = synthetic_text(seed=0, num_bytes=200_000)
    assert text == synthetic_text(seed=0, num_bytes=200_000)
    assert text != synthetic_text(seed=1, num_bytes=200_000)
    assert all(len(synthetic_text(seed=2, num_bytes=n).encode()) == n for n in [0, 1, 37, 5_000, 200_000])
    lines = text.split("\n")
    assert len(set(lines)) < len(lines) / 5
    # Far more redundant than random bytes: a small model has something to learn.
    assert len(zlib.compress(text.encode(), 9)) < 0.2 * len(text)
    # Facts hold throughout: the fox is always red and always eats apples.
    fox_lines = [line for line in lines[:-1] if " fox eats " in line]
    assert fox_lines and set(fox_lines) == {"the red fox eats apples."}


# --- config checks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source": "parquet_files"}, "synthetic, text_files, hf_dataset"),
        ({"source": "text_files"}, "needs data.paths"),
        ({"source": "text_files", "paths": ["/no/such/file.txt"]}, "data.paths: '/no/such/file.txt' does not exist"),
        ({"source": "hf_dataset"}, "data.paths .* or data.name"),
        ({"source": "synthetic", "seq_len": 0}, "data.seq_len=0"),
        ({"source": "synthetic", "paths": ["a.txt"]}, "data.source=synthetic ignores data.paths"),
        ({"source": "synthetic", "synthetic_num_bytes": 0}, "data.synthetic_num_bytes=0"),
    ],
)
def test_check_data_config_names_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        check_data_config(DataConfig(**fields))


def test_check_data_config_accepts_valid_sources(tmp_path):
    check_data_config(DataConfig())
    check_data_config(DataConfig(source="text_files", paths=[write(tmp_path / "a.txt", "hi")]))
    check_data_config(DataConfig(source="hf_dataset", paths=[write(tmp_path / "a.jsonl", "{}")]))
    check_data_config(DataConfig(source="hf_dataset", name="org/corpus"))


def test_hf_dataset_with_unknown_extension_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the format of .*a.xml"):
        check_data_config(DataConfig(source="hf_dataset", paths=[write(tmp_path / "a.xml", "<a/>")]))


def test_data_modules_import_neither_datasets_nor_transformers():
    code = (
        "import sys, recipes.data, recipes.tokenizer; print('datasets' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd())
    assert out.stdout.split() == ["False", "False"]


# --- reading sources ----------------------------------------------------------------------------------------------


def test_text_files_are_one_document_each(tmp_path, monkeypatch):
    # Tiny pieces: a document longer than a piece must still come back whole and tokenize the same.
    monkeypatch.setattr(sources, "_PIECE_CHARS", 8)
    first = "line one\nline two is longer than eight\nno newline at all in this long tail"
    paths = [write(tmp_path / "a.txt", first), write(tmp_path / "b.txt", "ümlaut\n")]
    config = DataConfig(source="text_files", paths=paths, seq_len=4, cache_dir=str(tmp_path / "cache"))
    assert list(iter_texts(config)) == [first, "ümlaut\n"]
    tokens = open_token_file(prepare_token_file(config, ByteTokenizer()))
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == byte_tokens(first, "ümlaut\n")


def test_hf_dataset_from_local_jsonl_and_csv(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in [{"text": "hello", "id": 1}, {"text": None, "id": 2}]))
    csv = write(tmp_path / "docs.csv", 'body,id\n"a, b",1\nsecond,2\n')
    cache = str(tmp_path / "cache")

    from_jsonl = DataConfig(source="hf_dataset", paths=[str(jsonl)], seq_len=2, cache_dir=cache)
    assert list(iter_texts(from_jsonl)) == ["hello"]
    assert open_token_file(prepare_token_file(from_jsonl, ByteTokenizer())).tolist() == byte_tokens("hello")

    from_csv = DataConfig(source="hf_dataset", paths=[csv], text_field="body", split="validation", cache_dir=cache)
    assert list(iter_texts(from_csv)) == ["a, b", "second"]

    wrong_column = DataConfig(source="hf_dataset", paths=[csv], text_field="text")
    with pytest.raises(ValueError, match="'text' is not a column.*'body', 'id'"):
        list(iter_texts(wrong_column))


# --- token files --------------------------------------------------------------------------------------------------


def test_token_file_is_built_once_and_reused(tmp_path):
    config = DataConfig(synthetic_num_bytes=5_000, seq_len=16, cache_dir=str(tmp_path))
    tokenizer = CountingTokenizer()
    path = prepare_token_file(config, tokenizer)
    calls, mtime = tokenizer.calls, path.stat().st_mtime_ns
    assert calls > 0 and path.parent == tmp_path / "tokens"
    assert prepare_token_file(config, tokenizer) == path
    assert tokenizer.calls == calls and path.stat().st_mtime_ns == mtime
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == 5_001
    assert open_token_file(path).tolist() == byte_tokens(synthetic_text(seed=0, num_bytes=5_000))
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.with_suffix(".json").name])


def test_cache_dir_falls_back_to_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTLESS_CACHE", str(tmp_path / "env-cache"))
    path = prepare_token_file(DataConfig(synthetic_num_bytes=100, seq_len=8), ByteTokenizer())
    assert path.parent == tmp_path / "env-cache" / "tokens"


def test_changed_source_file_gets_a_new_token_file(tmp_path):
    source = tmp_path / "a.txt"
    config = DataConfig(source="text_files", paths=[write(source, "first version")], seq_len=4, cache_dir=str(tmp_path))
    first = prepare_token_file(config, ByteTokenizer())
    write(source, "second version!")
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    second = prepare_token_file(config, ByteTokenizer())
    assert second != first
    assert open_token_file(second).tolist() == byte_tokens("second version!")


def test_large_vocabulary_uses_uint32(tmp_path):
    class WideTokenizer(ByteTokenizer):
        vocab_size = 70_000
        eos_id = 69_999

        @property
        def identity(self):
            return "wide"

        def encode(self, text):
            return [60_000 + b for b in text.encode()]

    path = prepare_token_file(DataConfig(synthetic_num_bytes=50, seq_len=8, cache_dir=str(tmp_path)), WideTokenizer())
    tokens = open_token_file(path)
    assert tokens.dtype == np.uint32 and tokens[-1] == 69_999 and tokens.max() == 69_999


def test_too_small_and_empty_corpora_are_refused(tmp_path):
    config = DataConfig(
        source="text_files", paths=[write(tmp_path / "a.txt", "abc")], seq_len=8, cache_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="the corpus has 4 tokens, but data.seq_len=8 needs at least 9"):
        prepare_token_file(config, ByteTokenizer())
    empty = DataConfig(source="text_files", paths=[write(tmp_path / "b.txt", "")], cache_dir=str(tmp_path / "c2"))
    with pytest.raises(ValueError, match="empty"):
        prepare_token_file(empty, ByteTokenizer())
    assert list((tmp_path / "c2" / "tokens").iterdir()) == []


def test_failed_tokenization_leaves_nothing_to_trust(tmp_path):
    class FailingTokenizer(ByteTokenizer):
        def encode(self, text):
            raise RuntimeError("tokenizer crashed")

    config = DataConfig(synthetic_num_bytes=1_000, seq_len=8, cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="crashed"):
        prepare_token_file(config, FailingTokenizer())
    assert list((tmp_path / "tokens").iterdir()) == []
    assert open_token_file(prepare_token_file(config, ByteTokenizer())).size == 1_001


# --- sampler ------------------------------------------------------------------------------------------------------


@pytest.fixture
def token_path(tmp_path):
    return prepare_token_file(
        DataConfig(synthetic_num_bytes=20_000, seq_len=32, cache_dir=str(tmp_path)), ByteTokenizer()
    )


def test_samples_are_a_pure_function_of_seed_step_and_index(token_path):
    sampler = TokenSampler(token_path, seq_len=32, seed=7)
    again = TokenSampler(token_path, seq_len=32, seed=7)
    tokens = np.asarray(open_token_file(token_path), dtype=np.int64)
    window = sampler.sample(3, 5)
    assert window.dtype == np.int64 and window.shape == (33,)
    np.testing.assert_array_equal(window, again.sample(3, 5))
    assert not np.array_equal(window, sampler.sample(4, 5))
    assert not np.array_equal(window, sampler.sample(3, 6))
    assert not np.array_equal(window, TokenSampler(token_path, seq_len=32, seed=8).sample(3, 5))
    for step in range(20):
        (start,) = sampler.offsets(step, [0])
        np.testing.assert_array_equal(sampler.sample(step, 0), tokens[start : start + 33])


def test_offsets_cover_all_valid_starts(token_path):
    sampler = TokenSampler(token_path, seq_len=32, seed=0)
    offsets = np.concatenate([sampler.offsets(step, range(64)) for step in range(200)])
    num_starts = sampler.num_tokens - 32
    assert offsets.min() >= 0 and offsets.max() < num_starts
    # Uniform: every tenth of the file gets close to a tenth of the samples.
    counts = np.bincount(offsets * 10 // num_starts, minlength=10)
    assert counts.min() > 0.8 * len(offsets) / 10


def test_rank_sample_indices_split_the_global_batch():
    blocks = [rank_sample_indices(rank=r, world_size=4, global_batch_size=16) for r in range(4)]
    assert blocks[1] == [4, 5, 6, 7]
    assert sorted(i for block in blocks for i in block) == list(range(16))
    with pytest.raises(ValueError, match="global_batch_size=10 must be a positive multiple of the 4"):
        rank_sample_indices(rank=0, world_size=4, global_batch_size=10)
    with pytest.raises(ValueError, match="rank=4"):
        rank_sample_indices(rank=4, world_size=4, global_batch_size=16)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_step_samples_do_not_depend_on_world_size(token_path, world_size):
    sampler = TokenSampler(token_path, seq_len=32, seed=1)
    whole = sampler.windows(11, range(8))
    assert whole.dtype == torch.int64 and whole.shape == (8, 33)
    parts = [
        sampler.windows(11, rank_sample_indices(rank=r, world_size=world_size, global_batch_size=8))
        for r in range(world_size)
    ]
    assert torch.equal(torch.cat(parts), whole)
    np.testing.assert_array_equal(whole[2].numpy(), sampler.sample(11, 2))


def test_sampler_refuses_windows_longer_than_the_file(token_path):
    with pytest.raises(ValueError, match="data.seq_len=50000 needs at least 50001 tokens"):
        TokenSampler(token_path, seq_len=50_000, seed=0)


# --- held-out data (eval.every) -----------------------------------------------------------------------------------


def held_out_job(tmp_path, *overrides):
    from omegaconf import OmegaConf

    from recipes.schema import JobConfig

    base = {"data": {"synthetic_num_bytes": 20_000, "seq_len": 32, "cache_dir": str(tmp_path)}, "eval": {"every": 5}}
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), base, *[OmegaConf.from_dotlist([o]) for o in overrides])
    return OmegaConf.to_object(merged)


def test_training_never_samples_the_held_out_tail_and_evaluation_samples_only_it(tmp_path):
    from recipes.data.sampler import held_out_start
    from recipes.evaluate import build_samplers, prepare_files

    job = held_out_job(tmp_path, "data.eval_fraction=0.1")
    files = prepare_files(job, ByteTokenizer())
    train, held_out = build_samplers(job, files)
    tokens = np.asarray(open_token_file(files.train), dtype=np.int64)
    start = held_out_start(len(tokens), fraction=0.1)
    assert start == len(tokens) - -(-len(tokens) // 10)
    trained = np.concatenate([train.offsets(step, range(64)) for step in range(100)])
    assert trained.max() + 33 <= start  # no training window reaches into the tail
    evaluated = held_out.offsets(0, range(64))
    np.testing.assert_array_equal(held_out.sample(0, 0), tokens[start + evaluated[0] : start + evaluated[0] + 33])
    # Evaluation off: training samples the whole file, exactly as before evaluation existed.
    plain, none = build_samplers(held_out_job(tmp_path, "eval.every=0"), files)
    assert none is None
    np.testing.assert_array_equal(
        plain.offsets(3, range(8)), TokenSampler(files.train, seq_len=32, seed=0).offsets(3, range(8))
    )


def test_packed_conversations_hold_out_their_last_rows(tmp_path):
    from recipes.evaluate import build_samplers, prepare_files

    job = held_out_job(tmp_path, "task.kind=sft", "data.seq_len=160", "data.eval_fraction=0.2")
    files = prepare_files(job, ByteTokenizer())
    train, held_out = build_samplers(job, files)
    rows = PackedSampler.count_rows(files.train)
    first_held = held_out.first_row
    assert 0 < first_held < rows and held_out.num_rows == rows - first_held and train.num_rows == first_held
    assert np.concatenate([train.rows(step, range(16)) for step in range(50)]).max() < first_held
    assert held_out.rows(0, range(16)).min() >= first_held


def test_eval_paths_are_prepared_as_their_own_file(tmp_path):
    from recipes.evaluate import build_samplers, prepare_files

    paths = [
        write(tmp_path / "train.txt", "the training text. " * 200),
        write(tmp_path / "valid.txt", "held out. " * 100),
    ]
    job = held_out_job(tmp_path, "data.source=text_files", f"data.paths=[{paths[0]}]", f"eval.paths=[{paths[1]}]")
    files = prepare_files(job, ByteTokenizer())
    assert files.held_out is not None and files.held_out != files.train
    train, held_out = build_samplers(job, files)
    assert train.num_tokens == len(open_token_file(files.train))  # all of the training file is trained on
    assert bytes(held_out.sample(0, 0)[:9].astype(np.uint8)) in b"held out. held out. "
