"""Run by test_oom.py in subprocesses: timm convnext_atto at 64 px, two windows of 128 samples,
SGD, one thread, under an address-space limit (RLIMIT_AS) set `extra` MiB above the process
once the model has taken one small step.

    python real_oom_timm_script.py count               -> only the small step (ONEDNN_VERBOSE=all
                                                          prints its oneDNN cache entries)
    python real_oom_timm_script.py need MICRO          -> prints the MiB one step at MICRO adds
    python real_oom_timm_script.py clean EXTRA MICRO   -> OK or FAIL: trains at MICRO, no back-off
    python real_oom_timm_script.py backoff EXTRA OUT   -> starts at 128, backs off; saves weights
    python real_oom_timm_script.py stuck               -> breaks oneDNN's kernel builder (a new
                                                          shape's kernel under no headroom), lifts
                                                          the limit, then a window at 16: one line

test_oom.py imports build() for the reference without a limit."""

import os
import resource
import sys

import torch
import torch.nn.functional as F

from bigbatch import Accumulator
from bigbatch.backoff import OOMBackoff, OutOfMemoryAtMinimumError, run_window
from bigbatch.device import bound_onednn_cache, return_freed_cpu_memory


def build() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", num_classes=10)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 3, 64, 64, generator=g)
    return model, x, torch.randint(0, 10, (128,), generator=g)


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


if __name__ == "__main__":
    # Threads need address space too (their stacks, oneDNN's per-thread scratch): one unless told.
    torch.set_num_threads(int(os.environ.get("BIGBATCH_TEST_THREADS", "1")))
    mode = sys.argv[1]
    if os.environ.get("BIGBATCH_TEST_RETURN") == "1":
        return_freed_cpu_memory()  # large blocks back to the system from the start
    model, x, y = build()
    if os.environ.get("BIGBATCH_TEST_BOUND", "1") == "1":
        # Before its first convolution; BIGBATCH_TEST_ENTRIES: a counted size's entries (52),
        # BIGBATCH_TEST_SIZES: how many sizes the cache holds (2).
        entries = os.environ.get("BIGBATCH_TEST_ENTRIES")
        bound_onednn_cache(
            model,
            sizes=int(os.environ.get("BIGBATCH_TEST_SIZES", "2")),
            entries_per_size=int(entries) if entries else None,
        )
    acc = Accumulator(torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    # One small step first, so kernels and their buffers exist, as in a run already going.
    run_window(acc, (x[:2], y[:2]), loss_fn, OOMBackoff(micro_batch=2))
    if mode == "count":  # under ONEDNN_VERBOSE=all: its cache_miss lines are one size's entries
        sys.exit(0)
    if mode == "need":
        before = status("VmSize")
        run_window(acc, (x, y), loss_fn, OOMBackoff(micro_batch=int(sys.argv[2])))
        print((status("VmPeak") - before) // 2**20)
        sys.exit(0)
    if mode == "stuck":
        from bigbatch.device import onednn_stuck

        healthy = not onednn_stuck()
        conv = model.stem[0]  # a shape never built: its kernel's code buffer cannot be mapped
        resource.setrlimit(resource.RLIMIT_AS, (status("VmSize"), resource.RLIM_INFINITY))
        try:
            conv(x[:3, :, :9, :9])
            broke = "no error"
        except RuntimeError as exc:
            broke = str(exc)[:40]
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        backoff = OOMBackoff(micro_batch=16, grow_after=0)
        try:
            run_window(acc, (x, y), loss_fn, backoff)
            outcome = "trained"
        except OutOfMemoryAtMinimumError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        print(f"healthy={healthy} broke={broke} events={len(backoff.events)} {outcome}")
        sys.exit(0)
    extra = int(sys.argv[2])
    resource.setrlimit(
        resource.RLIMIT_AS, (status("VmSize") + extra * 2**20, resource.RLIM_INFINITY)
    )
    if mode == "clean":
        backoff = OOMBackoff(micro_batch=int(sys.argv[3]), grow_after=0)
        try:
            for _ in range(2):
                run_window(acc, (x, y), loss_fn, backoff)
        except OutOfMemoryAtMinimumError:
            pass
        print("OK" if not backoff.events else "FAIL")
        sys.exit(0)
    backoff = OOMBackoff(micro_batch=128, grow_after=0)
    for _ in range(2):
        run_window(acc, (x, y), loss_fn, backoff)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(backoff.micro_batch, [(e.old, e.new) for e in backoff.events])
    torch.save(model.state_dict(), sys.argv[3])
