"""`zerotrain eval CKPT`: validation loss, perplexity and bits per byte of a trained model."""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from zerotrain.cli.flags import checked
from zerotrain.config import POSITIVE, Config, is_mixture
from zerotrain.data import IGNORE, check_source, make_source
from zerotrain.data.mixture import mixture_weights, source_config
from zerotrain.data.resolve import SYNTHETIC, validation_files
from zerotrain.data.tokenfiles import open_token_file
from zerotrain.errors import ConfigError
from zerotrain.hub.pretrained import load_from, locate, tokenizer_of
from zerotrain.training.evaluate import summed_loss, validation_sequences


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="validation loss, perplexity and bits per byte of a checkpoint",
        description="Evaluates the model on validation batches 0..N-1 of the data source (by default the one the "
                    "checkpoint was trained on), each of the run's global micro-batch (ranks x micro-batch "
                    "sequences): the batches training's --eval-every reports as val_loss. Prints one line on stdout: "
                    "val_loss (nats per token), perplexity = exp(val_loss) and bits_per_byte = val_loss / ln 2 x "
                    "tokens / UTF-8 bytes of the evaluated tokens (1 byte per token for the byte tokenizer).")
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint folder, checkpoint root, run folder or exported "
                                                     "folder (an exported one needs --data)")
    p.add_argument("--data", default=None,
                   help="held-out data to evaluate on, as train's --data: a file or text folder is evaluated whole, a "
                        "prepared folder by its validation split if it has one (default: the validation split of "
                        "the data the checkpoint was trained on; of a mixture, each source's, as training reports "
                        "source_val_loss, and their mean by the mixture's weights)")
    p.add_argument("--batches", type=checked(int, POSITIVE), default=20, help="validation batches (default: %(default)s)")
    p.add_argument("--batch-size", type=checked(int, POSITIVE), default=None,
                   help="sequences per batch (default: the run's DP replicas x micro-batch, as training evaluated)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    source = locate(args.checkpoint)
    model, tokenizer = load_from(source), tokenizer_of(source.folder)
    cfg = _data_config(source, model, tokenizer, args.data)
    batch = args.batch_size or cfg.dp * cfg.loop.micro_batch
    if args.data is None and is_mixture(cfg.data.source):
        # each source's validation split on its own, as training's source_val_loss; the mixture's by its weights
        weights = mixture_weights(cfg)
        total = sum(weights.values())
        mean = 0.0
        for name, weight in weights.items():
            loss = _evaluate_one(model, tokenizer, source_config(cfg, name), None, args.batches, batch)
            mean += weight / total * loss
        print(f"val_loss {mean:.6f}  perplexity {math.exp(mean):.6g}  (the mixture: each source's val_loss above, "
              f"weighted {', '.join(f'{name}:{w / total:g}' for name, w in weights.items())})")
        return 0
    _evaluate_one(model, tokenizer, cfg, args.data, args.batches, batch)
    return 0


def _evaluate_one(model, tokenizer, cfg: Config, data: str | None, batches: int, batch: int) -> float:
    """Evaluate on one source and print its line: val_loss, perplexity, bits per byte; returns the val_loss."""
    _check_held_out(cfg, data)
    loss_sum, tokens, nbytes = evaluate(model, make_source(cfg, split="val", global_batch=batch), batches, batch,
                                        cfg.loop.micro_batch, tokenizer)
    if tokens == 0:
        raise ConfigError(f"{batches} batches of {cfg.data.source} hold no target tokens")
    loss = loss_sum / tokens
    bpb = loss / math.log(2) * tokens / nbytes
    print(f"val_loss {loss:.6f}  perplexity {math.exp(loss):.6g}  bits_per_byte {bpb:.6f}  "
          f"({tokens:,} tokens, {nbytes:,} bytes: {batches} batches x {batch} sequences of {cfg.data.source}, "
          f"{'validation split' if data is None else 'held out'})")
    return loss


def _data_config(source, model, tokenizer, data: str | None) -> Config:
    """The run's config with --data applied (an exported model has none: defaults, its model, --data), checked.

    The data must fit the model's vocabulary and, where its folder names a tokenizer, be the model's.
    """
    if source.config is not None:
        cfg = Config.from_dict(source.config)
    elif data is None:
        raise ConfigError(f"eval {source.folder}: an exported model records no training data; pass --data")
    else:
        cfg = Config()
        cfg.model = dataclasses.replace(model.cfg)
    if data is not None:
        cfg.data.source = data
        # a file given here is held out as a whole: its validation split is all of it (train's --val-data PATH)
        cfg.data.val_data = None if data in SYNTHETIC else data
        cfg.data.val_fraction = 0.0  # prepared once, as --data and as validation data alike
    cfg.loop.eval_every = 0  # training's own demand for validation tokens; _check_held_out says it in eval's words
    spec = check_source(cfg, vocab_given=True)
    theirs = spec.tokenizer
    if theirs and (theirs.get("kind"), theirs.get("vocab_size")) != (tokenizer.kind, tokenizer.vocab_size):
        raise ConfigError(f"--data {cfg.data.source} is tokenized as {theirs.get('kind')} with {theirs.get('vocab_size')} "
                          f"ids, the model's tokenizer is {tokenizer.kind} with {tokenizer.vocab_size}")
    return cfg


def _check_held_out(cfg: Config, data: str | None) -> None:
    """Refuse, in eval's own words, data with no validation tokens: a run that set none aside (--val-fraction 0, a
    single document) asks for held-out data through --data."""
    if cfg.data.source in SYNTHETIC:
        return
    paths, _ = validation_files(cfg)
    if any(len(open_token_file(p)) for p in paths):
        return
    if data is None:
        raise ConfigError(f"the data this checkpoint was trained on, {cfg.data.source}, set no validation tokens "
                          "aside (trained with --val-fraction 0, or on a single document): evaluate on held-out data "
                          "with --data PATH")
    raise ConfigError(f"--data {data} holds no tokens to evaluate")


def evaluate(model, source, batches: int, batch: int, micro_batch: int, tokenizer) -> tuple[float, int, int]:
    """(summed token loss, target tokens, their UTF-8 bytes) over validation batches 0..batches-1 of `batch` sequences.

    The bytes of BPE tokens are those of each sequence's targets decoded together, so a character
    split over several tokens counts once; an end-of-text token counts one byte, as the byte
    tokenizer's (its NUL), not the 13 of the text `<|endoftext|>` it decodes to.
    """
    nbytes = 0

    def count_bytes(y: torch.Tensor) -> None:
        nonlocal nbytes
        if tokenizer.kind == "bytes":
            nbytes += int((y != IGNORE).sum())
        else:
            nbytes += sum(utf8_bytes(tokenizer, row[row != IGNORE].tolist()) for row in y)

    sequences = validation_sequences(source, batches, batch=batch, micro_batch=micro_batch)
    loss_sum, tokens = summed_loss(model, sequences, on_targets=count_bytes)
    return loss_sum, tokens, nbytes


def utf8_bytes(tokenizer, ids: list[int]) -> int:
    """UTF-8 bytes of the text `ids` decode to, each end-of-text token counted as one byte."""
    total, run = 0, []
    for i in ids + [tokenizer.eot_id]:
        if i == tokenizer.eot_id:
            total += len(tokenizer.decode(run).encode("utf-8")) + 1
            run = []
        else:
            run.append(i)
    return total - 1  # the eot appended to close the last run
