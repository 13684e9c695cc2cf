#!/usr/bin/env bash
# Fetch, on a machine with network, the Python wheels that python/tests/test_torch_gpu.py needs
# to reproduce the seed on a GPU machine without network: transformers 4.51.3 (from before
# transformers PR #37920, whose loader warms the allocator up with one allocation of the
# parameters' bytes) and the versions of tokenizers and huggingface_hub it accepts. They go to
# .whl/ (ignored by git); carry that folder to the GPU machine, where scripts/gpu-check.sh
# installs them into /tmp/site for its Python checks. torch, accelerate and safetensors are
# expected there already.
#
#   scripts/gpu-wheels.sh [PYTHON_VERSION]     default 3.12 (the GPU image's python3)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  transformers==4.51.3 tokenizers==0.21.1 huggingface_hub==0.30.2
ls -l .whl
