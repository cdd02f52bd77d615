"""Tokenizer, corpora and packed batches."""

from megatrain_jax.data.corpus import STDLIB, read_documents, stdlib_files
from megatrain_jax.data.dataset import DataPosition, PackedDataset, pack
from megatrain_jax.data.tokenizer import ByteTokenizer
