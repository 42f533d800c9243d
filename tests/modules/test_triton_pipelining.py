"""The FP8 wgrad kernels' software pipelining, checked on the CPU: each kernel is compiled for Hopper (sm_90) to
Triton's GPU IR, which needs no GPU, and its TMA loads are counted. A pipelined loop of ``STAGES`` stages issues
its two loads (A and B) in the loop and ``STAGES - 1`` times ahead of it: ``2 * STAGES`` copies; an unpipelined one
issues two; and its MMAs overlap when the loop waits for all but one of them (``pendings = 1``). The persistent kernel
lost its pipelining silently once (a loop-carried step count that sank into the MMA's stage: it ran at half the one-
tile kernel's rate), and then waited for every MMA (its accumulator reset by a select in every step). Skipped without
triton (CI), without its NVIDIA backend, or under its interpreter."""

from __future__ import annotations

import importlib
import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, not interprets")


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
        return "nvidia" in backends
    except Exception:  # noqa: BLE001 - an older triton's layout
        return False


nvidia = pytest.mark.skipif(not _has_nvidia_backend(), reason="this triton has no NVIDIA backend")


def _ttgir(kernel, persistent: bool, stages: int, warps: int, fast: bool, acc: bool, tma_out: bool = False,
           full: bool = False, bk: int = 128, bn: int = 128):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bk}, 128]>", "sa_ptr": "*fp32", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128]>",
           "sb_ptr": "*fp32", "out_ptr": "*fp32", "offs_ptr": "*i32", "K": "i32", "N": "i32"}
    const = {"ACC": acc, "FAST": fast, "BLOCK_K": bk, "BLOCK_N": bn, "TB": 128, "GROUP_K": 8, "STAGES": stages}
    if persistent:
        sig = {**{k: v for k, v in sig.items() if k != "offs_ptr"},
               "o_desc": f"tensordesc<fp32[1, {bk}, {bn}]>" if tma_out else "*fp32", "offs_ptr": "*i32"}
        sig.update(K="i32", N="i32", L="i32", P="i32")
        const["TMA_OUT"] = tma_out
    else:
        const["PER_BLOCK"] = False
    sig.update({k: "constexpr" for k in const})
    # what triton's launcher assumes of aligned arguments (pointers and sizes divisible by 16), so that the loads and
    # stores are vectorized as on the GPU
    names = kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("sa_ptr", "sb_ptr", "out_ptr", "offs_ptr", "K",
                                                                    "N", "P") if k in names}
    # a compile error fails the test; only a triton without the NVIDIA backend skips it
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    return (compiled, compiled.asm["ttgir"]) if full else compiled.asm["ttgir"]


def _in_flight(ir: str) -> bool:
    """Whether the loop waits for all but one MMA (one stays in flight across steps), not for every one."""
    return "pendings = 1" in ir


@nvidia
@pytest.mark.parametrize("stages,warps", [(3, 8), (4, 8), (4, 4)])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("acc", [False, True])
def test_persistent_wgrad_is_pipelined(stages, warps, fast, acc):
    from lightning_moe.modules import triton_fp8_wgrad as tw
    ir = _ttgir(tw._fp8_wgrad_persistent_kernel, True, stages, warps, fast, acc)
    assert ir.count("ttng.async_tma_copy_global_to_local") == 2 * stages
    assert _in_flight(ir)


