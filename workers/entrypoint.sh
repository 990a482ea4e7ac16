#!/usr/bin/env sh
# One worker process per GPU: pin it with CUDA_VISIBLE_DEVICES, the model loads once, lazily.
set -e
exec batchwright worker --loglevel "${BATCHWRIGHT_LOGLEVEL:-INFO}" "$@"
