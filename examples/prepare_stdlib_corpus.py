"""Write the Python standard library's sources into Megatron's indexed dataset format.

    python examples/prepare_stdlib_corpus.py out/data/stdlib [--max-mb 8]

One document per ``*.py`` file (sorted, as ``examples/train_gpt_mhc.py`` reads them), tokenised
as raw bytes 0..255 with end-of-document id 256, written with Megatron's own
``IndexedDatasetBuilder`` as ``PREFIX.bin`` / ``PREFIX.idx``. Train on it with Megatron's
``NullTokenizer`` (it ships with Megatron and needs no files):
``--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 257 --split 98,1,1``
(NullTokenizer's end-of-document id is ``vocab_size - 1`` = 256). Choose ``--split`` so that
every split gets at least one document: Megatron's GPT dataset builder loops without end on
an empty split (8 MB here is ~570 documents, so 98,1,1 gives 5 or 6 each to validation and
test; ``--max-mb 1`` is ~40 documents: use e.g. 90,5,5).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig

import numpy as np
import torch

# mhc_testing (the shared third-party warning filters) is test support kept in the repository,
# not in the installed package: import it from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

VOCAB_SIZE = 257  # bytes + end of document
EOD = VOCAB_SIZE - 1


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [p for p in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
            if "site-packages" not in p]


def write_corpus(prefix: str, max_bytes: int) -> tuple[int, int]:
    """Write ``prefix.bin/.idx``; returns (documents, tokens)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(VOCAB_SIZE))
    docs = tokens = 0
    for path in stdlib_files():
        with open(path, "rb") as fh:
            data = fh.read()
        if not data:
            continue
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        builder.add_item(torch.from_numpy(np.append(ids, EOD)))
        builder.end_document()
        docs, tokens = docs + 1, tokens + len(ids) + 1
        if tokens >= max_bytes:
            break
    builder.finalize(prefix + ".idx")
    return docs, tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="output path without extension")
    p.add_argument("--max-mb", type=float, default=8.0, help="bytes of source to write")
    args = p.parse_args(argv)
    from mhc_testing import warning_filters

    warning_filters.install()  # Megatron's notices about missing TE/Apex: not about data
    docs, tokens = write_corpus(args.prefix, int(args.max_mb * 1e6))
    print(f"wrote {args.prefix}.bin/.idx: {docs} documents, {tokens} tokens (bytes + EOD={EOD})")


if __name__ == "__main__":
    main()
