# Sourced from the repository root by the GPU-machine scripts (check_device.sh, cuda_tests.sh): the wheels
# carried in .whl/ (expecttest, liger-kernel, matplotlib; run's carry: [".whl"]) into /tmp/site, the package
# itself, editable (its entry point registers backend="moeblaze" with torch.compile), and PYTHONPATH. Once
# per process tree: a script sourcing it from another that did skips the installs.
if [[ -z ${MOEBLAZE_DEVICE_ENV:-} ]]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
        || echo "note: editable install failed"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MOEBLAZE_DEVICE_ENV=1
fi