@nvidia
@pytest.mark.parametrize("acc", [False, True])
def test_persistent_wgrad_with_tma_out_is_pipelined(acc):
    """With the output tile by TMA: the operands' copies pipelined as before, plus the old tile's one (adding)."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    bk, bn, warps, stages = tw.TMA_OUT_CONFIG
    compiled, ir = _ttgir(tw._fp8_wgrad_persistent_kernel, True, stages, warps, True, acc, tma_out=True,
                          full=True)
    assert ir.count("ttng.async_tma_copy_global_to_local") == 2 * stages + acc
    assert "async_tma_copy_local_to_global" in ir
    assert _in_flight(ir)
    assert compiled.metadata.shared <= 232448  # fits Hopper's shared memory per block


@nvidia
def test_one_tile_wgrad_is_pipelined():
    from lightning_moe.modules import triton_fp8_wgrad as tw
    stages = tw.CONFIGS["fast"][3]
    ir = _ttgir(tw._fp8_wgrad_kernel, False, stages, tw.CONFIGS["fast"][2], True, True)
    assert ir.count("ttng.async_tma_copy_global_to_local") == 2 * stages
    assert _in_flight(ir)


@nvidia
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("acc", [False, True])
def test_persistent_narrow_config_is_pipelined_and_two_fit(fast, acc):
    """The 64 x 128 config (few tokens per expert): pipelined, one MMA in flight, and two programs fit one SM's shared
    memory (228 KiB, 1 KiB of it reserved per block), as its default of two programs per SM assumes."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    bk, bn, warps, stages = tw.PERSISTENT_NARROW_CONFIG
    compiled, ir = _ttgir(tw._fp8_wgrad_persistent_kernel, True, stages, warps, fast, acc, full=True, bk=bk, bn=bn)
    assert ir.count("ttng.async_tma_copy_global_to_local") == 2 * stages
    assert _in_flight(ir)
    assert 2 * (compiled.metadata.shared + 1024) <= 228 * 1024


@nvidia
@pytest.mark.parametrize("config_name", ["SEGMENTS_CONFIG", "SEGMENTS_NARROW_CONFIG"])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("acc", [False, True])
def test_segments_wgrad_is_pipelined_across_segments(config_name, fast, acc):
    """The deferred wgrad's kernel (one flat loop over every micro-batch's blocks of a tile's expert): pipelined, one
    MMA in flight, in both default configs, within Hopper's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lightning_moe.modules import triton_fp8_wgrad as tw
    bk, bn, warps, stages = getattr(tw, config_name)
    kernel = tw._fp8_wgrad_segments_kernel
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bk}, 128]>", "sa_ptr": "*fp32", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128]>",
           "sb_ptr": "*fp32", "out_ptr": "*fp32", "starts_ptr": "*i32", "ends_ptr": "*i32", "K": "i32", "N": "i32",
           "L": "i32", "S": "i32", "P": "i32"}
    const = {"ACC": acc, "FAST": fast, "BLOCK_K": bk, "BLOCK_N": bn, "TB": 128, "GROUP_K": 8, "STAGES": stages}
    sig.update({k: "constexpr" for k in const})
    attrs = {(kernel.arg_names.index(k),): [["tt.divisibility", 16]]
             for k in ("sa_ptr", "sb_ptr", "out_ptr", "starts_ptr", "ends_ptr", "K", "N", "P")}
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ir = compiled.asm["ttgir"]
    assert ir.count("ttng.async_tma_copy_global_to_local") == 2 * stages
    assert _in_flight(ir)
    assert compiled.metadata.shared <= 232448


def _ptxas():
    """triton's own ptxas (its NVIDIA backend ships one), or None."""
    path = os.path.join(os.path.dirname(importlib.import_module("triton.backends.nvidia").__file__), "bin", "ptxas")
    return path if os.path.exists(path) else None


