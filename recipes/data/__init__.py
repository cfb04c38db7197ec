"""Training data: sources, the synthetic corpus, cached token files and the deterministic sampler."""

from recipes.data.sampler import TokenSampler, rank_sample_indices
from recipes.data.sources import check_data_config, iter_texts
from recipes.data.synthetic import synthetic_text
from recipes.data.token_file import open_token_file, prepare_token_file

__all__ = [
    "TokenSampler",
    "check_data_config",
    "iter_texts",
    "open_token_file",
    "prepare_token_file",
    "rank_sample_indices",
    "synthetic_text",
]
