"""Data pipeline at corpus scale: preparation throughput, loader memory, launch latency.

Three measurements, corpora generated here from the embedded one (the standard library's
.py files, copied as .txt documents; nothing is committed):

1. Preparation throughput, tokens/s, with the same SentencePiece tokenizer (trained once,
   then given as ``data.tokenizer``): ``prepare_shards`` with one process (one thread) and
   with ``--workers`` processes, against ``datasets``' ``map(num_proc=--workers)`` running
   the same encode function (each run from a fresh cache directory).
2. Loader resident memory: synthetic token shards of 1x, 4x and 16x ``--rss-tokens``; in a
   fresh process per size, RSS after reading ``--batches`` batches (8 x 1025 tokens each),
   minus the RSS before the loader was built.
3. Launch to first step: a ``--launch-gb`` GB text corpus is prepared, then
   ``python -m collage_train`` (gpt_tiny, one step) is launched on it; the time from launch
   to the first line of metrics.jsonl.

    python scripts/bench_data.py --text-mb 40 --launch-gb 1

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from common import parser, publish, table
from runs import python_json, quiet_run, start_training

from collage_train.data.progress import write_json_atomic
from collage_train.data.settings import DataSettings
from collage_train.data.shards import prepare_shards, prepare_tokenizer
from collage_train.data.sources import open_source
from collage_train.data.store import MANIFEST_FORMAT, MANIFEST_VERSION
from collage_train.data.tokenizer import Tokenizer, TokenizerSettings


def write_corpus(root: Path, megabytes: float) -> Path:
    """Copy the standard library's .py files as .txt documents until ``megabytes`` MB."""
    root.mkdir(parents=True, exist_ok=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in sources]
    texts = [text for text in texts if text.strip()]
    target, written, count = megabytes * 1e6, 0, 0
    while written < target:
        text = texts[count % len(texts)]
        (root / f"{count:07d}.txt").write_text(text)
        written += len(text.encode())
        count += 1
    return root


def data_cfg(corpus: Path, cache: Path, **extra: object) -> SimpleNamespace:
    fields = {"source": "files", "paths": [str(corpus)], "cache_dir": str(cache)}
    return SimpleNamespace(**(fields | extra))


def trained_tokenizer(corpus: Path, cache: Path) -> Path:
    """Train the default 8192-piece tokenizer on the corpus once; return its file."""
    settings = DataSettings.from_config(data_cfg(corpus, cache))
    source = open_source(settings)
    tokenizer = prepare_tokenizer(
        source, source.fingerprint(), TokenizerSettings(8192, 4_000_000), cache
    )
    return tokenizer.model_path


def timed_prepare(corpus: Path, tokenizer: Path, cache: Path, workers: int) -> tuple[float, int]:
    """(seconds, tokens) of one preparation from an empty cache directory."""
    shutil.rmtree(cache, ignore_errors=True)
    settings = DataSettings.from_config(
        data_cfg(corpus, cache, tokenizer=str(tokenizer), num_workers=workers)
    )
    started = time.perf_counter()
    directory = prepare_shards(settings)
    seconds = time.perf_counter() - started
    return seconds, json.loads((directory / "manifest.json").read_text())["total_tokens"]


_datasets_tokenizer: Tokenizer | None = None


def datasets_encode(batch: dict[str, list[str]], tokenizer_path: str) -> dict[str, list]:
    """The encode function given to ``datasets.map``: the same tokenizer, single-threaded."""
    global _datasets_tokenizer
    if _datasets_tokenizer is None:
        _datasets_tokenizer = Tokenizer.load(tokenizer_path)
        _datasets_tokenizer.single_threaded()
    tokenizer = _datasets_tokenizer
    ids = tokenizer.encode_batch(batch["text"])
    return {"ids": [[*row, tokenizer.eot_id] for row in ids]}


def timed_datasets(corpus: Path, tokenizer: Path, cache: Path, workers: int) -> tuple[float, int]:
    """(seconds, tokens) of ``datasets`` reading the files and ``map(num_proc=workers)``."""
    import datasets

    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    started = time.perf_counter()
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.txt"))]
    dataset = datasets.Dataset.from_dict({"text": texts})
    mapped = dataset.map(
        datasets_encode,
        batched=True,
        batch_size=64,
        num_proc=workers,
        remove_columns=["text"],
        fn_kwargs={"tokenizer_path": str(tokenizer)},
        cache_file_name=str(cache / "mapped.arrow"),
    )
    seconds = time.perf_counter() - started
    tokens = sum(len(row) for row in mapped.with_format("numpy")["ids"])
    return seconds, tokens


