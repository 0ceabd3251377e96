"""`zerotrain prepare INPUT OUTDIR`: tokenize text (bytes, or a BPE trained here) into token files to train on."""

from __future__ import annotations

import argparse
import os
import shutil
import uuid

from zerotrain.cli.flags import checked
from zerotrain.config import BELOW_ONE
from zerotrain.data.corpus import prepare_corpus
from zerotrain.data.jsonl import is_records_file, prepare_jsonl, refuse_table
from zerotrain.data.documents import STDLIB, text_input
from zerotrain.data.tokenizer import parse_tokenizer_spec
from zerotrain.durable import check_writable_beside
from zerotrain.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text or records into token files (bytes, a local BPE, or a model's tokenizer)",
        description="INPUT is a UTF-8 text file (documents: blank-line separated paragraphs), a folder of text "
                    "files (documents: files), python-stdlib, or a .jsonl (.json, .parquet, .jsonl.gz, .jsonl.zst) "
                    "file of records or a folder of them (save_to_disk's, or Parquet shards; ShareGPT and Alpaca "
                    "records are read as messages) "
                    "({\"text\": ...}, "
                    "{\"prompt\": ..., \"completion\": ...}: only the completion is trained on, or {\"messages\": "
                    "[...]}: a chat in the tokenizer folder's chat template, its assistant turns trained on; through "
                    "train.mask / val.mask beside the tokens, and train.records / val.records: where each record "
                    "starts). Writes OUTDIR/train.bin and val.bin (llm.c layout: "
                    "uint16 tokens, or uint32 for vocabularies above 65536), meta.json and, for BPE, tokenizer.json. "
                    "Train on it with `zerotrain train --data OUTDIR`: the vocabulary and tokenizer come from it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("input", help="a UTF-8 text file, a folder of text files, python-stdlib, or a .jsonl, .json, "
                                     ".parquet, .jsonl.gz or .jsonl.zst file of records, or a save_to_disk or "
                                     "Parquet folder")
    p.add_argument("outdir", help="the folder to write (must not exist, or be empty, unless --overwrite)")
    p.add_argument("--tokenizer", default="bytes", help="bytes; bpe:N, a byte-level BPE of N ids trained on the "
                                                        "training documents; or PATH, a tokenizer.json or a model "
                                                        "folder holding one (nothing is downloaded)")
    p.add_argument("--val-fraction", type=checked(float, BELOW_ONE), default=0.05, help="fraction of documents held out for validation")
    p.add_argument("--glob", default="**/*.txt", help="which files of a folder INPUT are read")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template file to render chat records with, instead of the tokenizer folder's "
                        "own or TRL's training variant of it (which is chosen when TRL is installed and the folder's "
                        "template is one TRL knows)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTDIR if it holds files")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    try:
        parse_tokenizer_spec(args.tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.input != STDLIB and not os.path.exists(args.input):
        raise ConfigError(f"prepare {args.input}: no such file or folder (a UTF-8 text file, a folder, a .jsonl file of records, or {STDLIB})")
    out = os.path.normpath(args.outdir)
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not args.overwrite):
        raise ConfigError(f"prepare: {out} already exists and is not an empty folder (use --overwrite to replace it)")
    check_writable_beside(out, "prepare")  # written into a folder beside it, then renamed
    refuse_table(args.input, "prepare")
    records = is_records_file(args.input)
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise ConfigError(f"--chat-template {args.chat_template}: no such file (a Jinja chat template, as "
                          "chat_template.jinja holds one)")
    if args.chat_template and not records:
        raise ConfigError(f"--chat-template {args.chat_template}: renders chat records, and {args.input} is text, "
                          "not a file of records")
    source = None if records else text_input(args.input, args.glob, args.val_fraction)
    tmp = f"{out}.{uuid.uuid4().hex[:8]}.tmp"  # written whole, then renamed into place
    try:
        meta = prepare_jsonl(args.input, tmp, args.tokenizer, args.val_fraction, args.chat_template) if records else \
            prepare_corpus(source, tmp, args.tokenizer)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(prepared_line(out, meta))
    return 0


def _inside(split: dict) -> str:
    n = split.get("completions_inside_a_token")
    return f"; {n:,} training completions start inside a token that also holds the prompt's end (trained on: " \
           "a prompt that ends in a space or newline the tokenizer splits at avoids it)" if n else ""


def prepared_line(out: str, meta: dict) -> str:
    t, tr, va = meta["timings"], meta["train"], meta["val"]
    if meta.get("loss_mask"):
        bos = f", BOS id {meta['bos_ids'][0]} once per record" if meta.get("bos_ids") else ""
        source = meta["source"]
        chats = f"; {source['chats']:,} chats rendered with {source['template']['said']}" \
            if source.get("chats") and source.get("template") else ""
        return (f"zerotrain prepare: {source['input']} -> {out}: {meta['tokenizer']['kind']} tokenizer, vocab "
                f"{meta['vocab_size']} (end-of-text id {meta['eot_id']}{bos}); train {tr['record_count']:,} records, "
                f"{tr['tokens']:,} tokens of which {tr['trained_tokens']:,} trained on, the longest record "
                f"{tr['longest_record']:,} tokens; val {va['record_count']:,} records, {va['tokens']:,} tokens; "
                f"no record dropped or truncated (a run truncates a record longer than --seq-len + 1 tokens, and says "
                f"so){chats}{_inside(tr)}; {t['total_s']:.1f} s, {meta['tokens_per_s']:,} tokens/s")
    train_s = f", tokenizer training {t['tokenizer_train_s']:.1f} s" if "tokenizer_train_s" in t else ""
    return (f"zerotrain prepare: {meta['source']['input']} -> {out}: {meta['tokenizer']['kind']} tokenizer, vocab "
            f"{meta['vocab_size']} (end-of-text id {meta['eot_id']}); train {tr['tokens']:,} tokens "
            f"({tr['documents']} document{'s' * (tr['documents'] != 1)}), val {va['tokens']:,} tokens "
            f"({va['documents']} document{'s' * (va['documents'] != 1)}); "
            f"{t['total_s']:.1f} s, {meta['tokens_per_s']:,} tokens/s end to end (encoding {t['encode_s']:.1f} s"
            f"{train_s}, {meta['source']['text_bytes']:,} bytes of text)")
