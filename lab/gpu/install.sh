# The install lines every device call starts with (lab/gpu/check.sh sources them; docs/GPU.md).
# The device machine is given back 30 s after a call, so each call installs again (a few seconds). The wheels of
# .whl (make gpu-prep) go to $GPU_SITE without their dependencies, which the machine has, and without an index, which
# it cannot reach; polyspec goes in editable from this tree. Sourced, so PYTHONPATH stays set for the call.
GPU_SITE=${GPU_SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$GPU_SITE" .whl/*.whl \
    || { echo "gpu_install: the carried wheels did not install (was .whl carried?)" >&2; return 1; }
export PYTHONPATH="$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || { echo "gpu_install: polyspec did not install from this tree" >&2; return 1; }
