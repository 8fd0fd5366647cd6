"""Can a Triton GEMM with the GeLU in its epilogue beat cuBLAS + a GeLU kernel on this GPU?

    python bench/mm_epilogue.py

Variants of a TMA matmul (x @ w.T + b, then erf GeLU), 1 or 2 programs resident per SM, against
torch.addmm (+ F.gelu), all on the MLP's first linear (8192x1024 @ 1024x4096 bf16) and second
(8192x4096 @ 4096x1024). Also a GeLU kernel launched with programmatic dependent launch (PDL)
after addmm: does the gap between the two kernels shrink? Prints a table last."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # older triton
    gdc_wait = None

DEV = "cuda"
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device=DEV)


triton.set_allocator(_alloc)


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % size_m
    pid_n = (tile_id % group) // size_m
    return pid_m, pid_n


@triton.jit
def mm_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
              STAGES: tl.constexpr, GELU: tl.constexpr, PERSISTENT: tl.constexpr,
              SUBTILE: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BN, BK])
    if SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN])
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    if PERSISTENT:
        start = tl.program_id(0)
        step = tl.num_programs(0)
    else:
        start = tl.program_id(0)
        step = num_tiles
    for tile_id in tl.range(start, num_tiles, step, flatten=False):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            a = a_desc.load([om, k])
            w = w_desc.load([on, k])
            acc = tl.dot(a, w.T, acc)
        bias = tl.load(bias_ptr + on + tl.arange(0, BN)).to(tl.float32)
        h = (acc + bias[None, :]).to(tl.bfloat16)
        if GELU:
            hf = h.to(tl.float32)
            h = (0.5 * hf * (1.0 + libdevice.erf(hf * 0.7071067811865476))).to(tl.bfloat16)
        if SUBTILE:
            h2 = tl.reshape(h, (BM, 2, BN // 2))
            h2 = tl.permute(h2, (0, 2, 1))
            h0, h1 = tl.split(h2)
            c_desc.store([om, on], h0)
            c_desc.store([om, on + BN // 2], h1)
        else:
            c_desc.store([om, on], h)


@triton.jit
def gelu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.float32)
    y = 0.5 * x * (1.0 + libdevice.erf(x * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(tl.bfloat16))


def mm(a, w, b, cfg, gelu):
    M, K = a.shape
    N = w.shape[0]
    c = torch.empty(M, N, device=DEV, dtype=a.dtype)
    BM, BN, BK, warps, stages, persistent, per_sm, subtile = cfg
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = (min(tiles, per_sm * SMS),) if persistent else (tiles,)
    mm_kernel[grid](a, w, b, c, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=8, STAGES=stages,
                    GELU=gelu, PERSISTENT=persistent, SUBTILE=subtile, num_warps=warps)
    return c


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


CFGS = [  # BM, BN, BK, warps, stages, persistent, programs per SM (persistent), epilogue subtile
    (128, 256, 64, 8, 3, False, 1, False),
    (128, 256, 64, 8, 3, False, 1, True),
    (128, 256, 64, 8, 4, True, 1, True),
    (128, 256, 64, 8, 3, True, 1, True),
    (128, 128, 64, 4, 3, False, 2, False),
    (128, 128, 64, 4, 3, True, 2, False),
    (128, 128, 64, 8, 3, False, 2, False),
    (128, 128, 64, 8, 3, True, 2, False),
    (128, 128, 64, 4, 4, False, 1, False),
    (64, 256, 64, 4, 2, False, 2, False),
    (64, 256, 64, 4, 3, False, 1, False),
    (128, 128, 128, 8, 2, False, 2, False),
]


def main():
    torch.manual_seed(0)
    rows = []
    for name, (M, K, N) in {"linear1": (8192, 1024, 4096), "linear2": (8192, 4096, 1024)}.items():
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5
        b = torch.randn(N, device=DEV, dtype=torch.bfloat16) * 0.1
        ref = torch.addmm(b, x, w.t())
        ref_g = F.gelu(ref)
        t_mm = bench(lambda: torch.addmm(b, x, w.t()))
        t_mmg = bench(lambda: F.gelu(torch.addmm(b, x, w.t())))
        rows.append((name, "cuBLAS addmm", t_mm, t_mmg, 0, 0))
        for cfg in CFGS:
            try:
                c = mm(x, w, b, cfg, False)
                g = mm(x, w, b, cfg, True)
                e0 = (c.float() - ref.float()).abs().max().item()
                e1 = (g != ref_g).float().mean().item()
                t0 = bench(lambda: mm(x, w, b, cfg, False))
                t1 = bench(lambda: mm(x, w, b, cfg, True)) if name == "linear1" else float("nan")
                rows.append((name, str(cfg), t0, t1, e0, e1))
            except Exception as e:  # a config that does not compile or fit
                rows.append((name, str(cfg) + " FAILED " + str(e).splitlines()[0][:60], 0, 0, 0, 0))
            print(rows[-1], flush=True)
    # PDL: addmm then a GeLU kernel, with and without programmatic dependent launch
    x = torch.randn(8192, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16) * 0.03
    b = torch.randn(4096, device=DEV, dtype=torch.bfloat16) * 0.1
    h = torch.addmm(b, x, w.t())
    y = torch.empty_like(h)
    n = h.numel()

    def chain(pdl):
        h = torch.addmm(b, x, w.t())
        kw = {"launch_pdl": True} if pdl else {}
        gelu_kernel[(n // 1024,)](h, y, n, BLOCK=1024, PDL=pdl, num_warps=2, **kw)
        return y
    pdl_rows = []
    for pdl in ([False, True] if gdc_wait is not None else [False]):
        try:
            chain(pdl)
            ts = [bench(lambda: chain(pdl)) for _ in range(3)]
            pdl_rows.append((pdl, ts, (y != F.gelu(h)).float().mean().item()))
        except Exception as e:
            pdl_rows.append((pdl, "FAILED " + str(e).splitlines()[0][:80], 0))
    te = [bench(lambda: F.gelu(torch.addmm(b, x, w.t()))) for _ in range(3)]
    print(f"\ntorch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    print(f"{'shape':8} {'config':52} {'plain us':>9} {'gelu us':>9} {'err':>8} {'gelu mism':>9}")
    for r in rows:
        print(f"{r[0]:8} {r[1][:52]:52} {r[2]:9.1f} {r[3]:9.1f} {r[4]:8.3g} {r[5]:9.2e}")
    print("addmm + F.gelu (eager):", ["%.1f" % t for t in te])
    for pdl, ts, mism in pdl_rows:
        print(f"addmm + triton gelu pdl={pdl}:", ts if isinstance(ts, str) else ["%.1f" % t for t in ts],
              f"mismatch {mism}")


if __name__ == "__main__":
    sys.exit(main())