@nvidia
def test_gluon_precise_gemm_keeps_its_mmas_in_flight(tmp_path):
    """``gluon_fp8_grouped_mm``: assembled for sm_90a by triton's ptxas without C7514 (the info ptxas prints where it
    serializes every MMA, as it does for triton's precise kernel), without spills, and waiting with one group of
    MMAs in flight (``wgmma.wait_group 1``: a block's promotion runs while the next block multiplies)."""
    import subprocess
    gm = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_mm")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("this triton ships no ptxas")
    bm, bn, warps, stages = gm.CONFIG
    la = gl.NVMMASharedLayout.get_default_for([bm, gm.BLOCK_K], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, gm.BLOCK_K], gl.float8e4nv)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {gm.BLOCK_K}],{la!r}>", "sa_ptr": "*fp32",
           "b_desc": f"tensordesc<fp8e4nv[{bn}, {gm.BLOCK_K}],{lb!r}>", "sb_ptr": "*fp32", "out_ptr": "*bf16",
           "offs_ptr": "*i32", "N": "i32", "K": "i32", "L": "i32", "TILES": "i32"}
    const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_L": 32, "GROUP_M": 8, "STAGES": stages, "num_warps": warps}
    sig.update({k: "constexpr" for k in const})
    names = gm._kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("sa_ptr", "sb_ptr", "out_ptr", "offs_ptr", "N",
                                                                    "K")}
    compiled = triton.compile(GluonASTSource(gm._kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    (tmp_path / "k.ptx").write_text(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert "C7514" not in out and "serialized" not in out, out
    assert " 0 bytes spill stores" in out, out


@nvidia
@pytest.mark.parametrize("which", ["CONFIG", "NARROW_CONFIG"])
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_gluon_wgrad_fits_and_keeps_one_mma_in_flight(tmp_path, which, out):
    """``gluon_fp8_wgrad``'s configs, assembled for sm_90a by triton's ptxas: within Hopper's shared memory, no
    spills, the MMA warps raised to at least 232 registers (``setmaxnreg``), one group of MMAs left in flight while a
    block is waited for, and a barrier among the MMA warps before each TMA store reads what they wrote."""
    import re
    import subprocess
    gw = pytest.importorskip("lightning_moe.modules.gluon_fp8_wgrad")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("this triton ships no ptxas")
    bk, bn, warps, stages, *rest = getattr(gw, which)
    split = 128 // (2 if out == "bf16" else 4)
    la = gl.NVMMASharedLayout.get_default_for([bk, gw.T], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, gw.T], gl.float8e4nv)
    lc = gl.NVMMASharedLayout.get_default_for([bk, split], gl.bfloat16 if out == "bf16" else gl.float32)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bk}, {gw.T}],{la!r}>", "sa_ptr": "*fp32",
           "b_desc": f"tensordesc<fp8e4nv[{bn}, {gw.T}],{lb!r}>", "sb_ptr": "*fp32",
           "c_desc": f"tensordesc<{out}[{bk}, {split}],{lc!r}>", "offs_ptr": "*i32", "K": "i32", "N": "i32",
           "L": "i32"}
    const = {"BLOCK_K": bk, "BLOCK_N": bn, "GROUP_K": 8, "STAGES": stages, "CONSUMERS": rest[0] if rest else 1,
             "WORKER_REGS": gw.WORKER_REGS, "BLOCK_L": 128, "num_warps": warps}
    sig.update({k: "constexpr" for k in const})
    names = gw._kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("sa_ptr", "sb_ptr", "offs_ptr", "K", "N")}
    compiled = triton.compile(GluonASTSource(gw._kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "maxnreg": gw.MAXNREG})
    assert compiled.metadata.shared <= 232448
    ptx = compiled.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert max(int(r) for r in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)) >= 232
    store = ptx.index("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group")
    last_write = max(ptx.rfind("stmatrix", 0, store), ptx.rfind("st.shared", 0, store))
    assert re.search(r"bar\.sync\s+\d+, (128|256);", ptx[last_write:store])
    (tmp_path / "k.ptx").write_text(ptx)
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert " 0 bytes spill stores" in res, res


@nvidia
@pytest.mark.parametrize("config", [(128, 256, 8, 4), (128, 128, 4, 5, 2), (128, 256, 8, 4, 1, 1),
                                    (128, 128, 4, 4, 2, 1)])
def test_gluon_ws_gemm_fits_without_spills(tmp_path, config):
    """``gluon_fp8_grouped_ws``, one and two consumers, with 128 experts' offsets read per tile (its widest schedule
    vector): within Hopper's shared memory and no spills in any partition (sm_90a, triton's ptxas)."""
    import subprocess
    gm = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_ws")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("this triton ships no ptxas")
    bm, bn, warps, stages, *rest = config
    la = gl.NVMMASharedLayout.get_default_for([bm, gm.BLOCK_K], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, gm.BLOCK_K], gl.float8e4nv)
    lc = gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {gm.BLOCK_K}],{la!r}>", "sa_ptr": "*fp32",
           "b_desc": f"tensordesc<fp8e4nv[{bn}, {gm.BLOCK_K}],{lb!r}>", "sb_ptr": "*fp32",
           "c_desc": f"tensordesc<bf16[{bm}, 64],{lc!r}>", "out_ptr": "*bf16", "offs_ptr": "*i32", "N": "i32",
           "K": "i32", "L": "i32", "TILES": "i32"}
    const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_L": 128, "GROUP_M": 8, "STAGES": stages,
             "CONSUMERS": rest[0] if rest else 1, "WORKER_REGS": gm.WORKER_REGS,
             "SHIFT": rest[1] if len(rest) > 1 else 0, "num_warps": warps}
    sig.update({k: "constexpr" for k in const})
    names = gm._kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("sa_ptr", "sb_ptr", "out_ptr", "offs_ptr", "N",
                                                                    "K")}
    compiled = triton.compile(GluonASTSource(gm._kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "maxnreg": gm.MAXNREG})
    assert compiled.metadata.shared <= 232448
    (tmp_path / "k.ptx").write_text(compiled.asm["ptx"])
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert " 0 bytes spill stores" in res, res


