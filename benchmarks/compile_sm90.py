"""Compile the expert kernels for sm_90 on a machine without a GPU and print what the compiler gives them:
registers, stack frame (spills), shared memory. Costs no device time; Triton's wheel carries ptxas and
cuobjdump.

    python3 benchmarks/compile_sm90.py [dh|dw|all]

The kernels are compiled as the GPU sees them for configs A-D (bf16, unit inner strides, 16-byte aligned
pointers and outer strides). Triton here may be newer than the device's (3.9 here, 3.6 there): the numbers
are a guide, the device's are the truth. ``compile_kernel`` is importable for other variants.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTR_TYPES = {"part_ptr": "*fp32", "token_index_ptr": "*i32", "offsets_ptr": "*i32", "tile_expert_ptr": "*i32",
              "tile_start_ptr": "*i32", "tile0_ptr": "*i32", "gate_table_ptr": "*i64", "up_table_ptr": "*i64",
              "down_table_ptr": "*i64", "out_table_ptr": "*i64", "b0_table_ptr": "*i64", "b1_table_ptr": "*i64",
              "weights_ptr": "*fp32", "slot_of_ptr": "*i32"}


def _jit_fn(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn  # through triton.heuristics / triton.autotune wrappers
    return kernel


def compile_kernel(kernel, constexprs: dict, *, num_warps: int = 8, num_stages: int = 3, maxnreg: int | None = None,
                   ones: tuple = (), div16: tuple = (), dtype: str = "bf16", descs: dict | None = None) -> dict:
    """Compile ``kernel`` for sm_90a: {"regs", "stack", "smem", "ttgir"}. ``ones``: integer arguments that
    equal 1 (Triton specializes them); ``div16``: integer arguments divisible by 16 (pointers always are);
    ``descs``: host tensor descriptor arguments, name -> block shape."""
    fn = _jit_fn(kernel)
    constexprs = dict(constexprs, **{n: 1 for n in ones})
    sig = {}
    for p in fn.params:
        if p.is_constexpr or p.name in ones:
            sig[p.name] = "constexpr"
        elif descs and p.name in descs:
            sig[p.name] = f"tensordesc<{dtype}{list(descs[p.name])}>"
        elif p.name.endswith("_ptr"):
            sig[p.name] = _PTR_TYPES.get(p.name, "*" + dtype)
        else:
            sig[p.name] = "fp32" if p.name in ("alpha", "limit") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name] != "constexpr" and not sig[p.name].startswith("tensordesc")
             and (p.name.endswith("_ptr") or p.name in div16)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                smem=compiled.metadata.shared, ttgir=compiled.asm["ttgir"])


def _dh(rows):
    from moeblaze_fx.kernels import expert_bwd
    base = dict(ACT=0, GATED=True, HAS_GATE_BIAS=False, HAS_UP_BIAS=False, W_ALIGN=16, DOT_PRECISION="tf32",
                CHUNK_N=64, BLOCK_M=128, EVEN_K=True, EVEN_N=True, PHASE=0)
    ones = ("stride_g_d", "stride_x_d", "stride_wg_d", "stride_wu_d", "stride_wd_n", "stride_wt_k", "stride_pre_n",
            "stride_dpre_n", "stride_hw_n")
    div16 = ("d", "h", "stride_g_t", "stride_x_t", "stride_wg_n", "stride_wu_n", "stride_wd_d", "stride_pre_s",
             "stride_dpre_s", "stride_hw_s", "stride_part_c")
    # (RECOMPUTE, BLOCK_N, BLOCK_K, SPLIT_N, GROUP_M, warps, stages): the tuned candidates
    for rec, bn, bk, split, gm, nw, ns in [(False, 64, 64, 2, 16, 8, 4), (False, 64, 128, 2, 8, 8, 3),
                                           (False, 64, 64, 1, 8, 8, 4), (True, 64, 64, 1, 8, 8, 3)]:
        r = compile_kernel(expert_bwd._expert_dh_kernel, dict(base, RECOMPUTE=rec, BLOCK_N=bn, BLOCK_K=bk,
                                                              SPLIT_N=split, GROUP_M=gm),
                           num_warps=nw, num_stages=ns, ones=ones, div16=div16)
        rows.append((f"dh{' recompute' if rec else ''} {bn}x{split} k{bk} w{nw} s{ns}", r))


def _dw(rows):
    from moeblaze_fx.kernels import expert_bwd
    # dW_down stores its tile row-major (d rows of [d, h]); dW_gate / dW_up, computed transposed, column-major
    for name, ones, div16 in [("dW_down", ("stride_a_m", "stride_b_n", "stride_o_n"), ("stride_o_m",)),
                              ("dW_gate transposed", ("stride_a_m", "stride_b_n", "stride_o_m"), ("stride_o_n",))]:
        for bm, bn, ns in [(128, 256, 7), (128, 256, 5)]:
            c = dict(OUT_FP32=False, ACCUMULATE=False, O_ALIGN=16, MAY_ADD=False, TMA=True, DOT_PRECISION="tf32",
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, EVEN_M=True, EVEN_N=True, ROWS32=True)
            r = compile_kernel(expert_bwd._expert_dw_kernel, c, num_warps=8, num_stages=ns, ones=ones,
                               div16=("m_dim", "n_dim", "stride_a_r", "stride_b_r") + div16,
                               descs={"b_desc": (64, bn)})
            rows.append((f"dw {name} {bm}x{bn} s{ns}", r))


def main(argv: list[str]) -> int:
    which = argv[1] if len(argv) > 1 else "all"
    rows: list = []
    if which in ("dh", "all"):
        _dh(rows)
    if which in ("dw", "all"):
        _dw(rows)
    print(f"Triton {triton.__version__}, sm_90a, bf16")
    print("| kernel, config | registers | stack bytes | shared KB |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['regs']} | {r['stack']} | {r['smem'] / 1024:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
