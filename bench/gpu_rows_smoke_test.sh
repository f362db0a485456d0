#!/usr/bin/env bash
# The benchmarks' GPU rows run end to end (in CI on the CUDA emulation, on
# GPUs where they are): bench:layers' bf16 MLP and GPT-2 block rows, its attention and
# memory-bound kernels' and LM head's rows, and bench:train's smoke
# rows (tiny GPT-2 and LLaMA in bf16 at tp=1 and tp=2), and bench:collectives'
# NCCL rows (a process per device). What they compute is
# tested by the layers' and the trainer's own tests; this holds the
# benchmarks' wiring (devices, NCCL groups, the peak measurement), which only
# a GPU run would otherwise reach.
set -euo pipefail
layers=$1 train=$2 collectives=$3
fail() { printf 'FAIL: %s\n' "$1"; printf '%s\n' "$2"; exit 1; }

# A build with CUDA on a machine without a GPU: nothing to run (the GPU
# tests skip there too).
out=$("$layers" --cpu_rows=false --gpt2_block=false --attention=false --bandwidth=false --lm_head=false --tokens 64 --hidden 64 --steps 1 2>&1) || fail "bench:layers exited $?" "$out"
if grep -q '^no CUDA device' <<<"$out"; then
  echo "SKIP: no CUDA device"
  exit 0
fi
out=$("$layers" --cpu_rows=false --hidden 64 --tokens 64 --seq 32 --steps 1 --attention_seq 24 --attention_batch 1 \
  --bandwidth_rows 64 --lm_head_rows 256 --lm_head_vocab 1024 --lm_head_chunk 64 2>&1) ||
  fail "bench:layers exited $?" "$out"
for block in mlp_block gpt2_block; do
  grep -qE "^GPU \(cuda:0\), bf16, tp=1, $block( \(seq 32\))?: step [0-9.]+ ms.*\(same run\)$" <<<"$out" ||
    fail "bench:layers printed no GPU $block row" "$out"
  grep -qE "^GPU \(cuda:0\), bf16, tp=1, $block( \(seq 32\))?: step [0-9.]+ ms.*  \(bias apart: COLOD_GEMM_EPILOGUES=0\)$" \
    <<<"$out" || fail "bench:layers printed no GPU $block row with the bias apart" "$out"
done
for shape in "16 +128" "32 +64"; do  # the attention rows: batch, seq, heads, dim, then forward and backward
  grep -qE "^ +1 +24 +$shape +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$" <<<"$out" ||
    fail "bench:layers printed no attention row of heads and dim $shape" "$out"
  grep -qE "^ +1 +24 +$shape +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+  \(two backward kernels, no atomics: COLOD_DETERMINISTIC=1\)$" \
    <<<"$out" || fail "bench:layers printed no deterministic attention row of heads and dim $shape" "$out"
  grep -qE "^ +1 +24 +$shape +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+  \(one row tile a warp: COLOD_ATTENTION_ROW_TILES=1\)$" \
    <<<"$out" || fail "bench:layers printed no attention row of one row tile a warp, heads and dim $shape" "$out"
  # cuDNN's: served on a GPU with cuDNN, colod's kernels where it is not (the emulation).
  grep -qE "^ +1 +24 +$shape +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+  \((cuDNN's fused attention: COLOD_ATTENTION=cudnn|COLOD_ATTENTION=cudnn, cuDNN unavailable: colod's kernels ran)\)$" \
    <<<"$out" || fail "bench:layers printed no cuDNN attention row of heads and dim $shape" "$out"
done
grep -qE '^GPU \(cuda:0\) memory-bound kernels, bf16, 64 tokens \(copy bandwidth [0-9]+ GB/s' <<<"$out" ||
  fail "bench:layers printed no memory-bound table" "$out"
for row in "bias_add +\[64, 2304\]" "bias_gelu +\[64, 3072\]" "add \(residual\) +\[64, 768\]" "head_split +\[64, 768\]" \
  "bias_grad +\[64, 768\]" "bias_grad +\[64, 3072\]" "bias_gelu_backward +\[64, 3072\]" \
  "norm_param_grad \(layer norm\) +\[64, 768\]" "layer_norm_backward +\[64, 768\]" \
  "rms_norm_backward +\[64, 2048\]"; do
  grep -qE "^$row +[0-9.]+ +[0-9]+ +[0-9.]+%$" <<<"$out" || fail "bench:layers printed no memory-bound row $row" "$out"
