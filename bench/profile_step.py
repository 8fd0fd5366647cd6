"""GPU kernels of one workload's step under torch.profiler (eager and fuselens), to see where
time goes: PYTHONPATH=compiler python bench/profile_step.py "mlp fwd+bwd bf16" """
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from run import profile_calls, step  # noqa: E402
from workloads import workloads  # noqa: E402

import fuselens  # noqa: E402


def main(name):
    w = next(w for w in workloads() if w.name == name)
    inputs = w.make_inputs()
    for label, fn in (("eager", w.fn), ("fuselens", fuselens.compile(w.fn))):
        prof = profile_calls(step(fn, inputs, w.backward))
        print(f"== {label} (5 steps)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1])
