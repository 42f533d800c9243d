"""Documents from local text into a token file for ``TokenDataModule(pack_documents=True)``: each document's tokens,
then the end-of-document token. Text comes from a directory of ``.txt`` files (one document each), a JSON-lines file
(one document per line, under ``text_key``), a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (when
``datasets`` is installed), or any iterable of strings. The tokenizer is a local Hugging Face ``tokenizers`` file
(``tokenizer.json``, or a model directory holding one) or an object with ``encode``. Nothing is downloaded.

    path, eod = tokenize_documents("corpus/", "tokenizer.json", "tokens.bin")
    TokenDataModule(path=path, pack_documents=True, eod_token_id=eod, dtype="uint32" if big vocabulary)
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Optional, Union

import numpy as np

from lightning_moe.data import _DTYPES, write_tokens

EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def read_texts(source: Union[str, Iterable[str]], text_key: str = "text") -> Iterator[str]:
    """The documents of ``source``, in a fixed order."""
    if not isinstance(source, str):
        yield from source
        return
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "dataset_info.json")):
        try:
            import datasets
        except ImportError as e:
            raise ImportError(f"source {source!r} is a saved Hugging Face dataset: install `datasets` to "
                              "read it") from e
        for row in datasets.load_from_disk(source):
            yield row[text_key]
    elif os.path.isdir(source):
        for name in sorted(f for f in os.listdir(source) if f.endswith(".txt")):
            with open(os.path.join(source, name), encoding="utf-8") as f:
                yield f.read()
    elif source.endswith((".jsonl", ".json")):
        with open(source, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if text_key not in row:
                        raise ValueError(f"{source}:{n}: no {text_key!r} field (text_key) in {sorted(row)}")
                    yield row[text_key]
    else:
        raise ValueError(f"source: {source!r} is neither a directory of .txt files, a .jsonl file nor a saved dataset")


def load_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` path or a directory holding one; objects pass through."""
    if not isinstance(tokenizer, str):
        return tokenizer
    from tokenizers import Tokenizer
    path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json at {tokenizer!r}")
    return Tokenizer.from_file(path)


def _ids(tokenizer, text: str) -> list[int]:
    # no special tokens: a post-processor's [SEP] or </s> would end every document twice
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def _eod(tokenizer) -> Optional[int]:
    """The tokenizer's end-of-text token: its declared EOS (transformers), else the first of ``EOD_NAMES`` it knows
    (an unknown name must not come back as the unknown token's id)."""
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        return tokenizer.eos_token_id
    find = getattr(tokenizer, "token_to_id", None) or getattr(tokenizer, "convert_tokens_to_ids", None)
    unk = getattr(tokenizer, "unk_token_id", None)
    for name in EOD_NAMES if find else ():
        i = find(name)
        if isinstance(i, int) and i >= 0 and i != unk:
            return i
    return None


def tokenize_documents(source: Union[str, Iterable[str]], tokenizer, path: str, eod_token_id: Optional[int] = None,
                       dtype: str = "uint16", text_key: str = "text") -> tuple[str, int]:
    """Write every document of ``source`` tokenized, each followed by ``eod_token_id`` (default: the tokenizer's
    end-of-text token), to ``path``. Returns ``(path, eod_token_id)``."""
    tok = load_tokenizer(tokenizer)
    eod = _eod(tok) if eod_token_id is None else eod_token_id
    if eod is None:
        raise ValueError(f"eod_token_id: the tokenizer has none of {EOD_NAMES}; pass the end-of-document token id")
    top = np.iinfo(_DTYPES[dtype]).max
    chunks, docs = [], 0
    for text in read_texts(source, text_key):
        ids = _ids(tok, text)
        if ids and max(ids) > top or eod > top:
            raise ValueError(f"dtype={dtype!r} holds token ids up to {top}, the tokenizer gives {max(ids + [eod])}: "
                             "use dtype='uint32'")
        chunks.append(np.asarray(ids + [eod], dtype=np.int64))
        docs += 1
    if not docs:
        raise ValueError(f"source: {source!r} holds no documents")
    return write_tokens(path, np.concatenate(chunks), dtype), eod
