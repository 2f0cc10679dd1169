# Sourced by the GPU scripts (from the repo root): NCCL and symmetric memory without NVLink multicast,
# then TorchTitan and its pure-Python dependencies from the wheels in .whl/ when the machine has no
# TorchTitan (the offline GPU machines; README, "On a GPU"), and titan-mok in editable mode.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ! python3 -c "import torchtitan" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -c "import titan_mok.models" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
