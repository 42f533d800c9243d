"""Dropless token all-to-all transports on N GPUs: host splits vs sync-free (padded, symmetric memory).

    torchrun --nproc-per-node 2 benchmarks/bench_a2a_transport.py --rows 131072 --hidden 2048 --out a2a.json

Each rank sends `rows` bf16 rows of `hidden`, split over the ranks by random counts drawn on the device (a router's
skew: `--skew`). Three ways, timed with CUDA events over the same splits:
  host     the counts go to the host (one .cpu() per call), then NCCL all_to_all_single: today's dropless path;
  padded   every (sender, receiver) slot holds `rows` rows: static splits, no host sync, `world`x the bytes;
  symm     torch.ops.symm_mem.all_to_all_vdev (NVSHMEM): device splits, only the rows sent move.
It also checks that the symm and padded results equal the host one. Prints one JSON object per rank 0.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--skew", type=float, default=0.3, help="fraction of random imbalance of the split sizes")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        assert os.environ.get(k, v) == v, f"{k} must stay {v} on shared hosts"
        os.environ[k] = v
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    g = torch.Generator(device=dev).manual_seed(rank)
    w_P = 1 + a.skew * torch.rand(world, device=dev, generator=g)
    send_P = (w_P / w_P.sum() * a.rows).long()
    send_P[-1] += a.rows - send_P.sum()
    x_ND = torch.randn(a.rows, a.hidden, device=dev, dtype=torch.bfloat16)
    res = {"world": world, "rows": a.rows, "hidden": a.hidden, "torch": torch.__version__,
           "device": torch.cuda.get_device_name()}

    def host():
        recv_P = torch.empty_like(send_P)
        dist.all_to_all_single(recv_P, send_P)
        s, r = send_P.tolist(), recv_P.tolist()  # the host sync this issue removes
        out = x_ND.new_empty(sum(r), a.hidden)
        dist.all_to_all_single(out, x_ND, r, s)
        return out

    starts_P = send_P.cumsum(0) - send_P
    dest_N = torch.repeat_interleave(torch.arange(world, device=dev), send_P, output_size=a.rows)
    slot_N = dest_N * a.rows + torch.arange(a.rows, device=dev) - starts_P[dest_N]

    def padded():
        buf = x_ND.new_zeros(world * a.rows, a.hidden).index_copy_(0, slot_N, x_ND)
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf)
        return out

    ref = host()
    recv_host = ref.shape[0]
    recv_P = torch.empty_like(send_P)
    dist.all_to_all_single(recv_P, send_P)
    out_pad = padded().view(world, a.rows, a.hidden)
    ok_pad = all(torch.equal(out_pad[s, : int(recv_P[s])], part) for s, part in
                 enumerate(ref.split(recv_P.tolist())))
    res["padded_equal"] = ok_pad
    timers = {"host": host, "padded": padded}
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend("NVSHMEM")
        gname = dist.group.WORLD.group_name
        symm_mem.enable_symm_mem_for_group(gname)
        inp = symm_mem.empty(a.rows, a.hidden, dtype=torch.bfloat16, device=dev)
        out = symm_mem.empty(world * a.rows, a.hidden, dtype=torch.bfloat16, device=dev)
        splits = symm_mem.empty(world, dtype=torch.int64, device=dev)
        out_so = symm_mem.empty(2, world, dtype=torch.int64, device=dev)
        for t in (inp, out, splits, out_so):
            symm_mem.rendezvous(t, gname)

        def symm():
            inp.copy_(x_ND)
            splits.copy_(send_P)
            # peers write into out/out_so: everyone must be done reading the previous call's (GPU-side barrier)
            dist.barrier(async_op=True, device_ids=[rank]).block_current_stream()
            torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, out_so, gname)
            return out

        symm()
        torch.cuda.synchronize()
        res["symm_splits_are_rows"] = bool(torch.equal(out_so[0], recv_P))
        res["symm_equal"] = bool(torch.equal(out[:recv_host], ref))
        timers["symm"] = symm
    except Exception as e:  # noqa: BLE001 - record why, time the rest
        res["symm_error"] = f"{type(e).__name__}: {e}"[:400]
    for name, fn in timers.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / a.iters
        res[f"{name}_ms"] = round(ms, 4)
        res[f"{name}_GBps_payload"] = round(a.rows * a.hidden * 2 * (world - 1) / world / ms / 1e6, 1)
    all_res = [None] * world
    dist.all_gather_object(all_res, res)
    if rank == 0:
        text = json.dumps({"ranks": all_res})
        print(text)
        if a.out:
            open(a.out, "w").write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
