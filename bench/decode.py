"""LLM decoding (issue 42): eager vs fuselens vs torch.compile (Inductor) generating tokens one at
a time, in the default mode and in mode="reduce-overhead" (CUDA graphs), and compiles of inputs
whose lengths vary.

    PYTHONPATH=compiler python bench/decode.py --json bench/results/decode-h200.json
    PYTHONPATH=compiler python bench/decode.py --only llama7b --layers 16 --batch 1 --json a.json
    PYTHONPATH=compiler python bench/decode.py --quick                       # the whole set, small
    python bench/decode.py --merge a.json b.json --json bench/results/decode-h200.json
    PYTHONPATH=compiler python bench/decode.py --only llama1b --inductor-from bench/results/decode-h200.json

--inductor-from takes Inductor's columns of a row from an earlier run on the same GPU and torch
version instead of compiling and timing Inductor again (its compiles dominate a row's minutes);
eager and fuselens are always timed side by side in the run.

Decode rows (kind "decode"), per workload, batch and mode: a prompt of 64 tokens is prefilled by
the eager model, then 256 new tokens are generated greedily, each step a call with a fresh position
tensor (the step of bench/decode_models.py's decoder, or transformers' forward with a StaticCache,
or transformers' `generate(..., cache_implementation="static")` with the forward compiled: its time
includes the prefill). Reported: milliseconds per token (the median of --rounds rounds alternating
eager, fuselens and Inductor, timed with CUDA events), the memory-bandwidth utilisation (the bytes
a step must read: every weight, the embedding table's looked-up rows only, and the KV cache's
filled part at the mean position; over the time per token and --peak-gbs), the peak memory of
a generation's decode steps (from the end of its prefill; `generate` rows: the whole generation)
and the memory each compiler's first generation leaves held (`<compiler>_held_mb`: its CUDA
graphs' pools, constants and workspaces; torch's reserved memory with the cache emptied, before
and after). Dynamic rows (kind "dynamic"): BERT-base inference over 12 batches of 7 sequence
lengths, and the decoder's prefill over 12 prompts of 7 lengths, each compiler fresh (dynamic=None:
what a size change does is each compiler's own): the total seconds, compiles included, and the
steady milliseconds of a length none of them saw. Without a GPU (or with --device cpu) every
workload runs at a tiny size, in the default mode only (CUDA graphs and peak memory are GPU
things): a test of the script, not a measurement.

On a GPU each workload runs in a process of its own: a compiler that kills the process (torch
2.11's Inductor dies of SIGSEGV recording CUDA graphs of transformers' generate) loses its columns
of that row, marked `<compiler>_error`, and the row is run again without it."""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fuselens  # noqa: E402
import run  # noqa: E402
from decode_models import (CONFIGS, build_decoder, build_hf, cache_kwargs, config, decode_one,  # noqa: E402
                           static_cache, weight_bytes)
from run import in_rounds, median  # noqa: E402
import suite  # noqa: E402
from suite import empty_disk_caches, fmt, machine  # noqa: E402

DECODE = ("llama1b", "llama7b", "hf-llama-steps", "hf-llama-generate", "hf-qwen2-steps", "hf-qwen2-generate")
DYNAMIC = ("bert-dynamic", "prefill-dynamic")
COMPILERS = ("eager", "fuselens", "inductor")


