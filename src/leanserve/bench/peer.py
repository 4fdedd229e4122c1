"""`leanserve bench formats --peer llama.cpp`: the peer engine in the same run. llama.cpp (as vendored by
llama-cpp-python, the optional extra `peer`) converts the same published checkpoint with its own converter
(convert_hf_to_gguf.py: FP8 linears to Q8_0, FP4 experts repacked to MXFP4) and decodes at batch 1 beside
leanserve's published runner: same threads, same prompt, steps alternating between the two (which goes first
alternating too), medians. Then the tokens leanserve produced are fed to llama.cpp in one pass (teacher forcing),
and the share of positions where llama.cpp's argmax is leanserve's greedy token is reported.

The converter is not in the wheel: it comes from llama-cpp-python's source distribution of the same version,
found at --peer-converter, else at $LEANSERVE_LLAMA_CPP_CONVERTER, else unpacked under CACHE (docs/checkpoints.md).
The bench's random checkpoint has no tokenizer, and the converter requires one; a minimal byte-level BPE is written
into a directory of links beside the checkpoint (the checkpoint itself is never touched), and, since no text is
ever tokenized here, the converter is told to record llama.cpp's default pre-tokenizer for it instead of refusing
a tokenizer it does not know. Every tensor is converted by the converter's own code.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PEERS = ("llama.cpp",)
MIN_VERSION = (0, 3, 36)  # the first llama-cpp-python whose llama.cpp runs DeepSeek-V4 (GGUF arch deepseek4)
INSTALL = "pip install -e '.[peer]'"
CONVERTER_ENV = "LEANSERVE_LLAMA_CPP_CONVERTER"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leanserve"
CONVERTER = "convert_hf_to_gguf.py"
PROMPT_LEN = 16  # formats_bench's prompt: tokens 3..18, then token 5 fed at position 16 (common.GreedyDecoder)
AGREE_TOKENS = 64  # leanserve's greedy tokens the agreement is counted over (steps past the timed ones untimed)
RATES = (0, 4, 128)  # the compression rates llama.cpp's DeepSeek-V4 loader accepts
LEANSERVE_FORMAT = "FP8 + FP4 (published)"


class PeerMissing(ValueError):
    """What --peer needs and is not there (a ValueError: the CLI prints it as one line)."""


@dataclass
class PeerRow:
    engine: str
    format: str
    step_ms: float
    tok_s: float
    vs_peer: float  # tok/s / llama.cpp's
    agreement: float | None  # teacher-forced: the share of positions where llama.cpp's argmax is leanserve's token


PEER_HEADERS = {
    "engine": "engine",
    "format": "format",
    "step_ms": "step ms",
    "tok_s": "tok/s",
    "vs_peer": "x llama.cpp",
    "agreement": "agree (teacher-forced)",
}


def installed_version() -> tuple[int, ...] | None:
    """llama-cpp-python's version as integers, None where it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        text = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def sdist_dir(version: tuple[int, ...]) -> Path:
    """Where the default search expects the source distribution of `version` unpacked."""
    return CACHE / f"llama_cpp_python-{'.'.join(map(str, version))}"


def find_converter(option: str | None, version: tuple[int, ...], env=os.environ) -> Path | None:
    """convert_hf_to_gguf.py: at `option` (the script, llama.cpp's directory or an unpacked source distribution of
    llama-cpp-python), else at $LEANSERVE_LLAMA_CPP_CONVERTER (the same), else in sdist_dir(version); None if not."""
    place = option or env.get(CONVERTER_ENV) or sdist_dir(version)
    path = Path(place).expanduser()
    for candidate in (path, path / CONVERTER, path / "vendor" / "llama.cpp" / CONVERTER):
        if candidate.name == CONVERTER and candidate.is_file():
            return candidate.resolve()
    return None


def require(option: str | None) -> Path:
    """The converter to use; PeerMissing, one sentence naming what is missing and how to get it, if llama-cpp-python
    (MIN_VERSION or later), gguf or the converter is not there. Cheap: the bench calls it before any long work."""
    version = installed_version()
    need = ".".join(map(str, MIN_VERSION))
    if version is None or version < MIN_VERSION:
        have = "is not installed" if version is None else f"is {'.'.join(map(str, version))}"
        raise PeerMissing(
            f"--peer llama.cpp needs llama-cpp-python {need} or later, which {have}: install the extra with "
            f"`{INSTALL}` (it builds llama.cpp from source, 10-20 minutes)."
        )
    if importlib.util.find_spec("gguf") is None:
        raise PeerMissing(f"--peer llama.cpp needs the gguf package, which is not installed: `{INSTALL}`.")
    converter = find_converter(option, version)
    if converter is None:
        v = ".".join(map(str, version))
        where = f"--peer-converter {option}" if option else f"${CONVERTER_ENV} or {sdist_dir(version)}"
        raise PeerMissing(
            f"--peer llama.cpp needs llama.cpp's {CONVERTER}, not found at {where}: unpack llama-cpp-python's "
            f"source distribution there with `pip download --no-deps --no-binary :all: llama-cpp-python=={v} "
            f"-d {CACHE} && tar xzf {CACHE}/llama_cpp_python-{v}.tar.gz -C {CACHE}`."
        )
    return converter


