"""``ntp-preprocess``: plain text (or JSON lines) → Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Tokenizes with the byte-level tokenizer (no download), appends the end-of-document token to each document
as Megatron's own preprocessing does with ``--append-eod``, and writes through Megatron-Core's
``IndexedDatasetBuilder``, so the training side reads it with the stock ``GPTDataset``. With no input it
uses the corpus shipped in the package.

    ntp-preprocess --output-prefix runs/data/corpus                # → runs/data/corpus_text_document.*
    ntp-preprocess --input my.txt --output-prefix out/my           # documents separated by 2 blank lines
    ntp-preprocess --input my.jsonl --output-prefix out/my         # JSON lines: key "text" (--json-key K)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "tiny_corpus.txt"
DOC_SEPARATOR = "\n\n\n"
DEFAULT_JSON_KEY = "text"
"""Megatron's ``tools/preprocess_data.py`` reads this key of each JSON line unless told otherwise."""


def looks_like_json_lines(path: Path) -> bool:
    """True when the first non-blank line of ``path`` is a JSON object (a ``.jsonl`` file, whatever its name)."""
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except json.JSONDecodeError:
                    return False
    return False


def read_documents(path: Path, json_key: Optional[str]) -> Iterator[str]:
    """Documents of a text file (separated by two blank lines) or of a JSON-lines file (``json_key``; detected
    and read with the key ``text`` when ``json_key`` is None, as Megatron's preprocessor does)."""
    if json_key is None and looks_like_json_lines(path):
        json_key = DEFAULT_JSON_KEY
    if json_key is not None:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise SystemExit(f"ntp-preprocess: {path}:{n}: not a JSON object with key {json_key!r} "
                                         "(--json-key names the key of the document text)") from None
        return
    for doc in path.read_text(encoding="utf-8").split(DOC_SEPARATOR):
        if doc.strip():
            yield doc.strip()


def build_indexed_dataset(inputs: Sequence[Path], output_prefix: str, json_key: Optional[str] = None,
                          vocab_size: int = 256) -> tuple[str, int, int]:
    """Write ``<output_prefix>_text_document.{bin,idx}``; returns (dataset prefix, documents, tokens)."""
    # torch and Megatron-Core (seconds to import) only when data is written, Megatron-Core after its warnings are
    # quieted: --help and a bad argument answer at once
    import numpy
    import torch

    from ntp_megatron.training.runtime import quiet_optional_dependency_warnings

    quiet_optional_dependency_warnings()
    # now Megatron-Core (see above)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "byte-level"}, vocab_size=vocab_size)
    prefix = f"{output_prefix}_text_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = numpy.uint16 if vocab_size <= 65536 else numpy.int32
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    docs = tokens = 0
    for path in inputs:
        for text in read_documents(path, json_key):
            ids = tokenizer.tokenize(text) + [tokenizer.eod]
            builder.add_document(torch.tensor(ids), [len(ids)])
            docs += 1
            tokens += len(ids)
    if docs == 0:
        raise SystemExit("ntp-preprocess: no documents in the input")
    builder.finalize(get_idx_path(prefix))
    return prefix, docs, tokens


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ntp-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=Path, action="append", default=None,
                   help=f"text or JSON-lines file; repeatable (default: the shipped corpus {SHIPPED_CORPUS.name})")
    p.add_argument("--json-key", default=None,
                   help=f"key of the document text in JSON lines (default: {DEFAULT_JSON_KEY!r}; a file whose first "
                        "line is a JSON object is read as JSON lines even without this flag)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_text_document.{bin,idx}")
    p.add_argument("--vocab-size", type=int, default=256, help="byte-level vocabulary size (≥ 256)")
    args = p.parse_args(argv)
    inputs = args.input or [SHIPPED_CORPUS]
    for path in inputs:
        if not path.is_file():
            print(f"ntp-preprocess: --input {path}: no such file", file=sys.stderr)
            return 2
    if args.vocab_size < 256:
        print(f"ntp-preprocess: --vocab-size must be ≥ 256, got {args.vocab_size}", file=sys.stderr)
        return 2
    prefix, docs, tokens = build_indexed_dataset(inputs, args.output_prefix, args.json_key, args.vocab_size)
    print(f"ntp-preprocess: wrote {prefix}.bin/.idx: {docs} documents, {tokens} tokens")
    print(f"train on it with: scripts/pretrain_gpt.sh --data-path {prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
