#!/usr/bin/env bash
# Run benchmarks/gpu_validation.py where python3 has torch, Lightning and transformers but not this
# project (a lent GPU machine): wheels carried in .whl/ (opacus) go to /tmp/site, the checkout onto
# the path. Arguments go to the script, e.g. `bash benchmarks/gpu_validation.sh --out-dir "$OUT" --commit SHA`.
# See benchmarks/README.md ("gpu_validation.py").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" benchmarks/gpu_validation.py "$@"
