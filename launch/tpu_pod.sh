#!/bin/bash
# distflow-jax on a Cloud TPU VM pod slice: the same command on every worker.
# jax.distributed.initialize() auto-detects the slice topology on TPU VMs.
#
#   launch/tpu_pod.sh my-tpu us-central2-b configs/grpo.py:qwen0.5b \
#       --config.model.path=/mnt/disks/models/Qwen2.5-0.5B-Instruct \
#       --config.data.train=/mnt/disks/data/gsm8k_train.jsonl
#
# The repository and the weights must already be on every worker (e.g. a
# shared disk, or `gcloud compute tpus tpu-vm scp --worker=all`).
set -euo pipefail
TPU=${1:?usage: tpu_pod.sh TPU_NAME ZONE CONFIG [overrides...]}
ZONE=${2:?zone}
CONFIG=${3:?config}
shift 3
REPO=${REPO:-~/distflow-jax}

gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="
  cd $REPO && pip install -q -e . 'jax[tpu]' &&
  distflow-jax train --distributed=auto --config=$CONFIG $*
"
