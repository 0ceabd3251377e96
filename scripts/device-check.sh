#!/usr/bin/env bash
# The first thing to run on a new GPU machine: what does zerotrain's step do here? By default one measurement,
# scripts/device_check.py, in at most 8 minutes on one H100: a Llama-3.2-1B-shaped bf16 run at seq 4096 under
# torch.cuda.set_sync_debug_mode("warn") (host syncs per step), its tokens/s and MFU against a plain fully_shard +
# torch.compile loop on the same model, data and batch (the ratio), the attention kernel that ran, peak memory
# against the plan, a --deterministic pair (bitwise), a bf16 MoE step on the grouped path with the plan's check
# strict, and a DPO step: one table, and a failure when a sync count or a plan figure is out of bounds.
# ZT_PLUMBING=1 adds the earlier checks that zerotrain trains here, each one `zerotrain train` under its own time
# limit on tiny models: the process group and the step's collectives (NCCL), Llama in bf16, packed records
# (FlexAttention for heads of 16, compiled), chats with --init-from a local model folder, LoRA, activation
# checkpointing, --compile, and packed attention against each record alone; where 2 GPUs are visible, under NCCL:
# --zero 3, --tp 2, and a hang drill (a rank hangs; the job must fail within --timeout with one line naming the step
# and the collective, the line the rank's collective watchdog says: NCCL's waits are the stream's, not the CPU's).
#
# usage: scripts/device-check.sh OUTDIR
# Everything lands in OUTDIR (device-check.log, one folder per check; measure/device-check.json). A failed check is
# named and the others still run; the script exits 1 if any failed.
# ZT_DEVICE=cpu runs the same checks on the CPU (device_check.py --tiny; gloo for NCCL, 2 CPU ranks for the 2-GPU
# checks): a dry run of the script's plumbing on a machine without a GPU. ZT_FULL=1 adds the plumbing checks and the
# longer measurements (GPT-2 small throughput and MFU, what deterministic kernels cost, bench compare, async saves
# with a stop and a bitwise resume, bench ckpt, the drift digest's cost, the CUDA cases of the tests): 30 minutes
# more. ZT_PRESET (default gpt2) is their model. The chats and DPO checks need transformers (pip install
# 'zerotrain[hf]').
set -uo pipefail

OUT=${1:?usage: scripts/device-check.sh OUTDIR}
DEVICE=${ZT_DEVICE:-cuda}
PRESET=${ZT_PRESET:-gpt2}
GPUS=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null \
       || echo "no torch")
if [ "$DEVICE" = cuda ] && [ "$GPUS" = 0 -o "$GPUS" = "no torch" ]; then
    echo "device-check.sh: no CUDA device here ($([ "$GPUS" = 0 ] && echo "torch sees none" || echo "python has no torch")):" \
         "run it on a GPU machine, or rehearse the plumbing with ZT_DEVICE=cpu" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."  # the checkout: tests/ and scripts/ are read from it
exec > >(tee "$OUT/device-check.log") 2>&1

FAILED=()
check() {  # check TITLE SECONDS COMMAND...: a header, the command under a time limit, a failure named, not fatal
    local title=$1 limit=$2
    shift 2
    echo "== $title"
    timeout "$limit" "$@" || { echo "FAILED: $title"; FAILED+=("$title"); }
}
PYTEST=(python -m pytest -q -p no:cacheprovider)  # a test file's CUDA cases (its DEVICES) with its CPU ones

python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"

if [ "$DEVICE" = cuda ]; then
    check "measure: syncs per step, tokens/s and MFU against fully_shard + compile, attention kernel, peak memory \
against the plan, determinism, MoE grouped with the plan strict, DPO (one H100: 8 minutes at most)" 480 \
        python scripts/device_check.py --out "$OUT/measure"
else
    check "measure (the CPU rehearsal: device_check.py --tiny)" 600 python scripts/device_check.py --out "$OUT/measure" --tiny
fi

