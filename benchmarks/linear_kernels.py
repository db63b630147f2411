"""The invariant kernel's linear layers against stock `F.linear`, on this machine.

Every width of smollm2-135m (and its output layer) at the row counts a question (16, 25 rows),
a long read (512 rows) and a prefill (4,096 rows) give, float32 and bfloat16: the median time of
`F.linear` (what sdpa and eager run: MKL's sgemm in float32), of the invariant kernel's layer
(`kvrag.kernels.linear`: oneDNN's product over a weight reordered once), and their ratio. Each
pair is checked to agree (allclose; the bits differ, being other arithmetic). Medians of --repeat
calls, one process: compare ratios.

    python benchmarks/linear_kernels.py [--repeat 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from kvrag.kernels.linear import make_linear_invariant

WIDTHS = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
ROWS = [16, 25, 512, 4096]


def median_ms(call, repeat: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows_out = []
    print("| dtype | layer (in x out) | rows | F.linear | invariant (oneDNN) | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for k, n in WIDTHS:
                torch.manual_seed(k + n)
                stock = torch.nn.Linear(k, n, bias=False, dtype=dtype)
                layer = make_linear_invariant(torch.nn.Sequential(copy.deepcopy(stock)))
                for rows in ROWS:
                    if n > 10_000 and rows > 512:
                        continue  # the output layer reads one row per question
                    x = torch.randn(rows, k, dtype=dtype)
                    assert torch.allclose(layer(x).float(), stock(x).float(), rtol=2e-2, atol=2e-2)
                    plain = median_ms(lambda: torch.nn.functional.linear(x, stock.weight), args.repeat)
                    ours = median_ms(lambda: layer(x), args.repeat)
                    name = str(dtype).removeprefix("torch.")
                    rows_out.append({"dtype": name, "in": k, "out": n, "rows": rows, "f_linear_ms": plain,
                                     "invariant_ms": ours, "speedup": plain / ours})
                    print(f"| {name} | {k}x{n} | {rows} | {plain:.3f} ms | {ours:.3f} ms | {plain / ours:.2f}x |")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