done
grep -qE '^GPU \(cuda:0\) LM head \+ cross-entropy, bf16, 256 tokens x 768 hidden x 1024 vocab' <<<"$out" ||
  fail "bench:layers printed no LM head table" "$out"
for row in "unfused \(linear, then loss\)" "fused, chunks of 64 \(pipeline stages\)" \
  "fused, grads in forward, chunks of 256 \(the default\)"; do
  grep -qE "^$row +[0-9.]+ +[0-9.]+$" <<<"$out" || fail "bench:layers printed no LM head row $row" "$out"
done

# Two emulated devices (the emulation's default is 4); a real machine has its own.
out=$(COLOD_CUDA_EMU_DEVICES=2 "$train" --rows smoke --steps 1 --warmup 1 2>&1) || fail "bench:train exited $?" "$out"
for model in gpt2-tiny llama-tiny; do
  # tp=1 always runs; tp=2 runs, or says it needs a second device.
  grep -qE "^$model +cuda +tp=1 dp=1 +bf16 .* [1-9][0-9]* +[0-9.e+]+ " <<<"$out" || fail "no timed $model tp=1 row" "$out"
  # Below each in-process row: how long the host took to enqueue a step and
  # waited for the device.
  below=$(grep -A1 -E "^$model +cuda +tp=1 dp=1 +bf16" <<<"$out")
  grep -qE "^ +the host enqueued a step in [0-9]+\.[0-9]{2} ms and waited [0-9]+\.[0-9]{2} ms a step for the device in its read$" <<<"$below" ||
    fail "no host enqueue and wait under the $model tp=1 row" "$out"
  grep -qE "^$model +cuda +tp=2 dp=1( +bf16 .* [1-9][0-9]* +[0-9.e+]+ |: skipped, 1 CUDA device)" <<<"$out" ||
    fail "no $model tp=2 row" "$out"
done
# The A/B row of the bias in the GEMMs' epilogues (COLOD_GEMM_EPILOGUES=0).
grep -qE "^gpt2-tiny +cuda +tp=1 dp=1 bias apart +bf16 .* [1-9][0-9]* +[0-9.e+]+ " <<<"$out" ||
  fail "no timed gpt2-tiny row with the bias apart" "$out"
# The A/B of the host running a step ahead (TrainOptions::read_each_step).
grep -qE "^gpt2-tiny +cuda +tp=1 dp=1 read each step +bf16 .* [1-9][0-9]* +[0-9.e+]+ " <<<"$out" ||
  fail "no timed gpt2-tiny row that reads each step" "$out"
# A process per device: tp=2, dp=2 and two pipeline stages.
for layout in "tp=2 dp=1 procs" "tp=1 dp=2 procs" "tp=1 pp=2 dp=1 m=2 procs"; do
  grep -qE "^gpt2-tiny +cuda +$layout( +bf16 .* [1-9][0-9]* +[0-9.e+]+ |: skipped, 1 CUDA device)" <<<"$out" ||
    fail "no gpt2-tiny $layout row" "$out"
done
# The NCCL rows: every op at every size, rank processes on two devices (or
# the note of why not on a machine with one).
out=$(COLOD_CUDA_EMU_DEVICES=2 "$collectives" --backend nccl --nccl_max_bytes 8192 --iters 1 2>&1) ||
  fail "bench:collectives exited $?" "$out"
if ! grep -q '^NCCL rows skipped: 1 CUDA device' <<<"$out"; then
  for op in allreduce allgather reducescatter sendrecv; do
    for size in "1 KiB" "8 KiB"; do
      grep -qE "^$op +nccl +bf16 +2 +$size +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+%$" <<<"$out" ||
        fail "bench:collectives printed no NCCL $op row of $size on 2 ranks" "$out"
    done
  done
fi
echo "PASS: bench:layers' GPU row, bench:train's smoke rows and bench:collectives' NCCL rows"
