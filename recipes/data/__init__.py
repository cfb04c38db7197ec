"""Training data: sources, the synthetic corpora, cached token and packed files, and the deterministic samplers."""

from recipes.data.chat import check_conversation, iter_conversations
from recipes.data.packed import prepare_packed_file
from recipes.data.sampler import IGNORE_INDEX, Batch, PackedSampler, TokenSampler, rank_sample_indices
from recipes.data.sources import check_data_config, iter_texts
from recipes.data.synthetic import synthetic_text
from recipes.data.token_file import open_token_file, prepare_token_file

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "PackedSampler",
    "TokenSampler",
    "check_conversation",
    "check_data_config",
    "iter_conversations",
    "iter_texts",
    "open_token_file",
    "prepare_packed_file",
    "prepare_token_file",
    "rank_sample_indices",
    "synthetic_text",
]
