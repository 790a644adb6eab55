"""Train the small byte-level BPE tokenizer of tests/golden/tokenizer/ and write the ids the
Python `tokenizers` package gives, for tests/tokenizer.rs to compare megac's against.

    pip install tokenizers==0.23.3
    python tests/golden/make_tokenizer.py

Writes tests/golden/tokenizer/{tokenizer.json, tokenizer_config.json, docs.txt, docs.jsonl,
ids.json}. The document rules are docs/data.md's ("Tokenized text"): a .txt file is split into
paragraphs at blank lines, a .jsonl file has one document per non-blank line (its `text`);
each document is encoded with the tokenizer's special tokens and followed by the EOS id.
"""

import json
import os

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "tokenizer")
CORPUS = os.path.join(ROOT, "..", "..", "examples", "data", "corpus.txt")
EOS = "<|endoftext|>"


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=[EOS, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([CORPUS], trainer)
    return tok


def blank(line):
    return line.strip(" \t\r") == ""


def txt_documents(text):
    """Runs of non-blank lines, joined with newlines (docs/data.md)."""
    docs, cur = [], []
    for line in text.split("\n"):
        line = line[:-1] if line.endswith("\r") else line
        if blank(line):
            if cur:
                docs.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    if cur:
        docs.append("\n".join(cur))
    return docs


def jsonl_documents(text):
    return [json.loads(l)["text"] for l in text.split("\n") if not blank(l)]


def stream(tok, docs, eos):
    ids = []
    for d in docs:
        e = tok.encode(d, add_special_tokens=True).ids
        ids.extend(e)
        if not e or e[-1] != eos:
            ids.append(eos)
    return ids


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = train()
    tok.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "model_max_length": 1024}, f, indent=2)
        f.write("\n")
    eos = tok.token_to_id(EOS)
    docs_txt = (
        "The quick brown fox jumps over the lazy dog.\n"
        "A second line of the first paragraph.\r\n"
        "\n"
        "  \t \n"
        "megac compiles model.toml into a plan: tensor, pipeline and data parallelism.\n"
        "\n"
        "Unicode: caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600 and <|endoftext|> inside.\n"
    )
    docs_jsonl = "\n".join(
        json.dumps(o, ensure_ascii=False)
        for o in [
            {"text": "Hello world, this is the first document."},
            {"id": 7, "text": "Second document\nwith two lines and caf\u00e9."},
            {"text": ""},
            {"text": "   leading spaces and trailing   "},
        ]
    ) + "\n\n"
    with open(os.path.join(OUT, "docs.txt"), "w", newline="") as f:
        f.write(docs_txt)
    with open(os.path.join(OUT, "docs.jsonl"), "w", newline="") as f:
        f.write(docs_jsonl)
    samples = [
        "Hello world",
        "megac compiles a model.toml into a plan",
        "  spaces   and\ttabs\nnewlines",
        "caf\u00e9 \u65e5\u672c\u8a9e \U0001F600",
        "<|endoftext|>two docs<|endoftext|>",
        "",
    ]
    corpus = open(CORPUS, encoding="utf-8").read()
    golden = {
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos": eos,
        "encode": [
            {"text": s, "ids": tok.encode(s, add_special_tokens=True).ids} for s in samples
        ],
        "decode": [
            {"ids": tok.encode(s).ids, "text": tok.decode(tok.encode(s).ids, skip_special_tokens=False)}
            for s in samples
        ],
        "docs_txt": stream(tok, txt_documents(docs_txt), eos),
        "docs_jsonl": stream(tok, jsonl_documents(docs_jsonl), eos),
        "corpus_txt_documents": len(txt_documents(corpus)),
        "corpus_txt_tokens": len(stream(tok, txt_documents(corpus), eos)),
        "corpus_txt_first_ids": stream(tok, txt_documents(corpus), eos)[:64],
    }
    with open(os.path.join(OUT, "ids.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
