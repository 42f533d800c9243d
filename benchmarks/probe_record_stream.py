"""Does memory_allocated fall when a small (< 1 MiB, small-pool) or large tensor that was recorded on a side stream is
freed, after a device sync and one new allocation? (Diagnoses the ActivationOffload memory test.)"""
import torch

side = torch.cuda.Stream()
for nbytes in (512 * 1024, 1024 * 1024, 4 << 20):
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
    x.record_stream(side)
    before = torch.cuda.memory_allocated()
    del x
    torch.cuda.synchronize()
    a = torch.cuda.memory_allocated()
    torch.empty(1, device="cuda")
    b = torch.cuda.memory_allocated()
    big = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    c = torch.cuda.memory_allocated() - big.numel()
    del big
    print(f"{nbytes >> 10} KiB: freed after del+sync {before - a}, after a small alloc {before - b}, "
          f"after a large alloc {before - c}")
