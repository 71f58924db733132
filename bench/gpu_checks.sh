#!/usr/bin/env bash
# The GPU checks of docs/gpu.md ("Pending"), in one run on a GPU machine whose python3 holds torch,
# triton, onnx and onnxruntime. pydantic, where missing, can travel as wheels: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic
# pydantic_core annotated-types typing-inspection` at the versions of this venv. Each check has its
# own time limit and the script goes on when one fails; the log and the kernel benchmark's table land
# in $OUT (or ./gpu_out). Results: docs/gpu.md.
#
#     bash bench/gpu_checks.sh            # about 5 minutes on an H200
#     bash bench/gpu_checks.sh launch     # the planning and launch checks alone (about 2 minutes)
#     bash bench/gpu_checks.sh llm        # CP decode of GPT-2's shape, Triton against torch attention
#     bash bench/gpu_checks.sh fidelity   # bench/gpu_fidelity.py (corpus exports in .gl/corpus), then llm
#     bash bench/gpu_checks.sh decode     # bench/gpu_decode.py and cp launches of GPT-2's shape (5 minutes)
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
W=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
T="python3 -m tessera"

step() {  # step SECONDS NAME COMMAND...: run, log its output and how it ended
    local limit=$1 name=$2
    shift 2
    echo "=== $name" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? in $((SECONDS - start)) s" | tee -a "$LOG"
}

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
step 60 "machine" bash -c 'nvidia-smi -L; python3 -V; python3 -c "
import torch, triton, onnx, onnxruntime, pydantic
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"triton\", triton.__version__, \"onnx\", onnx.__version__, \"onnxruntime\", onnxruntime.__version__, onnxruntime.get_available_providers())
print(\"cudnn\", torch.backends.cudnn.version(), \"nccl\", torch.cuda.nccl.version())"'
step 60 "backends" $T backends --json
ONLY=${1:-all}  # "launch": the launches alone; "llm": the GPT-2-shaped decode alone; "fidelity", "decode": below
CLUSTER=h200
nvidia-smi -L 2>/dev/null | grep -q H100 && CLUSTER=h100
if [ "$ONLY" = decode ]; then  # the decode step on the GPU: captured, against generate() and the roofline
    step 120 "the captured step and the interpreter on cuda" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/executor/test_graphed_step.py tests/backends/test_torch_module_cuda.py
    step 240 "bench/gpu_decode.py" python3 bench/gpu_decode.py --out "$OUT/gpu_decode.md"
    step 60 "cp plan (--llm gpt2, $CLUSTER)" $T plan --llm gpt2 --kind cp --cluster $CLUSTER --batch 1 \
        --context 128 --output-len 64 -o "$W/llm.json"
    step 120 "cp launch --llm gpt2 (captured step)" $T launch "$W/llm.json" --new-tokens 64 --prompt-lens 128 --json
    step 120 "generate() compiled (bench/gpu_decode.py --hf-compiled)" python3 bench/gpu_decode.py --batch 1 \
        --prompt 128 --hf-compiled --out "$OUT/gpu_decode_compiled.md"
    step 120 "cp launch --llm gpt2 --compile (captured)" $T launch "$W/llm.json" --new-tokens 64 --prompt-lens 128 \
        --compile --json
    echo "done" | tee -a "$LOG"
    exit 0
elif [ "$ONLY" = fidelity ]; then  # stages measured on the GPU: predicted against launched, then "llm"
    step 120 "stage profiler and the interpreter on cuda" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/planners/pipeline/test_stage_profile.py tests/backends/test_torch_module_cuda.py
    step 330 "predicted against launched (bench/gpu_fidelity.py)" python3 bench/gpu_fidelity.py \
        --cluster h200 --out "$OUT/gpu_fidelity.md" ${GPU_FIDELITY_ONLY:+--only "$GPU_FIDELITY_ONLY"}
    ONLY=llm
elif [ "$ONLY" = all ]; then
step 240 "gpu tests" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/backends
step 240 "split-KV decode kernel: bench/kernels.py --tune" python3 bench/kernels.py --tune
cp bench/results/kernels.md "$OUT/" 2>/dev/null
else
step 120 "the interpreter on cuda" python3 -m pytest -q -m gpu -p no:cacheprovider tests/backends/test_torch_module_cuda.py
fi

if [ "$ONLY" = llm ]; then  # CP decode of GPT-2's shape on the GPU: Triton's tokens against torch's
    step 60 "cp plan (--llm gpt2, h200)" $T plan --llm gpt2 --kind cp --cluster h200 --batch 2 --context 64 \
        --output-len 8 -o "$W/llm.json"
    cat >"$W/recognize.py" <<'PY'
import json, sys, traceback
import onnx
from tessera.core.weights import materialize
from tessera.executor.graph_decode_worker import graph_decoder
from tessera.models.gpt import llm_gpt
print("onnx", onnx.__version__)
llm = json.load(open(sys.argv[1]))["llm"]
model = materialize(llm_gpt(llm, 0))
try:
    graph_decoder(model, label="--llm gpt2")
    print("recognized")
except Exception:
    traceback.print_exc()
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    for node in model.graph.node[:60]:
        print(node.op_type, node.name, [(o, known.get(o)) for o in node.output])
PY
    step 60 "recognize --llm gpt2's decoder" python3 "$W/recognize.py" "$W/llm.json"
    for attention in torch triton; do
        step 120 "cp launch --llm gpt2, $attention attention" $T launch "$W/llm.json" --attention $attention \
            --new-tokens 6 --prompt-lens 64,33 --json
    done
    echo "done" | tee -a "$LOG"
    exit 0
fi
$T zoo build gpt -o "$W/gpt.onnx" >>"$LOG" 2>&1
$T zoo build bert -o "$W/bert.onnx" >>"$LOG" 2>&1
step 60 "cp plan (gpt, h200)" $T plan "$W/gpt.onnx" --kind cp --cluster h200 --batch 2 --context 8 \
    --output-len 8 -o "$W/cp.json"
step 120 "cp launch, triton attention" $T launch "$W/cp.json" --attention triton --new-tokens 4 \
    --prompt-lens 8,5 --json
step 120 "gpp plan --profile on CUDA (gpt, h200)" $T plan "$W/gpt.onnx" --cluster h200 --mini-batch 8 \
    --profile --cache "$W/p.sqlite" --no-baseline -o "$W/gpp.json"
step 120 "gpp launch on CUDA (NCCL, one rank)" $T launch "$W/gpp.json" --steps 10 --json
step 120 "gpp plan --profile on CUDA (bert, h200, mini-batch 32)" $T plan "$W/bert.onnx" --cluster h200 \
    --mini-batch 32 --profile --cache "$W/p.sqlite" --no-baseline -o "$W/gpp_bert.json"
step 120 "gpp launch on CUDA (bert)" $T launch "$W/gpp_bert.json" --steps 10
step 120 "cp launch, torch attention" $T launch "$W/cp.json" --attention torch --new-tokens 4 \
    --prompt-lens 8,5
step 120 "place on cuda:0 (bert)" $T place "$W/bert.onnx" --device cuda:0 --cache "$W/place.sqlite" \
    -o "$W/place.json" --json
step 60 "launch the placement" $T launch "$W/place.json" --json
echo "done" | tee -a "$LOG"
