"""Build FlashInfer's attention modules for the embedded engine ahead of time, on any machine with nvcc.

FlashInfer compiles its kernels on first use (JIT, minutes per module). The GPU host's time is scarce, and
nothing in the build needs a GPU, so this builds them here for the H200 (``sm_90a``) into ``OUT/<module>/
<module>.so``. Copied into the installed package as ``flashinfer/data/aot/<module>/<module>.so`` there, they load
without a build (FlashInfer looks for such artifacts before it compiles). Only the modules the backend uses:
bf16 queries and KV, int32 indices, the head dims given (SmolLM2-135M: 64, Llama-3-8B: 128), no positional
encoding in the kernel, no sliding window, no soft cap; the "primary" module holds the plan, the ragged and the
equal-stride paged kernels (our K and V caches share strides).

    CUDA_HOME=/usr/local/cuda python3 benchmarks/flashinfer_aot.py OUT 64 128

The link step wants ``libcuda.so`` (the driver) in ``$CUDA_HOME/lib64/stubs``; a machine without a driver can
give it an empty stand-in named ``libcuda.so.1`` (``gcc -shared -Wl,-soname,libcuda.so.1``): the driver's
symbols are resolved where the module is loaded.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    import torch
    from flashinfer.prefill import _gen_batch_prefill_primary_module

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for head_dim in (int(x) for x in sys.argv[2:]):
        args = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, head_dim, head_dim, 0, False, False,
                False)
        spec = _gen_batch_prefill_primary_module("fa2", *args)
        start = time.perf_counter()
        spec.build(verbose=False)
        target = out / spec.name
        target.mkdir(exist_ok=True)
        shutil.copy2(spec.jit_library_path, target / spec.jit_library_path.name)
        print(f"{spec.name}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
