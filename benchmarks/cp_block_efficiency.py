"""How much of FlexAttention's block work is wasted on packed documents under context parallelism (CPU, no GPU).

FlexAttention computes every (128 x 128) block of queries x keys that holds an allowed pair: full blocks at full
cost, partial ones at full cost plus the mask. Under packed CP (``packed_context_parallel.py``) each document is cut
into 2·cp chunks of n / (2·cp) tokens and the keys come in rank-major order, so a document's keys lie in 2·cp places
and every chunk edge that does not fall on a 128 boundary adds partial blocks. This script builds rows as
``bench_model.py --pack-documents`` does (lognormal lengths, median ``--doc-median``, sigma 1, at least 16 tokens,
each padded to a multiple of 2·cp), and counts, per CP size and rank: the blocks computed, the allowed pairs, and
their ratio (the useful fraction of the attention's block work).

    python benchmarks/cp_block_efficiency.py --seq 65536 --cps 1,2,4 --rows 2
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

import common  # noqa: E402,F401  (puts the repo root on sys.path)
from lightning_moe.modules.packed_context_parallel import packed_order  # noqa: E402

BLOCK = 128


def packed_row(rng: np.random.Generator, seq: int, median: float, multiple: int) -> torch.Tensor:
    """(seq,) document ids: lognormal documents, each padded up to ``multiple``, the last one cut to fit the row."""
    ids, pos, doc = np.empty(seq, dtype=np.int64), 0, 0
    while pos < seq:
        n = max(16, int(rng.lognormal(np.log(median), 1.0)))
        n = min(-(-n // multiple) * multiple, seq - pos)
        ids[pos:pos + n] = doc
        pos, doc = pos + n, doc + 1
    return torch.from_numpy(ids)


def block_counts(doc_q: torch.Tensor, pos_q: torch.Tensor, doc_k: torch.Tensor, pos_k: torch.Tensor,
                 block: int = BLOCK) -> dict:
    """Blocks of ``block`` queries x ``block`` keys with an allowed pair (same document, key at or before the
    query): full and partial, and the allowed pairs. Queries and keys in the order attention sees them."""
    full = partial = allowed = 0
    nk = doc_k.numel() // block
    for i in range(0, doc_q.numel(), block):
        ok = (doc_q[i:i + block, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[i:i + block, None])
        per = ok.view(-1, nk, block).sum(dim=(0, 2))
        n = doc_q[i:i + block].numel() * block
        full += int((per == n).sum())
        partial += int(((per > 0) & (per < n)).sum())
        allowed += int(per.sum())
    return {"full_blocks": full, "partial_blocks": partial, "allowed_pairs": allowed,
            "useful_fraction": allowed / max(1, (full + partial) * block * block)}


def rank_counts(doc_S: torch.Tensor, cp: int, rank: int) -> dict:
    """One CP rank's attention blocks over one row (cp = 1: the whole row, causal within documents)."""
    if cp == 1:
        pos = torch.arange(doc_S.numel())
        return block_counts(doc_S, pos, doc_S, pos)
    order = packed_order(doc_S[None], cp)[0]  # every rank's row positions, rank-major: the keys' order
    s = doc_S.numel() // cp
    mine = order[rank * s:(rank + 1) * s]
    return block_counts(doc_S[mine], mine, doc_S[order], order)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--doc-median", type=float, default=4096.0)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    records = []
    for cp in (int(c) for c in args.cps.split(",")):
        rng = np.random.default_rng(args.seed)
        rows = [packed_row(rng, args.seq, args.doc_median, 2 * cp if cp > 1 else 1) for _ in range(args.rows)]
        per_rank = []
        for rank in range(cp):
            tot = {"full_blocks": 0, "partial_blocks": 0, "allowed_pairs": 0}
            for row in rows:
                c = rank_counts(row, cp, rank)
                for k in tot:
                    tot[k] += c[k]
            tot["useful_fraction"] = tot["allowed_pairs"] / max(1, (tot["full_blocks"] + tot["partial_blocks"])
                                                               * BLOCK * BLOCK)
            per_rank.append(tot)
        blocks = [r["full_blocks"] + r["partial_blocks"] for r in per_rank]
        records.append({"cp": cp, "rows": args.rows, "seq": args.seq, "per_rank": per_rank,
                        "blocks_busiest_rank": max(blocks), "blocks_all_ranks": sum(blocks),
                        "useful_fraction": sum(r["allowed_pairs"] for r in per_rank) / (sum(blocks) * BLOCK * BLOCK),
                        "partial_share": sum(r["partial_blocks"] for r in per_rank) / sum(blocks)})
        print(json.dumps(records[-1]), file=sys.stderr)
    print(json.dumps({"benchmark": "cp_block_efficiency", "doc_median": args.doc_median, "block": BLOCK,
                      "records": records}, indent=2))


if __name__ == "__main__":
    main()
