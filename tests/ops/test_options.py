"""The options (moeblaze_fx/config.py): the kernel options' checks and canonical forms, their encoding as the
operators' ``kernel_options`` argument, torch.compile's ``options`` and ``moeblaze_fx.patch``, and the one environment
override ``MOEBLAZE_OPTIONS``."""
import os
import subprocess
import sys

import pytest
import torch

import moeblaze_fx
from moeblaze_fx import config
from moeblaze_fx.config import KernelOptions, MoEBlazeConfig, decode_kernels, encode_kernels


def test_defaults_encode_to_nothing():
    assert KernelOptions() == KernelOptions(gluon=True, kernel_config=None, dispatch_config=None)
    assert encode_kernels(KernelOptions()) == ""
    assert decode_kernels("") == KernelOptions()
    assert MoEBlazeConfig().kernels == KernelOptions()


@pytest.mark.parametrize("options", [
    KernelOptions(gluon=False),
    KernelOptions(kernel_config="num_warps=4,block_m=32"),  # any key order: one canonical form
    KernelOptions(kernel_config={"block_k": 16, "split_n": 2}),
    KernelOptions(dispatch_config="dense,64,32,4"),
    KernelOptions(float32_products="ieee"),
    KernelOptions(gluon=False, kernel_config="block_m=64", dispatch_config=("sort", 4096, 512, 4),
                  float32_products="bf16x3"),
], ids=["gluon", "config-string", "config-dict", "dispatch", "float32", "all"])
def test_encoding_round_trips(options):
    encoded = encode_kernels(options)
    assert decode_kernels(encoded) == options
    assert encode_kernels(decode_kernels(encoded)) == encoded


def test_canonical_forms():
    assert KernelOptions(kernel_config="num_warps=4, block_m=32").kernel_config == "block_m=32,num_warps=4"
    assert KernelOptions(kernel_config={"block_k": 16}).kernel_config == "block_k=16"
    assert KernelOptions(dispatch_config=("sort", 4096, 512, 4)).dispatch_config == "sort,4096,512,4"
    assert encode_kernels(KernelOptions(gluon=False, dispatch_config="sort,64,32,4")) == \
        "gluon=0;dispatch_config=sort,64,32,4"
    assert encode_kernels(KernelOptions(replay=False)) == "replay=0"
    assert encode_kernels(KernelOptions(float32_products="auto")) == ""
    assert encode_kernels(KernelOptions(float32_products="ieee")) == "float32_products=ieee"


@pytest.mark.parametrize("change,error,match", [
    ({"gluon": 0}, TypeError, "'gluon' must be True or False"),
    ({"replay": "yes"}, TypeError, "'replay' must be True or False"),
    ({"kernel_config": "block_m=12"}, ValueError, "block_m must be a power of two >= 16"),
    ({"kernel_config": "block_m"}, ValueError, "expected comma-separated key=value"),
    ({"kernel_config": "tile=16"}, ValueError, "unknown or no keys \\['tile'\\]"),
    ({"kernel_config": ""}, ValueError, "unknown or no keys \\[\\]"),
    ({"kernel_config": {"block_n": 16.0}}, ValueError, "block_n must be an integer"),
    ({"kernel_config": "split_n=3"}, ValueError, "split_n must be 1 or 2"),
    ({"kernel_config": "num_warps=3"}, ValueError, "num_warps must be a power of two"),
    ({"kernel_config": 32}, TypeError, "give a string"),
    ({"dispatch_config": "fast"}, ValueError, "expected 'path,chunk,block,num_warps'"),
    ({"dispatch_config": "radix,64,32,4"}, ValueError, "path must be one of \\('sort', 'dense'\\)"),
    ({"dispatch_config": "sort,64,128,4"}, ValueError, "16 <= block <= chunk"),
    ({"float32_products": "tf32"}, ValueError,
     "'float32_products' must be one of \\('auto', 'bf16x6', 'bf16x3', 'ieee'\\), got 'tf32'"),
])
def test_bad_kernel_options_are_clear_errors(change, error, match):
    with pytest.raises(error, match=match):
        KernelOptions(**change)