def agreement(ours: Sequence[int], theirs: Sequence[int]) -> float:
    """The share of positions where two engines' tokens are the same."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"agreement needs two equally long, non-empty token lists ({len(ours)} and {len(theirs)}).")
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def peer_rows(
    leanserve_s: float, peer_s: float, peer_format: str, agree: float, inputs: dict[str, str] | None = None
) -> list[PeerRow]:
    """The two rows from each engine's median batch-1 step (seconds): tok/s, and each against llama.cpp's.
    `inputs`: EngineConfig's fp4_inputs / fp8_inputs, named in leanserve's format where not float32."""
    ours = LEANSERVE_FORMAT + "".join(
        f", {name[:3].upper()} x {value} inputs" for name, value in (inputs or {}).items() if value != "float32"
    )
    return [
        PeerRow("leanserve", ours, round(leanserve_s * 1e3, 2), round(1 / leanserve_s, 2),
                round(peer_s / leanserve_s, 2), None),
        PeerRow("llama.cpp", peer_format, round(peer_s * 1e3, 2), round(1 / peer_s, 2), 1.0, round(agree, 3)),
    ]  # fmt: skip


def format_name(type_bytes: dict[str, int], share: float = 0.1) -> str:
    """A GGUF's weight format from its tensors' bytes by type: the types holding at least `share` of the bytes,
    most first, joined with " + ", and the others in parentheses, e.g. "MXFP4 + Q8_0 (+ BF16, F32)"."""
    total = sum(type_bytes.values())
    ranked = sorted(type_bytes, key=lambda t: -type_bytes[t])
    main = [t for t in ranked if type_bytes[t] >= share * total] or ranked[:1]
    rest = [t for t in ranked if t not in main]
    return " + ".join(main) + (f" (+ {', '.join(rest)})" if rest else "")


def gguf_type_bytes(path: Path) -> dict[str, int]:
    """The bytes of a GGUF's tensors, by tensor type (read from the file)."""
    from gguf import GGUFReader

    out: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return out


# Run by the converter's interpreter: the converter with llama.cpp's default pre-tokenizer recorded for the bench's
# tokenizer (which its list of known tokenizers cannot hold: no text is tokenized here); all else is its own.
_DRIVER = """
import runpy, sys
from pathlib import Path
converter, src, out = sys.argv[1:4]
here = Path(converter).parent
sys.path[:0] = [str(here), str(here / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [converter, src, "--outfile", out]
runpy.run_path(converter, run_name="__main__")
"""


def write_tokenizer(dst: Path) -> None:
    """A minimal byte-level BPE (three special tokens, the 256 bytes, one merge) as tokenizer.json and
    tokenizer_config.json: what the converter reads a vocabulary from; the rest of the ids it pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2: the bench config's bos and eos
    vocab = {t: i for i, t in enumerate([*specials, *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(dst / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config))


def convert(published: Path, converter: Path, log=print) -> Path:
    """published's GGUF (published.gguf beside it), converted once and reused while newer than every file of the
    checkpoint. The converter reads a directory of links to the checkpoint's files plus write_tokenizer's."""
    rates = json.loads((published / "config.json").read_text()).get("compress_ratios", [])
    if any(r not in RATES for r in rates):
        raise ValueError(
            f"llama.cpp's DeepSeek-V4 loader takes compression rates {RATES} only; {published} has {rates}."
        )
    out = published.parent / "published.gguf"
    newest = max(p.stat().st_mtime for p in published.iterdir())
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    src = published.parent / "published-for-llama.cpp"
    src.mkdir(exist_ok=True)
    for p in src.iterdir():
        p.unlink()
    for p in published.iterdir():
        (src / p.name).symlink_to(p.resolve())
    write_tokenizer(src)
    part, log_file = out.with_suffix(".gguf.part"), out.with_suffix(".gguf.log")
    log(f"converting {published} to {out} with {converter} (log: {log_file}) ...")
    with open(log_file, "w") as f:
        done = subprocess.run(
            [sys.executable, "-c", _DRIVER, str(converter), str(src), str(part)], stdout=f, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = log_file.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"llama.cpp's converter failed ({tail[0]}); its log is {log_file}.")
    part.replace(out)
    return out


class _LlamaDecoder:
    """Greedy batch-1 decode on llama.cpp, one step per call: the prompt formats_bench's decoder has, then token 5,
    then each argmax fed back."""

    def __init__(self, llm, prompt_len: int) -> None:
        import numpy as np

        self.llm, self.np = llm, np
        llm.reset()
        llm.eval(list(range(3, 3 + prompt_len)))
        self.token = 5

    def __call__(self) -> float:
        start = time.perf_counter()
        self.llm.eval([self.token])
        self.token = int(self.np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return time.perf_counter() - start


NO_EXTRA_BUFFERS = (
    "this host has AMX, and with them llama.cpp's scheduler stops on this model (GGML_ASSERT(*cur_backend_id != -1) "
    "in ggml_backend_sched_split_graph, llama-cpp-python 0.3.36)"
)


def extra_buffers(features: dict[str, bool] | None = None) -> bool:
    """Whether llama.cpp gets its extra weight buffer types (its default): not on a host with AMX (NO_EXTRA_BUFFERS).
    `features`: the host's as llvmlite names them (get_host_cpu_features), by default this one's."""
    if features is None:
        import llvmlite.binding as llvm

        features = dict(llvm.get_host_cpu_features())
    return not features.get("amx-tile", False)


@contextlib.contextmanager
def _model_params(**fields):
    """llama_cpp.Llama with `fields` set in its llama_model_params, which its constructor does not take: the default
    params it starts from are given the fields while the block runs."""
    from llama_cpp import llama as llama_module

    raw = llama_module.llama_cpp  # (the ctypes bindings, where the constructor looks the defaults up)
    default = raw.llama_model_default_params

    def params():
        p = default()
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    raw.llama_model_default_params = params
    try:
        yield
    finally:
        raw.llama_model_default_params = default


def teacher_forced(llm, tokens: Sequence[int], first: int) -> list[int]:
    """llama.cpp's argmax at each position from `first` on, with `tokens` as its input (one pass)."""
    import numpy as np

    llm.reset()
    llm.eval(list(tokens))
    return [int(np.argmax(llm.scores[i])) for i in range(first, len(tokens))]


