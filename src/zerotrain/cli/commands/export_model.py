"""`zerotrain export CKPT OUT --format hf|safetensors|peft`: write a trained model for other tools."""

from __future__ import annotations

import argparse
import os

from zerotrain.data.tokenizer import tokenizer_record
from zerotrain.data.tokenizer_config import model_facts
from zerotrain.config import Config
from zerotrain.errors import ConfigError
from zerotrain.hub.adapter import export_peft
from zerotrain.hub.export import FORMATS, CheckpointModel, check_destination, export_model, model_dtype
from zerotrain.hub.pretrained import load_from, locate, run_model_config, tokenizer_of
from zerotrain.hub.weight_shards import DEFAULT_SHARD_SIZE, DTYPES, parse_shard_size
from zerotrain.runtime.launch import run_job


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint as a Hugging Face folder of its family (GPT-2, Llama, Qwen, Mistral, "
                       "Phi-3, Gemma, Qwen-MoE, Mixtral, OLMoE, gpt-oss), as a peft adapter, or as bare safetensors",
        description="hf: a folder transformers' AutoModelForCausalLM.from_pretrained(OUT) loads (config.json, "
                    "model.safetensors) with tokenizer.json, tokenizer_config.json, special_tokens_map.json and "
                    "generation_config.json, which transformers.AutoTokenizer.from_pretrained(OUT) loads with "
                    "zerotrain's ids: a BPE's as trained, the bytes tokenizer's as an equivalent byte-level "
                    "tokenizer (transformers is not needed to write it). A run started with --init-from exports "
                    "its model's tokenizer configuration as the model had it (chat template, bos/eos/pad, "
                    "chat_template.jinja, generation_config.json) and the model's context length, not the training "
                    "window. safetensors: zerotrain's own state dict and a config.json. Either loads with "
                    "zerotrain.load_model(OUT). The weights are written in the model's dtype (--dtype), in shards of "
                    "--max-shard-size as save_pretrained cuts them (model-0000k-of-0000n.safetensors and "
                    "model.safetensors.index.json; one model.safetensors when they fit in one), by --nproc "
                    "processes. The checkpoint is verified first; the folder's modes follow the umask.")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, checkpoint root or run folder")
    p.add_argument("out", metavar="OUT", help="the folder to write (refused when it holds files, unless --overwrite)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="hf or safetensors (a LoRA run's with its adapters merged), or peft: a LoRA run's adapters "
                        "as adapter_config.json and adapter_model.safetensors, which "
                        "peft.PeftModel.from_pretrained(base, OUT) loads")
    p.add_argument("--overwrite", action="store_true", help="replace the exported files in a non-empty OUT")
    p.add_argument("--dtype", choices=(*DTYPES, "auto"), default="auto",
                   help="the weights' dtype; auto: the model's: a run from --init-from gives back its model's dtype "
                        "(config.json's dtype / torch_dtype), any other run the dtype it trained its parameters in "
                        "(bf16 for --precision bf16, else fp32)")
    p.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                   help="the largest weight file, as save_pretrained's max_shard_size: 5GB, 500MB, or bytes (a "
                        "larger tensor gets a file of its own); default %(default)s")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="processes writing the shards, each its own from the checkpoint's shards (a checkpoint of a "
                        "run that trained every weight); default %(default)s")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    check_destination(args.out, args.format, args.overwrite)  # before the checkpoint is read and verified
    parse_shard_size(args.max_shard_size)
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    source = locate(args.checkpoint)
    if args.format == "peft":
        written = export_peft(source, args.out)
        print(f"exported the adapters of step {source.manifest['step']} of {source.folder} as peft to {args.out}: "
              f"{', '.join(written)}")
        return 0
    dtype, why = model_dtype(source, args.dtype)
    lora = source.kind == "checkpoint" and (source.config or {}).get("lora", {}).get("lora_rank")
    if source.kind == "checkpoint" and not lora:  # read as it is written, from the shards, a tensor at a time
        model = CheckpointModel(source.folder, source.manifest, run_model_config(source))
    else:
        model = load_from(source)
    tokenizer = tokenizer_of(source.folder)
    bpe = tokenizer.kind == "bpe"
    step = source.manifest["step"] if source.manifest else None
    # what the checkpoint kept of an --init-from model (its context, special ids), on zerotrain's own record
    info = {**tokenizer_record(tokenizer), **model_facts(source.folder)}
    written = export_model(model, args.out, args.format, tokenizer_folder=source.folder if bpe else None,
                           eot_id=tokenizer.eot_id, tokenizer_info=info, config_folder=source.folder,
                           source={"path": os.path.abspath(source.folder), "step": step}, overwrite=args.overwrite,
                           dtype=dtype, max_shard_size=args.max_shard_size, nproc=args.nproc, launch=launch_export,
                           init_from=((source.manifest or {}).get("init_from") or {}).get("path"))
    what = f"step {step} of {source.folder}" if step is not None else source.folder
    print(f"exported {what} as {args.format} in {why} to {args.out}: {', '.join(written)}")
    return 0


def launch_export(job, nproc: int) -> None:
    """Run an export's `job` on nproc local processes on the CPU, each with its share of the cores, with no restart (a
    failed export is written again whole)."""
    cfg = Config()
    cfg.launch.nproc, cfg.launch.max_restarts = nproc, 0
    run_job(job, cfg)
