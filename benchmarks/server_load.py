"""Load a running OpenAI-compatible server with K concurrent streaming chat clients and print JSON:
total completion tokens/s, requests/s, per-request latency p50/p90 and time to first token p50/p90.

    strata-jax serve --model M.gguf --parallel 4 &       # this script starts nothing itself
    python benchmarks/server_load.py http://127.0.0.1:8080 --clients 1 --requests 8 --max-tokens 64
    python benchmarks/server_load.py http://127.0.0.1:8080 --clients 4 --requests 16 --max-tokens 64

Each client sends its requests one after another. Prompts are a fixed list, cycled, each headed by
its request number, so runs are comparable and no request finds another's prompt in the server's
prefix cache (beyond the chat template's first tokens). Warm-up requests (every prompt once, the
clients at once, not timed) compile what the timed run needs: the batched decode and the prompts'
prefill sizes. Token counts come from the server's usage chunk (stream_options.include_usage), so
requests that stop early count what they produced.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import threading
import time

import httpx

PROMPTS = [
    "Write a Python function that reverses a singly linked list.",
    "Explain what a hash map is in three sentences.",
    "Write a haiku about compilers.",
    "List five uses of binary search.",
    "What does the SQL JOIN keyword do? Give an example.",
    "Write a bash one-liner that counts lines in all .py files.",
    "Describe the difference between a process and a thread.",
    "Write a JavaScript function that debounces another function.",
]


def one_request(http: httpx.Client, url: str, headers: dict, i: int, args) -> dict:
    content = f"Request {i}. {PROMPTS[i % len(PROMPTS)]}"
    body = {"model": "any", "messages": [{"role": "user", "content": content}],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": not args.no_cache_prompt}
    t0 = time.perf_counter()
    ttft, usage, timings = None, None, None
    with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: "):])
            if "error" in ev:
                return {"error": str(ev["error"])[:200]}
            for choice in ev.get("choices") or []:
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
    done = time.perf_counter() - t0
    return {"latency": done, "ttft": ttft if ttft is not None else done,
            "tokens": (usage or {}).get("completion_tokens", 0),
            "decode_tok_s": (timings or {}).get("predicted_per_second")}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run(args) -> dict:
    url = args.url.rstrip("/")
    key = args.api_key or os.environ.get("STRATA_JAX_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(args.timeout, connect=10)
    with httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=args.clients + 1)) as http:
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            warm_ids = range(-max(len(PROMPTS), args.clients), 0)  # negative: other numbers than the timed run's
            warm = list(pool.map(lambda i: one_request(http, url, headers, i, args), warm_ids))
            if any("error" in w for w in warm):
                raise SystemExit(f"warm-up failed: {[w['error'] for w in warm if 'error' in w]}")
            lock, next_i, results = threading.Lock(), [0], []

            def client() -> None:
                while True:
                    with lock:
                        i = next_i[0]
                        next_i[0] += 1
                    if i >= args.requests:
                        return
                    res = one_request(http, url, headers, i, args)
                    with lock:
                        results.append(res)

            t0 = time.perf_counter()
            for f in [pool.submit(client) for _ in range(args.clients)]:
                f.result()
            wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    ms = lambda x: None if x is None else round(x * 1e3, 1)  # noqa: E731
    decode = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    return {
        "url": url, "clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "wall_s": round(wall, 3), "completion_tokens": tokens,
        "tok_per_s": round(tokens / wall, 2), "req_per_s": round(len(ok) / wall, 3),
        "latency_ms": {"p50": ms(pct(lat, 0.5)), "p90": ms(pct(lat, 0.9))},
        "ttft_ms": {"p50": ms(pct(ttft, 0.5)), "p90": ms(pct(ttft, 0.9))},
        "per_request_decode_tok_s_p50": round(statistics.median(decode), 2) if decode else None,
        "errors": [r["error"] for r in results if "error" in r],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--clients", "-k", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", "-n", type=int, default=16, help="timed requests in all (default 16)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--no-cache-prompt", action="store_true", help="send cache_prompt=false")
    p.add_argument("--api-key", default=None, help="default: $STRATA_JAX_API_KEY")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