class Setup:
    """What every row of a run shares: device, dtype, sizes, timing."""

    def __init__(self, a):
        self.device, self.cuda = a.device, a.device.startswith("cuda")
        self.tiny = not self.cuda  # (a CPU runs the script's tiny sizes: a test, not a measurement)
        self.quick = a.quick or self.tiny
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.prompt, self.new = (8, 8) if self.tiny else (16, 32) if a.quick else (64, 256)
        self.layers, self.peak_gbs = a.layers, a.peak_gbs
        self.modes = ("default", "reduce-overhead") if self.cuda else ("default",)
        self.progress = a.progress  # a file naming the mode and compiler running (read after a crash)
        self.measuring = False  # (peak_mb running: after_prefill starts the count again)
        # {(mode, compiler): why it is left out}: what crashed an earlier process of this row
        self.skip = {(m, c): why for m, c, why in (x.split(":", 2) for x in a.skip)}
        self.reused = suite.inductor_rows(a.inductor_from, machine(), key, "decode")  # {row key: an earlier row}

    def reuse(self, row: dict, calls: dict) -> dict:
        """`calls` without Inductor's where an earlier run of this GPU and torch has the row (its
        Inductor columns copied into `row`: Inductor's compiles dominate a row's time)."""
        old = self.reused.get(key(row))
        if old is None:
            return calls
        row.update({k: v for k, v in old.items() if k.startswith(INDUCTOR_COLUMNS)})
        row["inductor_from_earlier_run"] = True
        return {c: fn for c, fn in calls.items() if c != "inductor"}

    def calls(self, mode, calls: dict, row: dict) -> dict:
        """`calls` without the compilers left out of `mode` (their errors put in `row`), each
        naming itself in the progress file as it starts."""
        kept = {}
        for c, fn in calls.items():
            if (mode, c) in self.skip:
                row[f"{c}_error"] = self.skip[mode, c]
            else:
                kept[c] = self._announced(mode, c, fn)
        return kept

    def _announced(self, mode, c, fn):
        if not self.progress:
            return fn

        def call(*args, **kwargs):
            pathlib.Path(self.progress).write_text(f"{mode}:{c}")
            return fn(*args, **kwargs)
        return call

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn):
        """Milliseconds of fn() (CUDA events on a GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def peak_mb(self, fn):
        """The peak memory of a generation's decode steps: counted from the end of its prefill
        (eager for every compiler, and above any decode step's at these sizes, it was all the
        column showed) where the workload marks it (`after_prefill`), else the whole generation."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.measuring = True
        try:
            fn()
        finally:
            self.measuring = False
        torch.cuda.synchronize()
        return round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)

    def after_prefill(self):
        if self.measuring:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def held_mb(self, fn):
        """(fn's result, its seconds, the memory a compiler holds after it: CUDA graphs' pools,
        constants, workspaces), as the device memory torch reserves with its cache emptied, before
        and after (None without a GPU). Around a compiler's first generation, which compiles and
        records: around the second, the pools were already there (the first GPU run read 0 MB)."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
        t = time.perf_counter()
        out = fn()
        self.sync()
        seconds = time.perf_counter() - t
        if not self.cuda:
            return out, seconds, None
        torch.cuda.empty_cache()
        return out, seconds, round((torch.cuda.memory_reserved() - before) / 2 ** 20, 1)


def compilers(fn, mode):
    """{compiler: fn as it runs}: eager, fuselens.compile and torch.compile in `mode`, shapes fixed."""
    return {"eager": fn, "fuselens": fuselens.compile(fn, mode=mode, dynamic=False),
            "inductor": torch.compile(fn, mode=mode, dynamic=False)}


# -- decode workloads: each gives {compiler: generate()} per mode, and the bytes a step reads -------

class OwnDecoder:
    """bench/decode_models.py's decoder: prefill eager, then `decode_one` steps compiled."""

    def __init__(self, s: Setup, name, batch):
        self.s, self.cfg = s, config("tiny" if s.tiny else name, s.layers, s.quick)
        self.model = build_decoder(self.cfg, batch, s.prompt + s.new, s.dtype, s.device)
        gen = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, self.cfg.vocab, (batch, s.prompt), generator=gen).to(s.device)
        self.batch = batch

    def kv_bytes_per_position(self):
        c = self.cfg
        return 2 * c.layers * self.batch * c.kv_heads * c.head_dim * self.s.dtype.itemsize

    def weight_bytes(self):
        return weight_bytes(self.model, self.batch)

    def generators(self, mode):
        steps = compilers(decode_one, mode)
        s, m, p = self.s, self.model, self.s.prompt

        def generator(step):
            def generate():
                with torch.no_grad():
                    tok = decode_one(m, self.tokens, torch.arange(p, device=s.device))
                    s.after_prefill()
                    out = [tok]
                    for i in range(s.new - 1):
                        tok = step(m, tok, torch.tensor([p + i], device=s.device)).clone()
                        out.append(tok)
                return torch.cat(out, 1)
            return generate
        return {c: generator(step) for c, step in steps.items()}, steps["fuselens"]


