"""Local text to packed documents: a tokenizer built here (Hugging Face ``tokenizers``, nothing downloaded) turns a
directory of text files and a JSON-lines file into token files whose documents are the texts, each ended by the
tokenizer's end-of-text token; the data module packs them with attention kept inside each."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_moe.data import TokenDataModule
from lightning_moe.documents import document_spans
from lightning_moe.tokenize_documents import tokenize_documents

TEXTS = ["the cat sat on the mat", "a dog ran", "the dog and the cat sat on a mat on the mat", "ran"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return tok, str(path)


def test_directory_and_jsonl_become_documents(tmp_path, tokenizer):
    tok, tok_path = tokenizer
    (tmp_path / "docs").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(t)
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS)
    eod_id = tok.token_to_id("<|endoftext|>")
    for source in (str(tmp_path / "docs"), str(tmp_path / "docs.jsonl")):
        path, eod = tokenize_documents(source, tok_path, str(tmp_path / "t.bin"))
        assert eod == eod_id
        toks = np.fromfile(path, dtype=np.uint16)
        starts, lengths = document_spans(toks, eod)
        decoded = [tok.decode(toks[s:s + n - 1].tolist()) for s, n in zip(starts, lengths)]
        assert decoded == TEXTS
    dm = TokenDataModule(path=path, seq_length=8, batch_size=2, pack_documents=True, eod_token_id=eod)
    batch = next(iter(dm.train_dataloader()))
    assert batch["document_ids"].max() >= 1  # rows hold several documents


def test_refusals(tmp_path, tokenizer):
    _, tok_path = tokenizer
    with pytest.raises(ValueError, match="source: .* holds no documents"):
        tokenize_documents([], tok_path, str(tmp_path / "t.bin"))
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'text' field"):
        tokenize_documents(str(tmp_path / "bad.jsonl"), tok_path, str(tmp_path / "t.bin"))
    with pytest.raises(FileNotFoundError, match="tokenizer: no tokenizer.json"):
        tokenize_documents(TEXTS, str(tmp_path / "nowhere"), str(tmp_path / "t.bin"))
