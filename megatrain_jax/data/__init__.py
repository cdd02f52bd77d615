"""Tokenizers, corpora, instruction data and batches."""

from megatrain_jax.data.corpus import STDLIB, read_documents, stdlib_files
from megatrain_jax.data.dataset import DataPosition, PackedDataset, pack
from megatrain_jax.data.packing import pack_rows, positions_from_segments
from megatrain_jax.data.instruct import (INSTRUCT_FORMATS, build_sequences,
                                         encode_conversation, read_conversations)
from megatrain_jax.data.tokenizer import ByteTokenizer, HFTokenizer