def synthetic_corpus(directory: Path, tokens: int, shard_tokens: int = 1 << 26) -> None:
    """Random uint16 shards and a manifest (no tokenizer check needed by the loader)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards = []
    for index, start in enumerate(range(0, tokens, shard_tokens)):
        count = min(shard_tokens, tokens - start)
        name = f"shards/{index:06d}.bin"
        (directory / "shards").mkdir(exist_ok=True)
        rng.integers(0, 8192, count, dtype=np.uint16).tofile(directory / name)
        shards.append({"file": name, "tokens": count})
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "dtype": "uint16",
        "shard_tokens": shard_tokens,
        "total_tokens": tokens,
        "shards": shards,
    }
    write_json_atomic(directory / "manifest.json", manifest)


_RSS_PROBE = """
import json, sys
from pathlib import Path
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from collage_train.data.loader import TokenLoader
from collage_train.data.store import load_manifest, open_splits
directory, batches = Path(sys.argv[1]), int(sys.argv[2])
before = rss()
manifest = load_manifest(directory)
train, _, _ = open_splits(directory, manifest, 0.01)
loader = TokenLoader(train, seq_len=1024, batch_size=8, seed=0)
for _ in range(batches):
    loader.next_batch()
print(json.dumps({"growth": rss() - before, "samples": loader.num_samples}))
"""


def loader_rss(directory: Path, batches: int) -> dict[str, int]:
    return python_json(_RSS_PROBE, str(directory), str(batches))


def launch_to_first_step(corpus: Path, cache: Path, run_dir: Path) -> float:
    """Seconds from launching a one-step training run to its first metrics line."""
    metrics = run_dir / "metrics.jsonl"
    overrides = [
        "data=files",
        f"data.paths=[{corpus}]",
        f"data.cache_dir={cache}",
        *quiet_run(1),
        "train.eval_every=1000",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    proc = start_training(overrides)
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise RuntimeError(f"training exited: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    proc.wait()
    return seconds


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--text-mb", type=float, default=40.0, help="throughput corpus size")
    cli.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    cli.add_argument("--rss-tokens", type=int, default=1 << 26, help="1x corpus, tokens")
    cli.add_argument("--batches", type=int, default=500)
    cli.add_argument("--launch-gb", type=float, default=1.0, help="0 skips the launch test")
    args = cli.parse_args()
    rows: list[dict[str, object]] = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus", args.text_mb)
        tokenizer = trained_tokenizer(corpus, work / "tokenizer-cache")
        runs = {
            "prepare, 1 process": timed_prepare(corpus, tokenizer, work / "c1", 1),
            f"prepare, {args.workers} processes": timed_prepare(
                corpus, tokenizer, work / "cn", args.workers
            ),
            f"datasets map(num_proc={args.workers})": timed_datasets(
                corpus, tokenizer, work / "ds", args.workers
            ),
        }
        base = runs["prepare, 1 process"]
        for name, (seconds, tokens) in runs.items():
            rows.append(
                {
                    "measure": f"{name}, {args.text_mb:g} MB text",
                    "value": f"{tokens / seconds / 1e6:.2f} M tokens/s ({seconds:.1f} s)",
                    "ratio": f"{(tokens / seconds) / (base[1] / base[0]):.2f}x of 1 process",
                    "kind": "prepare",
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                }
            )
        first = None
        for scale in (1, 4, 16):
            directory = work / f"synthetic-{scale}"
            synthetic_corpus(directory, scale * args.rss_tokens)
            probe = loader_rss(directory, args.batches)
            shutil.rmtree(directory)
            first = probe["growth"] if first is None else first
            rows.append(
                {
                    "measure": f"loader RSS, {scale}x = {scale * args.rss_tokens / 1e6:.0f}M "
                    f"tokens, {args.batches} batches",
                    "value": f"{probe['growth'] / 2**20:.1f} MB",
                    "ratio": f"{(probe['growth'] - first) / 2**20:+.1f} MB vs 1x",
                    "kind": "loader_rss",
                    "scale": scale,
                    "rss_growth_bytes": probe["growth"],
                }
            )
        if args.launch_gb > 0:
            big = write_corpus(work / "big", args.launch_gb * 1000)
            cache = work / "big-cache"
            started = time.perf_counter()
            prepared = prepare_shards(
                DataSettings.from_config(data_cfg(big, cache, vocab_size=8192))
            )
            prepare_seconds = time.perf_counter() - started
            tokens = json.loads((prepared / "manifest.json").read_text())["total_tokens"]
            rows.append(
                {
                    "measure": f"prepare {args.launch_gb:g} GB text (tokenizer trained), "
                    f"{args.workers} processes",
                    "value": f"{prepare_seconds:.0f} s, {tokens / 1e6:.0f}M tokens",
                    "ratio": f"{tokens / prepare_seconds / 1e6:.2f} M tokens/s",
                    "kind": "prepare_large",
                    "tokens": tokens,
                }
            )
            seconds = launch_to_first_step(big, cache, work / "run")
            rows.append(
                {
                    "measure": f"launch to first step, prepared {args.launch_gb:g} GB corpus",
                    "value": f"{seconds:.1f} s",
                    "ratio": "gpt_tiny, CPU",
                    "kind": "launch",
                    "seconds": seconds,
                }
            )
    publish(
        args,
        table(
            ["measure", "value", "ratio"], ([r["measure"], r["value"], r["ratio"]] for r in rows)
        ),
        rows,
        "Data pipeline at corpus scale (scripts/bench_data.py)",
        "Preparation with the same 8192-piece SentencePiece tokenizer in every row; "
        "loader RSS growth measured in a fresh process per corpus size. Load average "
        f"when the benchmark started: {load:.2f} (other processes on the same cores "
        "lower the parallel rows).",
    )


if __name__ == "__main__":
    main()