def test_compile_options_and_patch_take_kernel_options():
    cfg = config.from_options({"kernels": {"gluon": False}, "verify": False})
    assert cfg.kernels == KernelOptions(gluon=False) and not cfg.verify
    assert config.from_options({"kernels": KernelOptions(dispatch_config="sort,64,32,4")}).kernels.dispatch_config \
        == "sort,64,32,4"
    with moeblaze_fx.patch(kernels={"gluon": False}):
        assert config.current().kernels == KernelOptions(gluon=False)
        # torch.compile's kernel options apply over those in force
        assert config.from_options({"kernels": {"kernel_config": "block_m=32"}}).kernels == \
            KernelOptions(gluon=False, kernel_config="block_m=32")
    assert config.current().kernels == KernelOptions()
    with pytest.raises(ValueError, match="unknown kernel option\\(s\\) \\['tma'\\]; valid kernel options are "
                                         "\\['gluon', 'kernel_config', 'dispatch_config', 'replay', 'float32_products'\\]"):
        config.from_options({"kernels": {"tma": False}})
    with pytest.raises(TypeError, match="option 'kernels' must be a dict of kernel options"):
        config.from_options({"kernels": "gluon=0"})
    with pytest.raises(TypeError, match="option 'kernels' must be a KernelOptions"):
        MoEBlazeConfig(kernels={"gluon": False})


def test_environment_override_syntax():
    cfg = config.parse_environment("checkpoint=recompute; verify=0;memory_budget=1024;report=none;"
                                   "kernels.gluon=false;kernels.kernel_config=block_m=64,num_warps=4;"
                                   "kernels.dispatch_config=sort,64,32,4;kernels.float32_products=ieee")
    assert cfg == MoEBlazeConfig(checkpoint="recompute", verify=False, memory_budget=1024, report=None,
                                 kernels=KernelOptions(gluon=False, kernel_config="block_m=64,num_warps=4",
                                                       dispatch_config="sort,64,32,4", float32_products="ieee"))
    assert config.parse_environment("") == MoEBlazeConfig()
    assert config.parse_environment("report=/tmp/r.json").report == "/tmp/r.json"
    with pytest.raises(ValueError, match="MOEBLAZE_OPTIONS='gluon=0'.*kernels.gluon"):  # a kernel option's prefix
        config.parse_environment("gluon=0")
    with pytest.raises(ValueError, match="verify must be 1, 0, true or false, got 'yes'"):
        config.parse_environment("verify=yes")
    with pytest.raises(ValueError, match="memory_budget must be an integer"):
        config.parse_environment("memory_budget=1G")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        config.parse_environment("checkpoint=never")


@pytest.mark.parametrize("precision,cuda,cpu", [("highest", False, False), ("high", True, True),
                                                ("medium", True, True)])
def test_float32_matmul_reduced_follows_torchs_precision(precision, cuda, cpu, float32_matmul_precision):
    float32_matmul_precision(precision)
    assert (config.float32_matmul_reduced("cuda"), config.float32_matmul_reduced("cpu")) == (cuda, cpu)


def test_environment_override_sets_the_process_defaults():
    code = ("import moeblaze_fx, moeblaze_fx.config as c; k = c.current().kernels; "
            "print(c.current().checkpoint, k.gluon, k.kernel_config)")
    env = dict(os.environ, MOEBLAZE_OPTIONS="checkpoint=recompute;kernels.gluon=0;kernels.kernel_config=block_m=32")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["recompute", "False", "block_m=32"]
    env["MOEBLAZE_OPTIONS"] = "kernels.glu=0"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "MOEBLAZE_OPTIONS='kernels.glu=0'" in bad.stderr


def test_no_environment_read_outside_config():
    """Behaviour is set by options; the package reads the environment in config.py alone (the benchmark harness,
    moeblaze_fx/bench, aside: it names the commit and budgets of a benchmark run)."""
    root = os.path.dirname(moeblaze_fx.__file__)
    readers = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if name.endswith(".py") and rel != "config.py" and not rel.startswith("bench" + os.sep):
                text = open(path).read()
                if "os.environ" in text or "getenv" in text:
                    readers.append(rel)
    assert readers == []
