#!/usr/bin/env python3
"""step_profile.py on traces written here, whose steps, gaps and kernels are known."""

import io
import os
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_profile  # noqa: E402

HEADER = ["Start (ns)", "Duration (ns)", "CorrId", "GrdX", "Strm", "Name"]
ATTN = "void colod::kernels::cuda::(anonymous namespace)::FlashForwardMmaKernel<128, colod::Bf16, 2>(const T*, int)"
NORM = "void colod::kernels::cuda::LayerNormWarpKernel<colod::Bf16>(const colod::Bf16*, long)"
GEMM = "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT"
READ = "[CUDA memcpy Device-to-Host]"


def write(rows, preamble=()):
    f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    for line in preamble:
        f.write(line + "\n")
    f.write(",".join(f'"{h}"' for h in HEADER) + "\n")
    for start, dur, name in rows:
        f.write(f'{start},{dur},1,1,7,"{name}"\n')
    f.close()
    return f.name


def run(path, *args):
    out = io.StringIO()
    with redirect_stdout(out):
        sys.argv = ["step_profile.py", path, *args]
        rc = step_profile.main()
    return rc, out.getvalue()


class StepProfile(unittest.TestCase):
    def trace(self):
        # A start-up read with 2 kernels before it, then a step of 60 kernels
        # (t = 1000 us on): 20 each of attention (20 us), norm (5 us) and
        # GEMM (30 us), back to back but for a 100 us gap after the 10th
        # and 2 us gaps after every GEMM; then the step's read (5 us).
        rows = [(0, 10_000, NORM), (20_000, 10_000, GEMM), (50_000, 5_000, READ)]
        t = 1_000_000
        rows.append((t - 5_000, 5_000, READ))  # the previous step's read ends at t
        for i in range(20):
            for name, dur in ((ATTN, 20_000), (NORM, 5_000), (GEMM, 30_000)):
                rows.append((t, dur, name))
                t += dur
            t += 2_000
            if i == 9:
                t += 100_000
        rows.append((t, 5_000, READ))
        return rows, t + 5_000 - 1_000_000

    def test_the_last_step_its_busy_and_idle_time_gaps_and_kernels(self):
        rows, wall = self.trace()
        path = write(rows, preamble=["Processing [x.sqlite] with [cuda_gpu_trace.py]... "])
        rc, out = run(path, "--top", "2")
        self.assertEqual(rc, 0, out)
        busy = 20 * (20_000 + 5_000 + 30_000) + 5_000  # and the read itself
        idle = wall - busy
        self.assertEqual(idle, 20 * 2_000 + 100_000)
        self.assertIn(f"{wall / 1e6:.2f} ms from read to read, 61 GPU operations", out)
        self.assertIn(f"the GPU busy {busy / 1e6:.2f} ms", out)
        self.assertIn(f"idle {idle / 1e6:.2f} ms in 20 gaps, 0.10 ms of it in 1 gaps of 10 us or more", out)
        # The longest gap, between the 10th GEMM and the 11th attention.
        at = 10 * 55_000 + 9 * 2_000
        self.assertIn(f"| 102.0 us | {at / 1e6:.3f} | {GEMM} | FlashForwardMmaKernel |", out)
        self.assertIn(f"| {GEMM} | 20 | 0.600 | {100 * 600_000 / wall:.1f} % |", out)
        self.assertIn(f"| FlashForwardMmaKernel | 20 | 0.400 |", out)
        self.assertIn("| 2 others | 21 | 0.105 |", out)  # the norms and the read
        self.assertNotIn("LayerNormWarpKernel | 20", out.split("2 others")[0].split("| kernels")[1])

    def test_no_step_in_a_trace_of_start_up_alone(self):
        rows = [(0, 10_000, NORM), (20_000, 5_000, READ), (40_000, 10_000, GEMM), (60_000, 5_000, READ)]
        rc, out = run(write(rows))
        self.assertEqual(rc, 1)
        self.assertIn("no step", out)

    def test_names(self):
        self.assertEqual(step_profile.short_name(ATTN), "FlashForwardMmaKernel")
        self.assertEqual(step_profile.short_name(NORM), "LayerNormWarpKernel")
        self.assertEqual(step_profile.short_name(GEMM), GEMM)
        self.assertEqual(step_profile.short_name("[CUDA memset]"), "[CUDA memset]")
        self.assertTrue(step_profile.is_read("[CUDA memcpy DtoH]"))
        self.assertTrue(step_profile.is_read(READ))
        self.assertFalse(step_profile.is_read("[CUDA memcpy Host-to-Device]"))

    def test_a_file_without_the_columns_is_refused(self):
        f = tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
        f.write("a,b,c\n1,2,3\n")
        f.close()
        proc = subprocess.run([sys.executable, step_profile.__file__, f.name], capture_output=True, text=True)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("no header with Start (ns), Duration (ns) and Name", proc.stderr)


if __name__ == "__main__":
    unittest.main()
