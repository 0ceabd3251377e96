"""Benchmark `zerotrain prepare` on a large JSON Lines file: peak RSS against the file size, tokens/s against the
tokenizers library's own batch encoding of the same texts on the same cores.

    python scripts/bench_prepare.py --mb 50 200 [--baseline-max-mb 50] [--dir /tmp/bench-prepare]

Each size: a JSON Lines file of prompt/completion and text records (made-up words, a BPE of 8192 ids trained on a
sample of them), prepared by `zerotrain prepare`'s prepare_jsonl in a process of its own (its own peak RSS, getrusage;
the CLI adds its imports, torch's among them, about 350 MB), then the same
records' texts (prompt + completion, or text) encoded with `Tokenizer.encode_batch` (--baseline) in batches of 4096 from
memory, in a process of its own (reading and JSON parsing not counted: the library's own speed). On a shared machine
the tokens per CPU second (getrusage, all threads) compare the work; tokens/s the wall time. prepare's tokens/s
are its own (meta.json: reading, parsing, encoding, writing; not the interpreter's start). Everything it
writes is deleted at the end.

    python scripts/bench_prepare.py --tool-calls 100000

A file of N chat records with tools (two function schemas), a tool call, its result and a final answer with
reasoning (OpenAI's shape), prepared with a tokenizer folder that knows Qwen3's special tokens and holds Qwen3's real
chat template (TRL's package's copy, so that its training variant renders them, as it would for Qwen3): tokens/s and
records/s of prepare, which here mostly measure the template's rendering (transformers' jinja2) and the check of what
it wrote. No baseline: the tokenizers library renders no template.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

PREPARE = r"""
import json, resource, sys
from zerotrain.data.jsonl import prepare_jsonl  # what `zerotrain prepare` runs, without the CLI's torch import
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
c0 = cpu()  # after the imports: the interpreter's start is not prepare's work
prepare_jsonl(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_s": cpu() - c0}))
"""
BASELINE = r"""
import json, resource, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
texts = []
for line in open(sys.argv[1], encoding="utf-8"):
    r = json.loads(line)
    texts.append(r["text"] if "text" in r else r["prompt"] + r["completion"])
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
t0, c0, tokens = time.perf_counter(), cpu(), 0
for i in range(0, len(texts), 4096):
    tokens += sum(len(e.ids) for e in getattr(tok, sys.argv[3])(texts[i:i + 4096], add_special_tokens=False))
print(json.dumps({"tokens": tokens, "s": time.perf_counter() - t0, "cpu_s": cpu() - c0}))
"""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


rng0 = random.Random(0)
VOCABULARY = ["".join(rng0.choice("etaoinshrdlcumwfgypbvk") for _ in range(rng0.randint(2, 9))) for _ in range(5000)]


def write_jsonl(path: str, megabytes: int) -> int:
    rng, size, records = random.Random(megabytes), 0, 0
    with open(path, "w") as f:
        while size < megabytes << 20:
            record = {"text": words(rng, rng.randint(50, 400))} if records % 4 == 0 else \
                {"prompt": words(rng, rng.randint(20, 120)) + "\n",
                 "completion": " " + words(rng, rng.randint(20, 200))}
            line = json.dumps(record) + "\n"
            f.write(line)
            size += len(line)
            records += 1
    return records


QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {what} in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}
         for name, what in (("get_weather", "weather"), ("get_time", "local time"))]


def write_tool_calls(path: str, n: int) -> None:
    rng = random.Random(n)
    with open(path, "w") as f:
        for i in range(n):
            tool = TOOLS[i % 2]["function"]["name"]
            city = words(rng, 1)
            f.write(json.dumps({"tools": TOOLS, "messages": [
                {"role": "user", "content": words(rng, rng.randint(8, 40)) + f" in {city}?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": tool, "arguments": {"city": city}}}]},
                {"role": "tool", "content": json.dumps({"city": city, "value": words(rng, rng.randint(3, 20))})},
                {"role": "assistant", "reasoning_content": words(rng, rng.randint(10, 80)),
                 "content": words(rng, rng.randint(10, 80))}]}) + "\n")


def qwen3_folder(folder: str) -> None:
    """A BPE of 8192 ids that knows Qwen3's special tokens, with Qwen3's chat template from TRL's package."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from zerotrain.data.templates import trl_folder

    rng = random.Random(1)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([words(rng, 200) for _ in range(2000)], trainer=trainers.BpeTrainer(
        vocab_size=8192, special_tokens=QWEN3_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    with open(os.path.join(trl_folder(), "qwen3.jinja"), encoding="utf-8") as f:
        hf.chat_template = f.read()
    hf.save_pretrained(folder)


def bench_tool_calls(n: int, where: str) -> None:
    folder, jsonl, out = (os.path.join(where, name) for name in ("qwen3", "tool-calls.jsonl", "out-tool-calls"))
    qwen3_folder(folder)
    write_tool_calls(jsonl, n)
    run = subprocess.run([sys.executable, "-c", PREPARE, jsonl, out, folder], check=True, capture_output=True,
                         text=True)
    usage = json.loads(run.stdout.splitlines()[-1])
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    trained = meta["train"]["trained_tokens"] + meta["val"]["trained_tokens"]
    print(json.dumps({"records": n, "file_mb": round(os.path.getsize(jsonl) / 2**20, 1), "tokens": tokens,
                      "trained_tokens": trained, "prepare_s": meta["timings"]["total_s"],
                      "prepare_tokens_per_s": meta["tokens_per_s"],
                      "records_per_s": round(n / meta["timings"]["total_s"]),
                      "prepare_tokens_per_cpu_s": round(tokens / usage["cpu_s"]),
                      "prepare_peak_rss_mb": round(usage["peak_rss_mb"]),
                      "template": meta["source"]["template"]["said"]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tool-calls", type=int, default=0, metavar="N",
                   help="instead: N chat records with tools, a tool call, its result and reasoning, in Qwen3's template")
    p.add_argument("--mb", type=int, nargs="+", default=[50, 200])
    p.add_argument("--dir", default="/tmp/bench-prepare")
    p.add_argument("--baseline-max-mb", type=int, default=None, help="compare with encode_batch only up to this size")
    p.add_argument("--baseline", choices=("encode_batch", "encode_batch_fast"), default="encode_batch",
                   help="the library's call to compare with: encode_batch (the issue's target; offsets computed, as "
                        "prepare needs them for prompt/completion boundaries) or encode_batch_fast (no offsets)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        if args.tool_calls:
            bench_tool_calls(args.tool_calls, args.dir)
            return
        from zerotrain.data.tokenizer import train_bpe

        rng = random.Random(1)
        folder = os.path.join(args.dir, "tokenizer")
        os.makedirs(folder, exist_ok=True)
        train_bpe([words(rng, 200) for _ in range(2000)], 8192).save(os.path.join(folder, "tokenizer.json"))
        for mb in args.mb:
            jsonl = os.path.join(args.dir, f"data-{mb}.jsonl")
            records = write_jsonl(jsonl, mb)
            out = os.path.join(args.dir, f"out-{mb}")
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", PREPARE, jsonl, out, folder], check=True, capture_output=True,
                                 text=True)
            prepare_s = time.perf_counter() - t0
            usage = json.loads(run.stdout.splitlines()[-1])  # of the prepare process alone
            with open(os.path.join(out, "meta.json")) as f:
                meta = json.load(f)
            tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
            row = {"file_mb": round(os.path.getsize(jsonl) / 2**20, 1), "records": records, "tokens": tokens,
                   "process_s": round(prepare_s, 1), "prepare_s": meta["timings"]["total_s"],
                   "prepare_tokens_per_s": meta["tokens_per_s"], "prepare_peak_rss_mb": round(usage["peak_rss_mb"]),
                   "prepare_tokens_per_cpu_s": round(tokens / usage["cpu_s"])}
            if args.baseline_max_mb is None or mb <= args.baseline_max_mb:
                base = json.loads(subprocess.run([sys.executable, "-c", BASELINE, jsonl, os.path.join(
                    folder, "tokenizer.json"), args.baseline], check=True, capture_output=True, text=True).stdout)
                row["baseline"] = args.baseline
                row["baseline_tokens_per_s"] = round(base["tokens"] / base["s"])
                row["ratio"] = round(meta["tokens_per_s"] / row["baseline_tokens_per_s"], 2)
                row["baseline_tokens_per_cpu_s"] = round(base["tokens"] / base["cpu_s"])
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
            os.remove(jsonl)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
