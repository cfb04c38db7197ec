"""Fine-tuning data: conversations checked, rendered in a chat template with only the assistant's tokens trained,
packed into rows whose conversations do not attend to each other, and sampled as a pure function of the step."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch

from launcher.compose import compose_job
from recipes.data import IGNORE_INDEX, PackedSampler, check_data_config, iter_conversations, prepare_packed_file
from recipes.model import build_model, packed_attention_masks
from recipes.schema import DataConfig
from recipes.tokenizer import ByteTokenizer, HFTokenizer
from tests.unit.test_tokenizer import save_trained_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Spell fox backwards."},
        {"role": "assistant", "content": "xof."},
        {"role": "user", "content": "And cat?"},
        {"role": "assistant", "content": "tac."},
    ],
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Red."}],
]
ANSWERS = ["4.", "xof.", "tac.", "Red."]

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_chats(path, chats=CHATS):
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return str(path)


def chat_config(tmp_path, **fields) -> DataConfig:
    paths = [write_chats(tmp_path / "chats.jsonl")]
    return DataConfig(source="chat", paths=paths, cache_dir=str(tmp_path / "cache"), **fields)


def trained_text(tokenizer, segments) -> list[str]:
    return [tokenizer.decode(ids) for ids, trained in segments if trained]


def test_the_byte_template_trains_the_assistant_content_and_its_end_only():
    tokenizer = ByteTokenizer()
    segments = tokenizer.chat_segments(CHATS[1])
    assert trained_text(tokenizer, segments) == ["xof.\n", "tac.\n"]
    assert [ids[-1] for ids, trained in segments if trained] == [tokenizer.eos_id] * 2
    everything = b"".join(bytes(i for i in ids if i != tokenizer.eos_id) for ids, _ in segments).decode()
    assert everything.startswith("<|system|>\nBe brief.\n<|user|>\nSpell fox backwards.\n<|assistant|>\n")


def test_a_hf_template_is_cut_at_the_generation_prompt(tmp_path):
    directory = save_trained_tokenizer(tmp_path / "tok")
    config_file = directory / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    tokenizer = HFTokenizer(directory)
    segments = tokenizer.chat_segments(CHATS[1])
    # The assistant's content and its end-of-turn marker are trained; the header the prompt ends with is not.
    assert [tokenizer._tokenizer.decode(ids) for ids, t in segments if t] == ["xof.<eos>", "tac.<eos>"]
    rendered = tokenizer._tokenizer.apply_chat_template(CHATS[1], tokenize=False)
    assert tokenizer._tokenizer.decode([i for ids, _ in segments for i in ids]) == rendered


def test_a_template_that_rewrites_earlier_turns_or_none_is_refused(tmp_path):
    directory = save_trained_tokenizer(tmp_path / "tok")
    tokenizer = HFTokenizer(directory)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer.chat_segments(CHATS[0])
    rewriting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer._tokenizer.chat_template = rewriting
    with pytest.raises(ValueError, match="does not render a conversation as the renderings of its beginnings"):
        tokenizer.chat_segments(CHATS[1])


def test_packing_masks_every_token_but_the_assistants(tmp_path):
    """The labels a step trains on decode to the assistants' answers and nothing else: were a user's or system's
    token counted, it would show here."""
    config = chat_config(tmp_path, seq_len=160)
    tokenizer = ByteTokenizer()
    sampler = PackedSampler(prepare_packed_file(config, tokenizer), seq_len=160, seed=0)
    assert sampler.meta["conversations"] == 3 and sampler.meta["truncated"] == 0 and sampler.meta["rows"] == 2
    seen = set()
    for step in range(20):
        batch = sampler.batch(step, range(4))
        for labels in batch.labels:
            text = bytes(int(t) for t in labels if t != IGNORE_INDEX and t != tokenizer.eos_id).decode()
            seen.update(piece for piece in text.split("\n") if piece)
            assert text.replace("\n", "") == "".join(a for a in ANSWERS if a in text)
    assert seen == set(ANSWERS)
    # The step's loss averages over exactly the targets its rows hold.
    step_labels = sampler.batch(3, range(4)).labels
    assert sampler.loss_tokens(3, global_batch_size=4) == int((step_labels != IGNORE_INDEX).sum())


def test_conversations_are_packed_first_fit_with_positions_restarting(tmp_path):
    tokenizer = ByteTokenizer()
    lengths = [sum(len(ids) for ids, _ in tokenizer.chat_segments(chat)) for chat in CHATS]
    seq_len = lengths[0] + lengths[1] - 1  # the first two fill a row of seq_len + 1 exactly
    directory = prepare_packed_file(chat_config(tmp_path, seq_len=seq_len), tokenizer)
    sampler = PackedSampler(directory, seq_len=seq_len, seed=0)
    assert sampler.meta["rows"] == 2
    first = sampler.positions[0].tolist()
    assert first == list(range(lengths[0])) + list(range(lengths[1]))
    second = sampler.positions[1].tolist()
    assert second[: lengths[2]] == list(range(lengths[2])) and second[lengths[2]] == 0  # padding starts anew
    assert not sampler.trained[1][lengths[2] :].any()


def test_a_conversation_longer_than_a_row_is_cut_and_counted(tmp_path):
    # The second conversation (109 tokens, its first answer from token 65 on) cut to 81 keeps its first answer;
    # cut to 45 it keeps none and is dropped.
    for seq_len, dropped, rows in ((80, 0, 3), (44, 1, 2)):
        meta = PackedSampler(
            prepare_packed_file(chat_config(tmp_path, seq_len=seq_len), ByteTokenizer()), seq_len=seq_len, seed=0
        ).meta
        assert (meta["truncated"], meta["dropped"], meta["rows"]) == (1, dropped, rows)


@pytest.mark.parametrize("recipe", ["tiny_llama", "tiny_gpt_oss"])
def test_packed_conversations_do_not_attend_to_each_other(recipe):
    """A conversation's logits are the same alone and packed after another one (the model is given position ids
    that restart, and attends within a conversation only): Llama with SDPA, GPT-OSS with eager attention, sliding
    windows and sinks."""
    tokenizer = ByteTokenizer()
    first, second = ([i for ids, _ in tokenizer.chat_segments(chat) for i in ids] for chat in CHATS[:2])
    torch.manual_seed(0)
    model = build_model(compose_job([f"recipe={recipe}"]).job.model).eval()
    packed = torch.tensor([first + second])
    positions = torch.tensor([list(range(len(first))) + list(range(len(second)))])
    masks = packed_attention_masks(model.config, positions)
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=positions, attention_mask=masks, use_cache=False).logits
        together = together[0, len(first) :]
        alone = model(input_ids=torch.tensor([second]), use_cache=False).logits[0]
        leaky = model(input_ids=packed, use_cache=False).logits[0, len(first) :]
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky, alone, atol=1e-3)  # without restarting positions it would attend across


def test_the_sample_of_a_step_is_a_pure_function_of_seed_step_and_index(tmp_path):
    directory = prepare_packed_file(DataConfig(cache_dir=str(tmp_path), seq_len=64), ByteTokenizer())
    sampler, again = (PackedSampler(directory, seq_len=64, seed=5) for _ in range(2))
    assert sampler.meta["rows"] > 100  # the built-in conversations
    whole = sampler.batch(7, range(8))
    halves = [again.batch(7, range(4)), again.batch(7, range(4, 8))]
    assert torch.equal(whole.input_ids, torch.cat([h.input_ids for h in halves]))
    assert torch.equal(whole.labels, torch.cat([h.labels for h in halves]))
    assert not torch.equal(whole.input_ids, sampler.batch(8, range(8)).input_ids)


@pytest.mark.parametrize("split", [None, "train"])
def test_conversations_come_from_a_local_dataset_directory(tmp_path, split):
    """A dataset `save_to_disk` wrote (one split, or a dict of splits), named by data.name."""
    import datasets

    dataset = datasets.Dataset.from_list([{"messages": chat, "id": i} for i, chat in enumerate(CHATS)])
    (datasets.DatasetDict({split: dataset}) if split else dataset).save_to_disk(str(tmp_path / "chats"))
    config = DataConfig(source="chat", name=str(tmp_path / "chats"))
    check_data_config(config, task="sft")
    assert list(iter_conversations(config)) == CHATS
    with pytest.raises(ValueError, match="is not a directory"):
        check_data_config(DataConfig(source="chat", name=str(tmp_path / "none")), task="sft")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"text": "hello"}], "row 1 has no 'messages' column"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "row 1: the conversation has no assistant turn"),
        ([{"messages": []}], "not a non-empty list"),
        ([{"messages": [{"role": "user"}]}], "message 1 is not"),
    ],
)
def test_bad_conversations_are_refused_with_their_row(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=message):
        list(iter_conversations(DataConfig(source="chat", paths=[str(path)])))


@pytest.mark.parametrize(
    ("source", "task", "message"),
    [
        ("chat", "pretrain", "add task=sft"),
        ("text_files", "sft", "task=sft trains on conversations"),
        ("hf_dataset", "lora", "task=lora trains on conversations"),
        ("synthetic", "finetune", "task.kind='finetune' is not one of"),
    ],
)
def test_the_task_and_its_data_must_agree(tmp_path, source, task, message):
    paths = [write_chats(tmp_path / "a.jsonl")] if source != "synthetic" else []
    with pytest.raises(ValueError, match=message):
        check_data_config(DataConfig(source=source, paths=paths), task=task)
