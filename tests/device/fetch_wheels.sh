#!/usr/bin/env bash
# Here (a machine with pip access): download the dashboard's Python packages that a GPU host's Python lacks
# into .whl/ (ignored by git), as Python 3.12 manylinux x86_64 wheels with their dependencies.
# tests/device/run installs them on the GPU host with `pip install --no-index --target`.
#     tests/device/fetch_wheels.sh            # then carry .whl/ to the GPU host with the checkout
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# The packages pyproject.toml asks for that the GPU host's Python does not have (it has torch,
# transformers, nvidia-ml-py and psutil).
python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "textual==8.2.8" "asyncssh[bcrypt]>=2.14" "watchfiles>=0.21" "cryptography"
rm -f .whl/psutil-*.whl .whl/nvidia_ml_py-*.whl  # the host's own are used
ls -l .whl
du -sh .whl
