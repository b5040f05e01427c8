"""``unbroken tokenise``: the command line of `unbroken.data.tokenise`."""

from __future__ import annotations

import argparse
import os
import sys

from unbroken.data.files import DataFileError, TokenFile
from unbroken.data.tokenise import load_tokenizer, tokenise

OK, DAMAGED, USAGE = 0, 1, 2


def add_parser(sub: argparse._SubParsersAction, epilog: str) -> None:
    summary = "tokenise a corpus once into a memory-mapped token file (or --verify one)"
    p = sub.add_parser(
        "tokenise",
        aliases=["tokenize"],
        help=summary,
        description=f"{summary}. Inputs by extension: .txt (one document per file), .jsonl, "
        ".parquet, .arrow (the last two need pyarrow: pip install 'unbroken[data]').",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="corpus files (with --verify: token files)")
    p.add_argument("-o", "--out", help="the token file to write (its sidecar: OUT.json)")
    p.add_argument(
        "--tokenizer", default="bytes", help="'bytes' (default: UTF-8 bytes, 257 ids) or the "
        "path of a Hugging Face tokenizer.json"
    )  # fmt: skip
    p.add_argument("--field", default="text", help="JSONL key / Parquet column (text)")
    p.add_argument("--eos", type=int, help="id after each document (bytes: 256)")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="default: from the vocabulary")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--verify", action="store_true", help="check the checksums of token files")
    p.set_defaults(func=run)


def run(opts: argparse.Namespace) -> int:
    try:
        if opts.verify:
            return _verify(opts.inputs)
        if not opts.out:
            raise DataFileError("say where the token file goes: -o OUT")
        if os.path.exists(opts.out) and not opts.force:
            raise DataFileError(f"{opts.out} already exists; pass --force to overwrite it")
        done = tokenise(
            opts.inputs,
            opts.out,
            load_tokenizer(opts.tokenizer),
            field=opts.field,
            eos=opts.eos,
            dtype=opts.dtype,
        )
    except DataFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE
    print(
        f"wrote {done.tokens:,} tokens from {done.documents:,} documents to {done.path} "
        f"in {done.seconds:.1f} s"
    )
    return OK


def _verify(paths: list[str]) -> int:
    bad = 0
    for path in paths:
        try:
            f = TokenFile.open(path)
            f.verify()
        except DataFileError as e:
            print(f"DAMAGED {e}", file=sys.stderr)
            bad += 1
        else:
            print(f"OK {path}: {f.count:,} {f.dtype} tokens, checksum matches")
    return DAMAGED if bad else OK