class HFDecoder:
    """transformers' model with a StaticCache: `steps` calls its forward, compiled, once per token
    (prefill eager); `generate` runs model.generate(cache_implementation="static") with the forward
    replaced by the compiled one (transformers' own torch.compile turned off)."""

    def __init__(self, s: Setup, name, batch):
        self.s, self.batch = s, batch
        self.arch, self.kind = name.rsplit("-", 1)
        self.model = build_hf(self.arch, s.dtype, s.device, s.layers, s.quick, tiny=s.tiny)
        self.cfg = self.model.config
        gen = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, min(self.cfg.vocab_size, 30000), (batch, s.prompt), generator=gen).to(s.device)

    def kv_bytes_per_position(self):
        c = self.cfg
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * self.batch * c.num_key_value_heads * head_dim * self.s.dtype.itemsize

    def weight_bytes(self):
        return weight_bytes(self.model, self.batch)

    def generators(self, mode):
        m, s, p = self.model, self.s, self.s.prompt
        forwards = compilers(m.forward, mode)
        if self.kind == "generate":
            m.generation_config.disable_compile = True
            kw = dict(attention_mask=torch.ones_like(self.tokens), max_new_tokens=s.new, min_new_tokens=s.new,
                      do_sample=False, cache_implementation="static", pad_token_id=0)

            def generator(forward):
                def generate():
                    m.forward = forward
                    try:
                        with torch.no_grad():
                            return m.generate(self.tokens, **kw)[:, p:]
                    finally:
                        del m.forward  # (the class's forward again)
                return generate
        else:
            def generator(forward):
                cache = static_cache(m, p + s.new)  # one per compiler, reset by each generation

                def generate():
                    with torch.no_grad():
                        cache.reset()
                        tok = m(input_ids=self.tokens, **cache_kwargs(m, cache)).logits[:, -1:].argmax(-1)
                        s.after_prefill()
                        out = [tok]
                        for i in range(s.new - 1):
                            pos = torch.full((self.batch, 1), p + i, device=s.device)
                            logits = forward(input_ids=tok, **cache_kwargs(m, cache), position_ids=pos).logits
                            tok = logits[:, -1:].argmax(-1)
                            out.append(tok)
                    return torch.cat(out, 1)
                return generate
        return {c: generator(f) for c, f in forwards.items()}, forwards["fuselens"]


def decode_rows(s: Setup, name, batch, rounds):
    w = (OwnDecoder if name in CONFIGS else HFDecoder)(s, name, batch)
    # the bytes a step must read: weights, and the cache's filled part at the mean position
    step_bytes = w.weight_bytes() + w.kv_bytes_per_position() * (s.prompt + s.new / 2)
    rows = []
    for mode in s.modes:
        row = {"kind": "decode", "workload": name, "batch": batch, "mode": mode, "prompt": s.prompt,
               "new_tokens": s.new, "dtype": str(s.dtype).removeprefix("torch."), "step_mb": round(step_bytes / 2 ** 20, 1)}
        try:
            gens, compiled = w.generators(mode)
            gens = s.calls(mode, s.reuse(row, gens), row)
            tokens = {}
            for c, g in gens.items():  # first generation: compiles (and records CUDA graphs)
                tokens[c], seconds, held = s.held_mb(g)
                row[f"{c}_first_s"] = round(seconds, 2)
                if c != "eager" and held is not None:
                    row[f"{c}_held_mb"] = held
            for c in tokens.keys() - {"eager"}:  # greedy tokens of a random model: bf16 rounding may part them
                row[f"{c}_tokens_equal"] = round((tokens[c] == tokens["eager"]).float().mean().item(), 3)
            for g in gens.values():  # warm
                g()
            times = in_rounds(gens, lambda g: s.ms(g))
            for c, ms in times.items():
                row[f"{c}_ms_per_token"] = round(median(ms) / s.new, 4)
                row[f"{c}_tokens_per_s"] = round(batch * s.new * 1e3 / median(ms), 1)
                if c != "eager":
                    row[f"mbu_{c}"] = round(step_bytes / (row[f"{c}_ms_per_token"] / 1e3) / (s.peak_gbs * 1e9), 3)
                    row[f"{c}_peak_mb"] = s.peak_mb(gens[c])
            entries = fuselens.inspect(compiled)
            row["fuselens_graphs"] = sum(len(e.graphs) for e in entries)
            row["fuselens_breaks"] = sum(e.graph_break is not None for e in entries)
        except Exception as e:  # noqa: BLE001 (a row that fails says why; the others go on)
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        torch._dynamo.reset()
    return rows


# -- dynamic workloads: lengths that vary ----------------------------------------------------------

LENGTHS = (64, 96, 128, 160, 192, 256, 320)  # 12 batches cycle through them; 224 is the unseen length
UNSEEN = 224