if [ "$DEVICE" = cuda ] && python -c "import fla.ops.gated_delta_rule" 2>/dev/null; then
    # fla's own arithmetic, which the CPU tests stand in for: a tiny Qwen3.5 linear-attention layer, packed records
    # and one row a record, through fla's kernels and through the torch path; the largest differences, relative to
    # the largest value of each (fp32 runs fla's dots in TF32). Fails only at a leak's size (0.05 of the output).
    check "Qwen3.5's Gated DeltaNet: flash-linear-attention's kernels against the torch path (fp32, bf16)" 240 \
        python - <<'PY'
import torch
from zerotrain.config import ModelConfig
from zerotrain.model import fused_delta_rule, qwen35
cfg = ModelConfig(arch="qwen3_5", n_embd=128, linear_key_heads=2, linear_value_heads=4, linear_key_width=64,
                  linear_value_width=64, linear_conv_kernel=4)
torch.manual_seed(0)
segments = torch.cat([torch.full((n,), i) for i, n in enumerate((100, 70, 130))]).expand(2, 300).cuda()
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    layer = qwen35.GatedDeltaNet(cfg).cuda().to(dtype)
    x = torch.randn(2, 300, 128, device="cuda", dtype=dtype)
    weights = torch.randn(2, 300, 128, device="cuda", dtype=dtype)
    for name, starts in (("one record a row", None), ("packed", qwen35.record_starts(segments))):
        runs = {}
        for kernel in ("torch", "fla"):
            fused_delta_rule.choose(kernel)
            xg = x.clone().requires_grad_()
            layer.zero_grad()
            y = layer(xg, None, 0, starts)
            (y.float() * weights.float()).sum().backward()
            runs[kernel] = [y.detach().float(), xg.grad.float(), layer.in_proj_qkv.weight.grad.float(),
                            layer.A_log.grad.float()]
        gaps = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(runs["fla"], runs["torch"])]
        print(f"{str(dtype)[6:]:9} {name:16} fla vs torch, max |difference| / max |value|: output {gaps[0]:.2e}, "
              f"input grad {gaps[1]:.2e}, in_proj_qkv grad {gaps[2]:.2e}, A_log grad {gaps[3]:.2e}")
        worst = max(worst, gaps[0])
raise SystemExit(worst > 0.05)
PY
elif [ "$DEVICE" = cuda ]; then
    echo "== Qwen3.5's Gated DeltaNet through flash-linear-attention skipped: the fla package is not installed here"
fi

if [ "${ZT_PLUMBING:-0}" = 1 ] || [ "${ZT_FULL:-0}" = 1 ]; then
TRAIN=(zerotrain train --device "$DEVICE" --steps 4 --micro-batch 2 --no-progress)
# Llama with heads of 16, the narrowest FlexAttention's CUDA kernels take (the tiny presets' 8 take the mask)
LLAMA16=(--preset llama-tiny --n-embd 64 --intermediate-size 128 --seq-len 64)

# The inputs, made here: records (bytes), and a tiny Llama folder with a BPE and ChatML's template with its chats
# (as the README's example builds it). Nothing is downloaded.
check "inputs: records.jsonl, chats.jsonl and a tiny instruct model folder" 120 python - "$OUT" <<'PY'
import json, os, sys

out = sys.argv[1]
with open(f"{out}/records.jsonl", "w") as f:
    for i in range(64):
        f.write(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}? ", "completion": f"It is {2 * i}."}) + "\n")
chats = [[{"role": "system", "content": "You answer with the sum."},
          {"role": "user", "content": f"What is {a} plus {b}?"},
          {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}] for a in range(1, 9) for b in (2, 5)]
with open(f"{out}/chats.jsonl", "w") as f:
    f.writelines(json.dumps({"messages": m}) + "\n" for m in chats)
try:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:
    sys.exit(f"the chats check needs transformers: pip install 'zerotrain[hf]' ({e})")
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.train_from_iterator([m["content"] for chat in chats for m in chat], trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                          pad_token="<|endoftext|>")
hf.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
folder = os.path.join(out, "tiny-instruct")
hf.save_pretrained(folder)
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  eos_token_id=hf.eos_token_id)
transformers.LlamaForCausalLM(config).save_pretrained(folder)
print(f"records, chats and {folder}")
PY

check "collective: the process group ($([ "$DEVICE" = cuda ] && echo NCCL || echo gloo)) and the step's collectives, GPT-2 tiny" 90 \
    "${TRAIN[@]}" --nproc 1 --preset tiny --data synthetic --out "$OUT/collective"
check "Llama: llama-tiny, bf16 parameters with fp32 masters" 90 \
    "${TRAIN[@]}" --nproc 1 --preset llama-tiny --precision bf16 --data synthetic --out "$OUT/llama"
check "packed records: each attends only to itself (FlexAttention on CUDA)" 120 \
    "${TRAIN[@]}" --nproc 1 "${LLAMA16[@]}" --data "$OUT/records.jsonl" --val-fraction 0 \
    --data-cache "$OUT/cache" --out "$OUT/packed"
check "chats and --init-from: the model folder's template, the assistant's turns trained" 120 \
    "${TRAIN[@]}" --nproc 1 --init-from "$OUT/tiny-instruct" --data "$OUT/chats.jsonl" --val-fraction 0 --lr 3e-3 \
    --ckpt-every 4 --data-cache "$OUT/cache" --out "$OUT/chats"
check "sample --chat from that run" 60 \
    zerotrain sample "$OUT/chats" --chat "What is 2 plus 3?" --system "You answer with the sum." --max-new-tokens 8
check "LoRA: adapters on the --init-from model" 120 \
    "${TRAIN[@]}" --nproc 1 --init-from "$OUT/tiny-instruct" --data "$OUT/chats.jsonl" --val-fraction 0 \
    --lora-rank 8 --data-cache "$OUT/cache" --out "$OUT/lora"
check "activation checkpointing: packed records, each block recomputed in the backward" 120 \
    "${TRAIN[@]}" --nproc 1 "${LLAMA16[@]}" --data "$OUT/records.jsonl" --val-fraction 0 --activation-checkpointing blocks \
    --data-cache "$OUT/cache" --out "$OUT/recompute"
check "--compile: packed records, the model and FlexAttention compiled together" 240 \
    "${TRAIN[@]}" --nproc 1 "${LLAMA16[@]}" --data "$OUT/records.jsonl" --val-fraction 0 --compile \
    --data-cache "$OUT/cache" --out "$OUT/compile"
check "packed attention: each record's loss and gradients equal the record alone, fp32 and bf16" 180 \
    python scripts/packed_attention_check.py "$DEVICE"

