"""Reference samples from megatron-core's GPTDataset and BlendedDataset, for tests/megatron_data.rs.

    pip install megatron-core==0.16.1 tokenizers==0.23.3 torch numpy
    python tests/golden/megatron_data.py

Builds two small Megatron indexed datasets the way Megatron-LM's tools/preprocess_data.py does
(one sequence per document, the EOD id appended: --append-eod), from the paragraphs of
examples/data/corpus.txt tokenized with tests/golden/tokenizer/tokenizer.json:

  tests/golden/megatron/a.{bin,idx}  paragraphs 0..40, dtype uint16 (DType.optimal_dtype(384))
  tests/golden/megatron/b.{bin,idx}  paragraphs 40..60, dtype int32

and writes tests/golden/megatron/reference.json: for each case (a single dataset, its valid
split, a 0.3/0.7 blend) the config, the document, sample and shuffle indices (blends: the
dataset and dataset-sample indices), the tokens of the first samples and a checksum of every
sample, all as megatron-core computes them. Nothing here reimplements Megatron's logic: the
indices and samples are read from megatron-core's own objects.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy
import torch

import megatron.core
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tokenizer import txt_documents  # noqa: E402  (the paragraph rule of docs/data.md)

ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "megatron")
CORPUS = os.path.join(ROOT, "..", "..", "examples", "data", "corpus.txt")
TOKENIZER = os.path.join(ROOT, "tokenizer", "tokenizer.json")
SEED = 1234
SEQ = 32
FIRST = 24  # samples whose tokens are written out in full


class Tok:
    """What GPTDatasetConfig reads of a tokenizer (no pad token: megatron-core's default -1)."""

    vocab_size = 384
    eod = 0
    unique_identifiers = {"class": "Tok", "vocab_size": 384}


def write_dataset(prefix, docs, dtype, tok, eod):
    """preprocess_data.py's Encoder.encode + IndexedDatasetBuilder.add_document."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for text in docs:
        ids = tok.encode(text).ids + [eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")


def checksum(tokens):
    """sum((position + 1) * token) over the sample's seq_len + 1 tokens."""
    return int(sum((i + 1) * int(t) for i, t in enumerate(tokens)))


def sample_tokens(ds, i):
    """The seq_len + 1 tokens of sample i (GPTDataset: tokens = text[:-1], labels = text[1:])."""
    item = ds[i]
    return [int(t) for t in item["tokens"]] + [int(item["labels"][-1])]


def config(blend, split):
    return GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=get_blend_from_list(blend.split()),
        split=split,
        path_to_cache=None,
        mmap_bin_files=True,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        add_extra_token_to_sequence=True,
    )


def gpt_case(name, ds, num_samples, extra):
    assert isinstance(ds, GPTDataset)
    return {
        "name": name,
        **extra,
        "num_samples": num_samples,
        "len": len(ds),
        "document_index": [int(x) for x in ds.document_index],
        "sample_index": [[int(a), int(b)] for a, b in ds.sample_index],
        "shuffle_index": [int(x) for x in ds.shuffle_index],
        "first_samples": [sample_tokens(ds, i) for i in range(min(FIRST, len(ds)))],
        "checksums": [checksum(sample_tokens(ds, i)) for i in range(len(ds))],
    }


def main():
    tok = Tokenizer.from_file(TOKENIZER)
    eod = tok.token_to_id("<|endoftext|>")
    assert eod == Tok.eod
    docs = txt_documents(open(CORPUS, encoding="utf-8").read())
    os.makedirs(OUT, exist_ok=True)
    work = tempfile.mkdtemp()
    try:
        write_dataset(os.path.join(work, "a"), docs[0:40], DType.optimal_dtype(Tok.vocab_size), tok, eod)
        write_dataset(os.path.join(work, "b"), docs[40:60], numpy.int32, tok, eod)
        for f in ["a.bin", "a.idx", "b.bin", "b.idx"]:
            shutil.copy(os.path.join(work, f), os.path.join(OUT, f))
        a, b = os.path.join(work, "a"), os.path.join(work, "b")
        cases = []

        # One dataset: --data-path a --split 90,10,0, train_samples 300 and 450 (the final epoch
        # is shuffled separately) and 320 (it is not), valid 40.
        split = "90,10,0"
        for train in [300, 320, 450]:
            built = BlendedMegatronDatasetBuilder(
                GPTDataset, [train, 40, None], lambda: True, config(a, split)
            ).build()
            cases.append(
                gpt_case(
                    f"single-{train}",
                    built[0],
                    train,
                    {"data": "a", "split": split, "split_index": 0, "seq_length": SEQ, "seed": SEED},
                )
            )
            if train == 300:
                cases.append(
                    gpt_case(
                        "single-valid",
                        built[1],
                        40,
                        {"data": "a", "split": split, "split_index": 1, "seq_length": SEQ, "seed": SEED},
                    )
                )

        # A blend: --data-path 0.3 a 0.7 b, train_samples 200 (valid and test: 0).
        blend = f"0.3 {a} 0.7 {b}"
        built = BlendedMegatronDatasetBuilder(
            GPTDataset, [200, 0, 0], lambda: True, config(blend, split)
        ).build()
        bd = built[0]
        cases.append(
            {
                "name": "blend",
                "data": "0.3 a 0.7 b",
                "split": split,
                "split_index": 0,
                "seq_length": SEQ,
                "seed": SEED,
                "num_samples": 200,
                "len": len(bd),
                "weights": [float(w) for w in bd.weights],
                "dataset_num_samples": [int(d.num_samples) for d in bd.datasets],
                "dataset_lens": [len(d) for d in bd.datasets],
                "dataset_index": [int(x) for x in bd.dataset_index],
                "dataset_sample_index": [int(x) for x in bd.dataset_sample_index],
                "first_samples": [
                    [int(t) for t in bd[i]["tokens"]] + [int(bd[i]["labels"][-1])]
                    for i in range(FIRST)
                ],
                "checksums": [
                    checksum([int(t) for t in bd[i]["tokens"]] + [int(bd[i]["labels"][-1])])
                    for i in range(len(bd))
                ],
            }
        )
        ref = {
            "megatron_core_version": megatron.core.__version__,
            "numpy_version": numpy.__version__,
            "config": {
                "random_seed": SEED,
                "sequence_length": SEQ,
                "add_extra_token_to_sequence": True,
                "reset_position_ids": False,
                "reset_attention_mask": False,
                "eod_mask_loss": False,
                "mmap_bin_files": True,
                "mid_level_dataset_surplus": 0.005,
            },
            "cases": cases,
        }
        with open(os.path.join(OUT, "reference.json"), "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
