"""The cost of one grid barrier of the persistent decode kernel (`kernels._grid_sync`), alone.

One kernel of 1,000 barriers and nothing else, for grids of one program an SM down to one program:
what each of `kernels.stack_decode`'s ~5 steps a layer pays to wait for every program.

    python -m bench.barrier_probe
"""
from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl

from engine.model.kernels import _grid_last_arrival, _grid_sync


@triton.jit
def _barriers(counter_ptr, n):
    P = tl.num_programs(0)
    for i in range(n):
        _grid_sync(counter_ptr, (i + 1) * P)
    _grid_last_arrival(counter_ptr, (n + 1) * P)


def main() -> int:
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 1000
    for programs in (sms, sms // 2, 32, 16, 8, 1):
        for warps in (1, 4):
            _barriers[(programs,)](counter, 10, num_warps=warps)      # compile, warm up
            torch.cuda.synchronize()
            t = time.perf_counter()
            _barriers[(programs,)](counter, n, num_warps=warps)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / n * 1e6
            print(f"RESULT barrier programs={programs} warps={warps}: {us:.2f} us a barrier, counter {int(counter)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
