"""Page faults of a packed causal forward against the same sequences one by one.

docs/PERFORMANCE.md, "Packed variable-length batches": the batch of
bench/varlen_bench.cpp (16 sequences, H = 8, E = 64, one thread), timed and
counted (minor page faults, getrusage) per call, in random order:

  packed               varlen_attention on the packed (T, H, E) tensors
  one_by_one           softmax_attention on each sequence stored apart
  one_by_one_gathered  the same, its outputs then gathered into one (T, H, M)

and what one fault costs on this machine: filling a fresh tensor the size of
the packed output against filling one that is reused, and a fresh one whose
pages are first advised to be huge (madvise MADV_HUGEPAGE, where transparent
huge pages are "madvise"; 2 MiB pages fault 512 times less often).

    PYTHONPATH=python /usr/bin/python3 bench/varlen_faults.py [repetitions]
"""
import ctypes
import itertools
import mmap
import random
import resource
import statistics
import sys
import time

import torch

import attnkit

LENGTHS = [4048, 3094, 109, 4080, 171, 333, 321, 1037, 3133, 2162, 236, 567, 405, 166, 591, 2864]
H, E = 8, 64


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(functions, repetitions):
    """Median and minimum milliseconds and median faults per call of each function."""
    times = {f.__name__: [] for f in functions}
    faults = {f.__name__: [] for f in functions}
    for f in functions:  # a first call of each, untimed
        f()
    for _ in range(repetitions):
        for f in random.sample(functions, len(functions)):
            before, start = minor_faults(), time.perf_counter()
            f()
            times[f.__name__].append(time.perf_counter() - start)
            faults[f.__name__].append(minor_faults() - before)
    for name in times:
        print("%-22s median %7.1f ms  min %7.1f ms  minor faults per call %d" % (
            name, statistics.median(times[name]) * 1e3, min(times[name]) * 1e3, statistics.median(faults[name])))


def main():
    repetitions = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    torch.set_num_threads(1)
    torch.manual_seed(1)
    random.seed(1)
    offsets = [0] + list(itertools.accumulate(LENGTHS))
    q, k, v = (torch.randn(offsets[-1], H, E) for _ in range(3))
    cu = torch.tensor(offsets)
    apart = [tuple(t[a:b].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
             for a, b in zip(offsets[:-1], offsets[1:])]

    def packed():
        return attnkit.varlen_attention(q, k, v, cu, cu, causal=True)

    def one_by_one():
        return [attnkit.softmax_attention(a, b, c, causal=True) for a, b, c in apart]

    def one_by_one_gathered():
        return torch.cat([out.squeeze(0).transpose(0, 1) for out in one_by_one()])

    print("lengths", LENGTHS, "H", H, "E", E, "threads", torch.get_num_threads(), "seed 1")
    measure([packed, one_by_one, one_by_one_gathered], repetitions)

    size = offsets[-1] * H * E  # the packed output's floats
    reused = torch.empty(size)

    def fresh_fill():
        torch.empty(size).fill_(1.0)

    def reused_fill():
        reused.fill_(1.0)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE

    def fresh_fill_huge_pages():
        t = torch.empty(size)
        begin = -(-t.data_ptr() // page) * page  # the whole pages inside the tensor
        end = (t.data_ptr() + 4 * size) // page * page
        if libc.madvise(begin, end - begin, 14) != 0:  # MADV_HUGEPAGE
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE)")
        t.fill_(1.0)

    print("a fill of %.1f MB" % (size * 4 / 1e6))
    measure([fresh_fill, reused_fill, fresh_fill_huge_pages], 2 * repetitions + 1)


if __name__ == "__main__":
    main()