@nvidia
@pytest.mark.parametrize("weighted", [False, True])
def test_gluon_fc1_swiglu_fits(tmp_path, weighted):
    """``gluon_fp8_fc1_swiglu`` (fc1's warp-specialized GEMM with the SwiGLU's FP8 copies in its epilogue), weighted
    and not, with 128 experts' offsets: within Hopper's shared memory, without spills (the epilogue's first version
    spilled: it kept a whole tile's values across its steps)."""
    import re
    import subprocess
    fk = pytest.importorskip("lightning_moe.modules.gluon_fp8_fc1_swiglu")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("this triton ships no ptxas")
    la = gl.NVMMASharedLayout.get_default_for([128, fk.BLOCK_K], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([fk.HALF, fk.BLOCK_K], gl.float8e4nv)
    lc = gl.NVMMASharedLayout.get_default_for([128, fk.HALF], gl.bfloat16)
    lq = gl.NVMMASharedLayout.get_default_for([128, fk.HALF], gl.float8e4nv)
    lqt = gl.NVMMASharedLayout.get_default_for([fk.HALF, 128], gl.float8e4nv)
    sig = {"a_desc": f"tensordesc<fp8e4nv[128, {fk.BLOCK_K}],{la!r}>", "sa_ptr": "*fp32",
           "b_desc": f"tensordesc<fp8e4nv[{fk.HALF}, {fk.BLOCK_K}],{lb!r}>", "sb_ptr": "*fp32",
           "c_desc": f"tensordesc<bf16[128, {fk.HALF}],{lc!r}>",
           "q_desc": f"tensordesc<fp8e4nv[128, {fk.HALF}],{lq!r}>",
           "qt_desc": f"tensordesc<fp8e4nv[{fk.HALF}, 128],{lqt!r}>", "h_ptr": "*bf16", "offs_ptr": "*i32",
           "p_ptr": "*fp32", "hist_ptr": "*fp32", "q_ptr": "*fp8e4nv", "amax_ptr": "*i32", "inv_m_ptr": "*fp32",
           "inv_l_ptr": "*fp32", "F": "i32", "K": "i32", "L": "i32", "TILES": "i32", "H": "i32"}
    const = {"FMAX": 448.0, "TINY": 1e-12, "HAS_P": weighted, "BLOCK_L": 128, "BLOCK_H": 32, "GROUP_M": 8,
             "STAGES": fk.NARROW_CONFIG[3], "WORKER_REGS": fk.WORKER_REGS, "num_warps": 4}
    sig.update({k: "constexpr" for k in const})
    names = fk._kernel.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("sa_ptr", "sb_ptr", "h_ptr", "offs_ptr",
                                                                    "q_ptr", "F", "K")}
    compiled = triton.compile(GluonASTSource(fk._kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": const["STAGES"], "maxnreg": fk.MAXNREG})
    assert compiled.metadata.shared <= 232448
    (tmp_path / "k.ptx").write_text(compiled.asm["ptx"])
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert int(re.search(r"(\d+) bytes spill stores", res).group(1)) == 0, res


def test_gluon_ws_gemm_config_choice():
    """Two consumers with shifted cut tiles at up to 1,024 rows per expert (Qwen3's block and micro-batches); one
    consumer of 128 x 256 tiles at more (Mixtral's)."""
    gm = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_ws")
    assert gm.config_for(128 * 1024, 128) == gm.NARROW_CONFIG == (128, 128, 4, 4, 2, 1)
    assert gm.config_for(65536, 128) == gm.NARROW_CONFIG
    assert gm.config_for(8 * 2048, 8) == gm.CONFIG == (128, 256, 8, 4)
    assert gm.config_for(8 * 1024 + 1, 8) == gm.CONFIG


def test_gluon_wgrad_config_choice():
    """Two consumers at up to 1,024 tokens per expert (plus a block of padding each) or into fp32; one consumer of
    128 x 256 tiles writing bf16 at more."""
    gw = pytest.importorskip("lightning_moe.modules.gluon_fp8_wgrad")
    assert gw.config_for(128 * 1024, 128) == gw.NARROW_CONFIG  # Qwen3's block
    assert gw.config_for(8 * (1024 + 128), 8) == gw.NARROW_CONFIG
    assert gw.config_for(8 * 2048, 8) == gw.CONFIG  # Mixtral's block, bf16
    assert gw.config_for(8 * 2048, 8, out_bytes=4) == gw.NARROW_CONFIG  # ... into an fp32 main grad


@nvidia
@pytest.mark.parametrize("F,M", [(14336, 16384), (768, 131072), (1024, 131072), (2048, 16384)])
@pytest.mark.parametrize("backward", [False, True])
def test_fused_swiglu_quant_configs_fit(tmp_path, F, M, backward):
    """``triton_fp8_swiglu``'s configs (Mixtral's, Qwen3's, OLMoE's, DeepSeek-V3's FFN widths), weighted, assembled for
    sm_90a by triton's ptxas: within the register cap where one is set, at most 64 bytes of spills (48 at Mixtral's
    backward as swept), and one barrier-synchronized quantization pass per row block."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_swiglu as tsw
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("this triton ships no ptxas")
    CHUNK, BM, BK, warps, stages, keep, acc_bf16, maxnreg = tsw.config(M, F, backward)
    K = 2 * F if backward else F
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "offs_ptr": "*i32", "gid_ptr": "*i32",
           "amax_ptr": "*i32", "M": "i32", "K": "i32", "L": "i32", "CHUNK": "i32", "h_ptr": "*bf16", "g_ptr": "*bf16",
           "p_ptr": "*fp32", "gp_ptr": "*fp32"}
    const = dict(FMAX=448.0, TINY=1e-12, BLOCK_M=BM, BLOCK_K=BK, NKB=K // BK, STAGES=stages, KEEP=keep, INV=True,
                 SOURCE=2 if backward else 1, HAS_P=True, ACC_BF16=acc_bf16)
    sig.update({c: "constexpr" for c in const})
    names = tq._rowwise_col_amax_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "q_ptr", "h_ptr", "g_ptr", "K")}
    compiled = triton.compile(ASTSource(tq._rowwise_col_amax_kernel, sig, const, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True,
                                       "maxnreg": maxnreg})
    (tmp_path / "k.ptx").write_text(compiled.asm["ptx"])
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    spills = int(res.split(" bytes spill stores")[0].rsplit(",", 1)[1])
    regs = int(res.split("Used ")[1].split(" registers")[0])
    assert spills <= 64, res
    assert regs <= (maxnreg or 255), res


def test_fused_swiglu_quant_config_choice():
    """Rows kept in registers, two rows per block up to 2,048 values per row, the column maxes in bf16, one warpgroup
    up to 3,072 values per block, two (capped at 128 registers) up to 16,384, and rows wider than 32,768 values read
    back (the sweep's choices, docs/PERFORMANCE.md)."""
    tsw = pytest.importorskip("lightning_moe.modules.triton_fp8_swiglu")
    assert tsw.config(131072, 768, False) == (256, 2, 256, 4, 3, True, True, None)  # Qwen3
    assert tsw.config(131072, 768, True) == (256, 2, 256, 4, 3, True, True, None)
    assert tsw.config(131072, 1024, True) == (256, 2, 1024, 8, 3, True, True, 128)  # OLMoE
    assert tsw.config(16384, 14336, False) == (32, 1, 2048, 8, 3, True, True, 128)  # Mixtral
    assert tsw.config(16384, 14336, True) == (32, 1, 2048, 8, 3, True, True, None)
    assert tsw.config(16384, 16384 + 4096, True)[4:6] == (1, False)  # read back
    assert not tsw.fuses(700) and tsw.fuses(768)


def _bf16_wgrad_asm(segments: bool, acc: bool):
    """``triton_grouped_wgrad``'s kernel (one micro-batch) or its segments kernel (a deferred window), compiled for
    sm_90 at the default config: (Triton GPU IR, PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_moe.modules import triton_grouped_wgrad as tk
    kernel = tk._wgrad_segments_kernel if segments else tk._wgrad_kernel
    sig = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*fp32", "offs_ptr": "*i32"}
    sig.update(dict(xoff_ptr="*i64", dyoff_ptr="*i64", S="i32", L="i32", K="i32", N="i32") if segments
               else dict(K="i32", N="i32", stride_x="i32", stride_dy="i32"))
    c = tk.DEFAULT
    const = dict(ACC=acc, **c.kwargs)
    sig.update({k: "constexpr" for k in const})
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr", "dy_ptr", "out_ptr", "offs_ptr", "K", "N",
                                                                    "stride_x", "stride_dy") if n in names}
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    return compiled.asm["ttgir"], compiled.asm["ptx"]


@nvidia
@pytest.mark.parametrize("acc", [False, True])
def test_bf16_segments_wgrad_loads_as_the_one_micro_batch_kernel(acc):
    """The deferred bf16 wgrad's segments kernel reads each segment through an offset loaded from memory: its inner
    loop must stay pipelined (2 * stages async copies) and its loads as wide as the one-micro-batch kernel's (the same
    number of cp.async instructions), which the offsets' divisibility hint gives."""
    ir1, ptx1 = _bf16_wgrad_asm(False, acc)
    irs, ptxs = _bf16_wgrad_asm(True, acc)
    from lightning_moe.modules import triton_grouped_wgrad as tk
    copies = "async_copy_global_to_local"
    assert irs.count(copies) == ir1.count(copies) == 2 * tk.DEFAULT.num_stages
    n_s, n_1 = (ptx.count("cp.async.cg") + ptx.count("cp.async.ca") for ptx in (ptxs, ptx1))
    assert n_s == n_1 > 0


@nvidia
@pytest.mark.parametrize("source", [0, 1, 2])
def test_one_pass_quantization_loads_its_column_blocks_ahead(source, tmp_path):
    """``triton_fp8_both``'s shipped configs, compiled for sm_90a with triton's ptxas: where a program takes several
    column blocks (x), its loads are asynchronous copies STAGES deep (the prologue's STAGES - 1 and the loop's);
    the others load plainly; no spills in any."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_moe.modules import triton_fp8_both as tb
    bp, bx, warps, loop, stages = tb.config(2048 if source == 0 else 768, source)
    sig = {n: "*bf16" for n in ("x_ptr", "h_ptr", "g_ptr", "p_ptr")}
    sig.update(gp_ptr="*fp32", hist_ptr="*fp32", offs_ptr="*i32", poffs_ptr="*i32", gid_ptr="*i32", q_ptr="*fp8e4nv",
               qt_ptr="*fp8e4nv", amax_ptr="*i32", inv_m_ptr="*fp32", inv_l_ptr="*fp32", P="i32", W="i32", L="i32",
               H="i32", QT_STRIDE="i32")
    const = dict(FMAX=448.0, TINY=1e-12, SOURCE=source, HAS_P=source > 0, BLOCK_P=bp, BLOCK_X=bx,
                 BLOCK_EXPERT=True, BLOCK_H=16, LOOP=loop, STAGES=stages)
    sig.update({c: "constexpr" for c in const})
    names = tb._both_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n in ("P", "W", "QT_STRIDE")}
    compiled = triton.compile(ASTSource(tb._both_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
    if loop > 1:
        assert copies == stages * (1 if source == 0 else 2 if source == 1 else 3)
    else:
        assert copies == 0
    (tmp_path / "k.ptx").write_text(compiled.asm["ptx"])
    res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True).stderr
    assert " 0 bytes spill stores" in res, res
