#!/usr/bin/env bash
# Prepare a checkout of the course for `make test-gpu` on an offline GPU machine (docs/gpu.md).
# Run it here, in the project's root, on a machine that can reach PyPI:
#     bash tools/gpu-prepare.sh [extra-package ...]
# It fills two git-ignored folders:
#   .whl/  wheels of what a bare GPU image lacks (nbval, ipykernel, ipywidgets, nbclient, ...)
#   .gpu/  enter.sh, to be sourced first on the GPU machine (installs .whl/ into /tmp/site)
# Copy the checkout with both folders to the GPU machine and run there, e.g.
#     source .gpu/enter.sh && make test-gpu
# The GPU image is expected to have torch, torchvision, matplotlib, numpy, pytest and tqdm.
# GPU_PYTHON (default 3.12) is the GPU machine's Python version; the platform is x86-64 Linux.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pyver=${GPU_PYTHON:-3.12}
rm -rf .whl && mkdir -p .whl .gpu
pkgs=(nbval nbclient nbformat ipykernel ipywidgets jupyter_client "$@")
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl "${pkgs[@]}" 2>&1 | grep -v "is ignored" || true
# The image's own copies stay authoritative for these.
rm -f .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/packaging-*.whl \
      .whl/psutil-*.whl .whl/pygments-*.whl .whl/typing_extensions-*.whl .whl/attrs-*.whl \
      .whl/six-*.whl .whl/coverage-*.whl
cp "$here/gpu-enter.sh" .gpu/enter.sh
echo "prepared: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/, and .gpu/enter.sh"
