"""Compile every Triton kernel variant for a CUDA target ahead of time, with no GPU present.

The CPU test suite runs the kernels under the Triton interpreter, which accepts some programs the real
compiler rejects (and vice versa); this catches compile errors for the GPU on a CPU-only machine. It also
asserts two properties of the generated PTX that the quantizer's bit-exactness relies on: IEEE division
(``div.rn.f32``) and the round-half-even trick's two adds surviving optimisation.

    python -m pdcluster.kernels.compile_check [--arch 90]

Must run in a process where ``TRITON_INTERPRET`` is unset before triton is imported.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any


def _compile(fn: Any, types: dict[str, str], constexprs: dict[str, Any], arch: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    cx = {(names.index(n),): v for n, v in constexprs.items()}
    return triton.compile(ASTSource(fn, sig, cx), target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def attention_variants() -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    out = []
    # (q dtype, cache element type, bits, one pass, head_dim, group); 80 exercises head_dim padding
    for qdt, cdt, bits, one_pass, hd, group in [
        ("fp16", "fp16", 0, True, 128, 8), ("fp16", "fp16", 0, False, 128, 8), ("bf16", "bf16", 0, False, 64, 1),
        ("fp32", "fp32", 0, True, 64, 4), ("fp16", "i8", 8, False, 128, 8), ("bf16", "u8", 4, False, 128, 8),
        ("fp16", "u8", 4, True, 32, 2), ("fp32", "i8", 8, True, 32, 16), ("bf16", "u8", 4, False, 80, 4),
    ]:
        cache = "*" + cdt
        scale = "*fp32" if bits else "*i32"
        types = dict(q_ptr="*" + qdt, k_ptr=cache, v_ptr=cache, ks_ptr=scale, vs_ptr=scale, bt_ptr="*i32",
                     lens_ptr="*i32", out_ptr="*" + qdt, pacc_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32",
                     qk_scale="fp32")
        pad = max(32 if bits == 4 else 16, 1 << (hd - 1).bit_length())
        cx = dict(GROUP=group, GROUP_PAD=max(16, group), HEAD_DIM=hd, HEAD_PAD=pad, BLOCK_SIZE=16, TILE_N=64,
                  BITS=bits, DOT_FP32="fp32" in (qdt, cdt), ONE_PASS=one_pass)
        out.append((f"attention q={qdt} cache={cdt} one_pass={one_pass} d={hd} g={group}", types, cx))
    return out


def write_variants() -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    out = []
    for kdt, cdt, bits, hd in [("fp16", "fp16", 0, 128), ("fp32", "bf16", 0, 96), ("fp16", "i8", 8, 128),
                               ("bf16", "u8", 4, 80)]:
        cache = "*" + cdt
        scale = "*fp32" if bits else cache
        types = dict(k_ptr="*" + kdt, v_ptr="*" + kdt, kc_ptr=cache, vc_ptr=cache, ks_ptr=scale, vs_ptr=scale,
                     slot_ptr="*i64")
        pad = 1 << (hd - 1).bit_length()
        out.append((f"write k={kdt} cache={cdt} d={hd}", types,
                    dict(HEAD_DIM=hd, HEAD_PAD=pad, BLOCK_SIZE=12, BITS=bits)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it for this check", file=sys.stderr)
        return 2
    from pdcluster.kernels import paged_attention as pa
    from pdcluster.kernels import write_kv as wk

    failures = 0
    jobs = [(pa._paged_attn_partition_kernel, *v) for v in attention_variants()]
    jobs.append((pa._paged_attn_reduce_kernel, "reduce",
                 dict(out_ptr="*fp16", pacc_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", lens_ptr="*i32"),
                 dict(HEAD_DIM=80, HEAD_PAD=128, BLOCK_SIZE=16, PARTS_PAD=64)))
    jobs += [(wk._write_kv_kernel, *v) for v in write_variants()]
    for fn, label, types, cx in jobs:
        try:
            kernel = _compile(fn, types, cx, a.arch)
        except Exception as e:  # report every variant, then fail
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:400]}")
            continue
        problems = []
        if fn is wk._write_kv_kernel and cx["BITS"]:
            ptx = kernel.asm["ptx"]
            if re.search(r"div\.(full|approx)", ptx) or not re.search(r"div\.rn\.f32", ptx):
                problems.append("quantizer division is not div.rn.f32")
            if "0f4B400000" not in ptx or "0fCB400000" not in ptx:
                problems.append("round-half-even adds were optimised away")
        failures += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {label} (shared {kernel.metadata.shared} B) {'; '.join(problems)}")
    print(f"sm_{a.arch}: {'all kernels compile' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