if [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
    check "--zero 3 on 2 ranks" 120 "${TRAIN[@]}" --nproc 2 --zero 3 --preset tiny --data synthetic --out "$OUT/zero3"
    check "--tp 2 on 2 ranks (Llama's 2 KV heads split)" 120 \
        "${TRAIN[@]}" --nproc 2 --tp 2 --preset llama-tiny --data synthetic --out "$OUT/tp2"
    # Rank 1 hangs before step 3's collectives: rank 0 must fail within --timeout 20 with one line naming the step
    # and the collective (on CUDA, the rank's collective watchdog's line), and the job exit 1.
    check "hang drill: a hung rank ends the job within --timeout, in one line naming step and collective" 120 \
        bash -c 'out=$(ZEROTRAIN_FAULTS=hang@step=3,rank=1 "$@" 2>&1); code=$?; echo "$out" | tail -n 3
                 [ "$code" = 1 ] && echo "$out" | grep -Eq "rank 0: collective [a-z_]+ at step 3 timed out after 20 s"' \
        hang "${TRAIN[@]}" --nproc 2 --steps 6 --timeout 20 --preset tiny --data synthetic --out "$OUT/hang"
else
    echo "== --zero 3, --tp 2 and the hang drill skipped: $GPUS CUDA device(s) here, NCCL needs one per rank"
fi

fi  # ZT_PLUMBING

if [ "${ZT_FULL:-0}" = 1 ]; then
    check "demo: 1 rank on $DEVICE, checkpoint, invariants, bitwise resume" 75 \
        zerotrain demo --device "$DEVICE" --nproc 1 --out "$OUT/demo"

    # Micro-batch 16 x 1024 tokens keeps the GPU busy; the drift check runs once, at the end.
    check "throughput: preset $PRESET, bf16 parameters with fp32 master, 30 steps" 110 \
        zerotrain train --device "$DEVICE" --nproc 1 --preset "$PRESET" --precision bf16 \
        --micro-batch 16 --steps 30 --check-every 0 --no-progress --out "$OUT/throughput"
    check "MFU of that run, and what deterministic kernels cost" 300 python - "$OUT" "$PRESET" <<'PY'
"""Tokens/s from the run's metrics; MFU = 6 * P * tokens/s over a bf16 matmul peak measured here."""
import json, os, statistics, sys, time

import torch

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import GPT

out, preset = sys.argv[1], sys.argv[2]
with open(f"{out}/throughput/metrics.jsonl") as f:
    records = [json.loads(line) for line in f if line.strip()]
tokens_per_s = statistics.median(r["tokens_per_s"] for r in records[len(records) // 3 :])  # past warm-up
with torch.device("meta"):  # shapes only: no memory, no init time
    P = sum(p.numel() for p in GPT(ModelConfig(**PRESETS[preset])).parameters())

device = "cuda" if torch.cuda.is_available() else "cpu"
n = 8192 if device == "cuda" else 1024
a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
for _ in range(3):
    a @ b
sync()
t0, reps = time.perf_counter(), 20
for _ in range(reps):
    a @ b
sync()
peak = reps * 2 * n**3 / (time.perf_counter() - t0)

model_flops = 6 * P * tokens_per_s  # forward + backward; attention's own FLOPs are not counted


def step_time(deterministic: bool) -> float:
    """Median forward + backward of the preset in bf16, with or without the deterministic settings ranks use."""
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, not deterministic
    cfg = ModelConfig(**PRESETS[preset])
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (8 if device == "cuda" else 2, cfg.seq_len), device=device)
    times = []
    for i in range(8):
        sync()
        t0 = time.perf_counter()
        model(idx).float().logsumexp(-1).mean().backward()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what --deterministic sets in each rank
free, strict = step_time(False), step_time(True)
result = {"preset": preset, "params": P, "tokens_per_s": tokens_per_s, "model_flops_per_s": model_flops,
          "bf16_matmul_peak_flops_per_s": peak, "matmul_size": n, "mfu": model_flops / peak,
          "step_s_nondeterministic": free, "step_s_deterministic": strict, "deterministic_cost": strict / free}
print(f"deterministic kernels (what bitwise resume and TP replicas need): forward + backward {strict * 1e3:.1f} ms "
      f"against {free * 1e3:.1f} ms without, {strict / free:.2f}x")
with open(f"{out}/throughput.json", "w") as f:
    json.dump(result, f, indent=1)
print(f"{preset}: P = {P:,}, {tokens_per_s:,.0f} tokens/s, {model_flops / 1e12:.1f} TFLOP/s of "
      f"{peak / 1e12:.1f} measured bf16 matmul peak: MFU {100 * model_flops / peak:.1f}%")
PY

    check "bench compare at world size 1" 110 zerotrain bench compare --quick --device "$DEVICE" --nproc 1 --out "$OUT/compare"
    check "bench compare --arch llama at world size 1" 110 \
        zerotrain bench compare --quick --arch llama --device "$DEVICE" --nproc 1 --out "$OUT/compare-llama"

    SAVES=(--device "$DEVICE" --nproc 1 --preset bench --steps 12 --ckpt-every 2 --async-save --no-progress)
    check "production: async saves from pinned staging, a SIGTERM stop at step 6" 60 \
        env ZEROTRAIN_FAULTS="sigterm@step=6" zerotrain train "${SAVES[@]}" --out "$OUT/stopped"
    check "its resume" 60 zerotrain train "${SAVES[@]}" --out "$OUT/stopped" --resume auto
    check "verify its checkpoints" 60 zerotrain verify "$OUT/stopped/checkpoints"
    check "an uninterrupted run" 60 zerotrain train "${SAVES[@]}" --out "$OUT/uninterrupted"
    check "bitwise resume: stopped + resumed == uninterrupted" 30 python - "$OUT" <<'PY'
"""Bitwise resume on the device: step 12's files (model and optimizer shard) equal, sha256 by sha256."""
import json, sys

def hashes(run):
    with open(f"{sys.argv[1]}/{run}/checkpoints/step_00000012/manifest.json") as f:
        return {e["name"]: e["sha256"] for e in json.load(f)["files"]}

stopped, whole = hashes("stopped"), hashes("uninterrupted")
differ = sorted(n for n in whole if stopped.get(n) != whole[n])
print("bitwise resume: " + ("stopped + resumed == uninterrupted at step 12, every file" if not differ else
                            f"FAILED: {differ} differ"))
sys.exit(1 if differ else 0)
PY
    check "bench ckpt" 60 zerotrain bench ckpt --quick --device "$DEVICE" --out "$OUT/ckpt"

    if [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
        check "tensor parallelism: demo --tp 2" 90 zerotrain demo --device "$DEVICE" \
            --nproc "$([ "$DEVICE" = cpu ] && echo 4 || echo 2)" --tp 2 --out "$OUT/tp/demo"
        # --overlap on: the default with CUDA (each unit's gather prefetched one unit ahead, on NCCL's stream)
        check "ZeRO-3 with the prefetch: demo --zero 3 on 2 ranks" 90 zerotrain demo --device "$DEVICE" --nproc 2 \
            --zero 3 --overlap on --out "$OUT/zero3/demo"
    else
        echo "== demo --tp 2 and --zero 3 on 2 ranks skipped: $GPUS CUDA device(s) here, NCCL needs one per rank"
    fi
    check "the drift digest's cost on the device" 60 python - "$DEVICE" "$PRESET" <<'PY'
"""The drift check's digest of GPT-2's parameter buffer on the device, against one bf16 training step."""
import sys, time

import torch

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.parallel.digest import tensor_digest

device, preset = sys.argv[1], sys.argv[2]
with torch.device("meta"):
    from zerotrain.model import GPT
    P = sum(p.numel() for p in GPT(ModelConfig(**PRESETS[preset])).parameters())
for dtype in (torch.float32, torch.bfloat16):
    flat = torch.randn(P, device=device).to(dtype)
    tensor_digest(flat)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        tensor_digest(flat)
    sync()
    print(f"digest of {P:,} {dtype} values on {device}: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms")
PY

    # The CUDA cases of the tests (each file's DEVICES): one line each.
    check "the loss sum stays on the GPU (no host sync per micro-batch, the same bits), micro-batches pinned and copied ahead" \
        120 "${PYTEST[@]}" tests/test_accumulate.py
    check "the gradient norm: the same bits at world sizes 1-5, on the GPU's reductions too" 90 "${PYTEST[@]}" tests/test_grad_norm.py
    check "packed records attend only to themselves (FlexAttention, compiled, with its backward), Llama's fp32 GQA \
    through a fused kernel, the block mask's memory against the T x T mask" 300 python scripts/packed_attention_check.py "$DEVICE"

fi

if [ ${#FAILED[@]} -gt 0 ]; then
    printf 'device check FAILED (%d): %s\n' "${#FAILED[@]}" "$(IFS=';'; echo "${FAILED[*]}")"
    exit 1
fi
echo "device check done: $OUT"