def peer_bench(
    root: str | Path,
    converter: Path,
    rounds: int = 20,
    prompt_len: int = PROMPT_LEN,
    agree_tokens: int = AGREE_TOKENS,
    log=print,
    inputs: dict[str, str] | None = None,
) -> tuple[list[PeerRow], list[str]]:
    """(rows, notes): batch-1 decode of root/published on leanserve and on llama.cpp (its GGUF), steps alternating,
    medians of `rounds` after 2 warm-up steps each; and the teacher-forced agreement of llama.cpp with leanserve's
    greedy tokens: those of its warm-up and timed steps, continued untimed to `agree_tokens` (at least)."""
    import llama_cpp
    import torch

    from leanserve.bench.common import GreedyDecoder, stage_runner

    published = Path(root) / "published"
    gguf = convert(published, converter, log)
    peer_format = format_name(gguf_type_bytes(gguf))
    threads = torch.get_num_threads()
    max_len = prompt_len + max(rounds + 2, agree_tokens) + 8
    n_ctx = -(-max_len // 256) * 256
    runner = stage_runner(published, 1, max_len, **(inputs or {}))
    extra = extra_buffers()
    with _model_params(use_extra_bufts=extra):
        llm = llama_cpp.Llama(
            str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
            verbose=False,
        )  # fmt: skip
    ours, theirs = GreedyDecoder(runner, 1, prompt_len), _LlamaDecoder(llm, prompt_len)
    fed, produced = [], []  # leanserve's input and greedy token at each step

    def leanserve_step() -> float:
        fed.append(ours.tokens[0])
        seconds = ours()
        produced.append(ours.tokens[0])
        return seconds

    for _ in range(2):  # warm-up
        leanserve_step(), theirs()
    times: dict[str, list[float]] = {"leanserve": [], "llama.cpp": []}
    steps = {"leanserve": leanserve_step, "llama.cpp": theirs}
    for r in range(rounds):
        for name in steps if r % 2 == 0 else list(steps)[::-1]:
            times[name].append(steps[name]())
    while len(fed) < agree_tokens:
        leanserve_step()
    del runner
    sequence = list(range(3, 3 + prompt_len)) + fed
    agree = agreement(produced, teacher_forced(llm, sequence, prompt_len))
    rows = peer_rows(
        statistics.median(times["leanserve"]), statistics.median(times["llama.cpp"]), peer_format, agree, inputs
    )
    version = importlib.metadata.version("llama-cpp-python")
    notes = [
        f"peer: llama.cpp from llama-cpp-python {version}, {gguf} ({gguf.stat().st_size / 1e9:.2f} GB) converted "
        f"by {converter}; both on {threads} threads, the same {prompt_len}-token prompt (context room: llama.cpp "
        f"{n_ctx} tokens, leanserve {max_len}), batch 1, steps alternating, {rounds} per engine after 2 warm-up, "
        "medians",
        "llama.cpp's extra weight buffers (AMX, repacked layouts): "
        + ("on (its default)" if extra else f"off: {NO_EXTRA_BUFFERS}"),
        f"agreement: llama.cpp fed leanserve's {len(fed)} decode inputs after the prompt in one pass; its argmax "
        f"equals leanserve's greedy token at {round(agree * len(fed))} of {len(fed)} positions (random weights: "
        "near-ties are common)",
    ]
    return rows, notes
