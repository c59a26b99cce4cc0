#!/bin/bash
# GPU checks: POISE per-prefix + importance sampler train on CUDA (bf16, gradient checkpointing); bench overhead --prefix.
PY=${PY:-python3}; SIZE=${SIZE:-real}; LEN=${LEN:-256}
if [ -d .whl ]; then $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
$PY -c "import torch,transformers,trl;print('torch',torch.__version__,'transformers',transformers.__version__,'trl',trl.__version__)"
$PY .gpu/build_model.py /tmp/q044 $SIZE 2>&1 | tail -n 1
date +%T
timeout ${TRAIN_TIMEOUT:-150} $PY .gpu/train_check.py /tmp/q044 /tmp/train > $OUT/train_check.log 2>&1; echo "train rc $?"
grep -v -i "warn" $OUT/train_check.log | tail -n 12
date +%T
timeout ${OVH_TIMEOUT:-420} $PY -m poise_trl.cli bench overhead --model /tmp/q044 --train-dataset arith --completion-lengths $LEN \
  --prefix --gradient-checkpointing --cycles 2 --warmup-cycles 1 --memory-cycles 2 --skip-probe-fit --cpu-threads 0 \
  --output-dir $OUT/overhead > $OUT/overhead.log 2>&1; echo "overhead rc $?"
grep -v -i "warn" $OUT/overhead.log | tail -n 16
date +%T