def bert_calls(s: Setup, batch=8):
    """(model, inputs(length)) of BERT-base inference (transformers, random weights)."""
    import transformers as T
    from models import no_dropout_config
    kw = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256) if s.tiny else {}
    torch.manual_seed(0)
    with torch.device(s.device):
        model = T.BertModel(no_dropout_config(T.BertConfig(**kw)))
    model = model.to(s.dtype).eval().requires_grad_(False)
    return model, lambda n: {"input_ids": torch.randint(3, 30000, (batch, n), device=s.device)}


def prefill_calls(s: Setup, batch=1):
    """(model, inputs(length)) of the decoder's prefill: a prompt of `length` tokens at positions 0.."""
    cfg = config("tiny" if s.tiny else "llama1b", s.layers, s.quick)
    model = build_decoder(cfg, batch, max(LENGTHS) + UNSEEN, s.dtype, s.device)

    def forward(tokens, pos):
        return decode_one(model, tokens, pos)
    return forward, lambda n: {"tokens": torch.randint(0, cfg.vocab, (batch, n), device=s.device),
                               "pos": torch.arange(n, device=s.device)}


def dynamic_row(s: Setup, name, rounds):
    row = {"kind": "dynamic", "workload": name, "batch": 8 if name == "bert-dynamic" else 1, "mode": "default",
           "lengths": list(LENGTHS), "unseen_length": UNSEEN}
    try:
        model, inputs = (bert_calls if name == "bert-dynamic" else prefill_calls)(s)
        lengths = [LENGTHS[i % len(LENGTHS)] for i in range(12)]
        if s.tiny:
            lengths = [n // 8 for n in lengths]
        unseen = inputs(UNSEEN // 8 if s.tiny else UNSEEN)
        batches = [inputs(n) for n in lengths]
        compiled = fuselens.compile(model)
        calls = s.calls("default", s.reuse(row, {"eager": model, "fuselens": compiled, "inductor": torch.compile(model)}),
                        row)
        with torch.no_grad():
            for c, fn in calls.items():
                t = time.perf_counter()
                for kw in batches:
                    fn(**kw)
                s.sync()
                row[f"total_s_{c}"] = round(time.perf_counter() - t, 3)
                fn(**unseen)  # (its compile, where there is one, is not the steady time)
            times = in_rounds({c: (lambda fn=fn: fn(**unseen)) for c, fn in calls.items()}, s.ms)
        for c, ms in times.items():
            row[f"{c}_ms"] = round(median(ms), 3)
        entries = fuselens.inspect(compiled)
        row["fuselens_graphs"] = sum(len(e.graphs) for e in entries)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    torch._dynamo.reset()
    return row


# -- the run -----------------------------------------------------------------------------------------

def key(r):
    return r["kind"], r["workload"], r["batch"], r["mode"]


# a row's Inductor columns (what --inductor-from copies from an earlier run)
INDUCTOR_COLUMNS = ("inductor_", "mbu_inductor", "total_s_inductor")


def merge(paths):
    return suite.merge(paths, key, "decode")


def save(rows, path, here):
    if path:
        pathlib.Path(path).write_text(json.dumps({"machine": here, "rows": rows}, indent=1))


def print_table(rows):
    print(f"\n{'workload':18} {'b':>2} {'mode':15} {'eager':>8} {'fuselens':>8} {'inductor':>8} {'fl/ind':>6} "
          f"{'mbu fl':>6} {'mbu ind':>7} {'peak fl/ind MB':>15} {'held fl/ind MB':>15}")
    for r in rows:
        if r["kind"] == "decode":
            e, f, i = (r.get(f"{c}_ms_per_token") for c in COMPILERS)
            extra = f"{fmt(r.get('mbu_fuselens'), '6.2f')} {fmt(r.get('mbu_inductor'), '7.2f')} " \
                    f"{fmt(r.get('fuselens_peak_mb'), '.0f')}/{fmt(r.get('inductor_peak_mb'), '.0f')} " \
                    f"{fmt(r.get('fuselens_held_mb'), '.0f')}/{fmt(r.get('inductor_held_mb'), '.0f')}"
        else:
            e, f, i = (r.get(f"{c}_ms") for c in COMPILERS)
            extra = "total s " + "/".join(fmt(r.get(f"total_s_{c}"), ".2f") for c in COMPILERS)
        ratio = f / i if f and i else None
        print(f"{r['workload']:18} {r['batch']:>2} {r['mode']:15} {fmt(e, '8.3f')} {fmt(f, '8.3f')} {fmt(i, '8.3f')} "
              f"{fmt(ratio, '6.2f')} {extra}")
        for k in ("error", *(f"{c}_error" for c in COMPILERS)):
            if r.get(k):
                print(f"{'':22}{k}: {r[k][:150]}")


def isolated(a, name, batch) -> list:
    """The rows of one workload, run by a process of their own. If it dies of a signal, it is run
    again without the compiler its progress file names (that row's `<compiler>_error` says so);
    a crash that names none, or the same one again, is the rows' error."""
    skip, common = [], ["--device", a.device, "--rounds", str(a.rounds), "--peak-gbs", str(a.peak_gbs)]
    common += ["--quick"] * a.quick + (["--layers", str(a.layers)] if a.layers else [])
    common += ["--batch", str(batch)] if batch else []
    common += ["--inductor-from", a.inductor_from] if a.inductor_from else []
    with tempfile.TemporaryDirectory(prefix="fl-decode-row-") as d:
        out, progress = pathlib.Path(d, "rows.json"), pathlib.Path(d, "progress")
        while True:
            progress.unlink(missing_ok=True)
            done = subprocess.run([sys.executable, __file__, "--in-process", "--only", name, "--json", str(out),
                                   "--progress", str(progress), *common, *(f"--skip={x}" for x in skip)])
            if done.returncode == 0:
                return json.loads(out.read_text())["rows"]
            why = f"signal {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
            running = progress.read_text() if progress.exists() else None
            if running is None or any(x.startswith(running + ":") for x in skip):
                return [{"kind": "decode" if name in DECODE else "dynamic", "workload": name, "batch": batch,
                         "mode": "default", "error": f"the process died ({why}) running {running or 'no compiler'}"}]
            mode, compiler = running.split(":")
            print(f"[decode] {name}: {compiler} killed the process ({why}) in mode {mode}: run again without it", flush=True)
            skip.append(f"{running}:killed the process ({why})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="workloads, comma-separated: " + ", ".join(DECODE + DYNAMIC))
    ap.add_argument("--batch", help="batch sizes of the decode rows, comma-separated (default 1,8)")
    ap.add_argument("--layers", type=int, help="cut the decoders to this many layers (a 7B in a 10-minute call)")
    ap.add_argument("--quick", action="store_true", help="few tokens, small models: the whole set in minutes")
    ap.add_argument("--rounds", type=int, default=run.ROUNDS)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the GPU's memory bandwidth (H200: 4800 GB/s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the rows here (after every workload)")
    ap.add_argument("--merge", nargs="+", help="merge these runs' JSON into --json (rows by kind, workload, batch, mode)")
    ap.add_argument("--inductor-from", help="a decode JSON of the same GPU and torch: Inductor's columns of its rows "
                                            "reused, not measured again")
    ap.add_argument("--in-process", action="store_true", help="run every workload in this process (a GPU's default: one each)")
    ap.add_argument("--progress", help=argparse.SUPPRESS)  # (a workload's own process: see isolated)
    ap.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.merge:
        rows, here = merge(a.merge)
        save(rows, a.json, here)
        print_table(rows)
        return
    names = a.only.split(",") if a.only else list(DECODE + DYNAMIC)
    unknown = [n for n in names if n not in DECODE + DYNAMIC]
    if unknown:
        sys.exit(f"decode: no workload named {', '.join(unknown)} ({', '.join(DECODE + DYNAMIC)})")
    run.ROUNDS = a.rounds  # (in_rounds reads it)
    s, here = Setup(a), machine()
    batches = [int(b) for b in a.batch.split(",")] if a.batch else [1, 8]
    caches = tempfile.TemporaryDirectory(prefix="fl-decode-")
    empty_disk_caches(caches.name)
    warnings.filterwarnings("ignore", category=FutureWarning)  # (transformers' deprecations, each call)
    rows = []
    for name in names:
        for batch in batches if name in DECODE else [None]:
            print(f"[decode] {name} batch {batch}", flush=True)
            t = time.perf_counter()
            if s.cuda and not a.in_process:
                new = isolated(a, name, batch)
            else:
                new = decode_rows(s, name, batch, a.rounds) if name in DECODE else [dynamic_row(s, name, a.rounds)]
            for r in new:
                r["row_s"] = round(time.perf_counter() - t, 1)
            rows += new
            save(rows, a.json, here)
            gc.collect()
            if s.cuda:
                torch.cuda.empty_cache()
    print_table(rows)


if __name__ == "__main__":
    main()
